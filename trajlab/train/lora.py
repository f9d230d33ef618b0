"""LoRA for both trainers: the config's ``lora`` section as a peft ``LoraConfig``.

SFT hands it to TRL's SFTTrainer and RL wraps its policy with it, so the two stages adapt the same modules with the
same rank. Its own module so that RL does not import the SFT recipe (and TRL with it) to build one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajlab.config import LoraSettings
from trajlab.errors import require

if TYPE_CHECKING:
    from peft import LoraConfig


def lora_config(settings: LoraSettings) -> LoraConfig:
    """A causal-LM LoRA config (``target_modules="all-linear"`` adapts every linear layer but the output head)."""
    peft = require("peft", feature="LoRA (--lora-r, lora: settings)", install="pip install 'trajlab[lora]'")
    return peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=settings.target_modules, task_type="CAUSAL_LM")
