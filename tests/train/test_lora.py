"""LoRA settings to a peft config, built in one module that both trainers use."""

import subprocess
import sys
from pathlib import Path

import trajlab
from trajlab.config import LoraSettings
from trajlab.train.lora import lora_config


def test_lora_config_carries_the_settings():
    config = lora_config(LoraSettings(r=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"]))
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 8, 0.1)
    assert set(config.target_modules) == {"q_proj", "v_proj"} and config.task_type == "CAUSAL_LM"
    assert lora_config(LoraSettings()).target_modules == "all-linear"


def test_rl_does_not_import_the_sft_recipe():
    code = "import sys, trajlab.recipes.rl; assert 'trajlab.train.sft' not in sys.modules, 'rl imports sft'"
    # run from this checkout, so the trajlab imported is the one under test
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(trajlab.__file__).parents[1])
