"""An unset learning rate is chosen by the model's size: the tiny models' rates on them, a real model's above.

Before, the tiny model's rates were the plain defaults, and a real model trained without a rate got SFT at 3e-3 and
RL at 2e-3, a thousand times what it takes. The end-to-end test runs a model of 58M parameters (the tiny model's
width, one layer, the real Qwen tokenizer and its 151,936-token vocabulary, untied head) through collect, SFT and RL.
"""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, Qwen3Config

from trajlab.config import RLSettings, SFTSettings
from trajlab.models.families import export_family
from trajlab.models.loading import load_model
from trajlab.train.rates import TINY_MODEL_PARAMETERS, default_learning_rate, with_learning_rate

ROOT = Path(__file__).resolve().parents[2]


def test_the_rate_by_size_and_adapter():
    assert default_learning_rate("sft", 2_459_584, lora=False) == default_learning_rate("sft", 1, lora=True) == 3e-3
    assert default_learning_rate("rl", TINY_MODEL_PARAMETERS - 1, lora=True) == 2e-3
    assert default_learning_rate("sft", TINY_MODEL_PARAMETERS, lora=False) == 1e-5
    assert default_learning_rate("sft", 1_700_000_000, lora=True) == pytest.approx(1e-4)
    assert default_learning_rate("rl", 600_000_000, lora=False) == 1e-6
    assert default_learning_rate("rl", 600_000_000, lora=True) == pytest.approx(1e-5)


def test_a_set_rate_is_kept_and_an_unset_one_is_said(tiny_model_dir, caplog):
    model = load_model(tiny_model_dir)
    assert with_learning_rate(RLSettings(learning_rate=5e-4), model, "rl").learning_rate == 5e-4
    with caplog.at_level(logging.INFO, logger="trajlab.train.rates"):
        chosen = with_learning_rate(SFTSettings(), model, "sft")
    assert chosen.learning_rate == 3e-3 and SFTSettings().learning_rate is None
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert "sft.learning_rate is not set: 3e-03, the tiny models' rate, for a model of 2,459,584" in record.message


def test_a_real_size_model_gets_a_real_rate_with_a_warning(caplog):
    with torch.device("meta"):  # Qwen3-0.6B's shapes at 2 layers, without allocating its weights
        model = AutoModelForCausalLM.from_config(Qwen3Config(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, tie_word_embeddings=True))
    with caplog.at_level(logging.INFO, logger="trajlab.train.rates"):
        full = with_learning_rate(RLSettings(), model, "rl")
        adapted = with_learning_rate(RLSettings(lora={"r": 8}), model, "rl")
    assert full.learning_rate == 1e-6 and adapted.learning_rate == pytest.approx(1e-5)
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 2
    assert "a real model's full-weight rate" in caplog.records[0].message
    assert "a real model's LoRA rate" in caplog.records[1].message


@pytest.fixture(scope="module")
def real_vocabulary_model(tmp_path_factory) -> Path:
    """58M parameters, most of them the real vocabulary's embedding and head: above the tiny models' bound."""
    out = tmp_path_factory.mktemp("qwen-vocab")
    config = Qwen3Config(vocab_size=151936, hidden_size=192, intermediate_size=384, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=48, tie_word_embeddings=False,
                         bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert model.num_parameters() > TINY_MODEL_PARAMETERS
    model.save_pretrained(out)
    export_family("qwen3", out)
    return out


@pytest.mark.slow(40)
def test_a_run_without_rates_trains_a_real_size_model_at_a_real_models_rates(real_vocabulary_model, tmp_path):
    run = tmp_path / "run"
    config = {"run_dir": str(run), "env": "arithmetic", "stages": ["collect", "sft", "rl"],
              "model": {"path": str(real_vocabulary_model)},
              "rollout": {"max_turns": 4, "max_new_tokens": 64, "concurrency": 2},
              "collect": {"episodes": 2},
              "sft": {"max_steps": 1, "batch_size": 2, "warmup_steps": 0, "lr_scheduler": "constant",
                      "logging_steps": 1},
              "rl": {"steps": 1, "tasks_per_step": 1, "group_size": 2, "warmup_steps": 0,
                     "lr_scheduler": "constant", "rate_by_failures": False}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "trajlab.cli", "run", str(path)], capture_output=True, text=True,
                            cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert "sft.learning_rate is not set: 1e-05, a real model's full-weight rate" in output
    assert "rl.learning_rate is not set: 1e-06, a real model's full-weight rate" in output
    sft = [json.loads(line) for line in (run / "sft" / "metrics.jsonl").read_text().splitlines()]
    rl = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [s["optim/lr"] for s in sft if "optim/lr" in s] == [pytest.approx(1e-5)]
    assert [s["optim/lr"] for s in rl] == [pytest.approx(1e-6)]
