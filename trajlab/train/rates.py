"""The learning rate a run gets when its settings leave it unset, chosen by the model's size.

Why: the rates that train trajlab's tiny offline models in a few hundred steps (SFT 3e-3, RL 2e-3, chosen in
BENCHMARKS.md) are a thousand times what a real model takes; as plain defaults they wrecked any real model a user
trained without setting a rate. Above ``TINY_MODEL_PARAMETERS`` the defaults are the usual full-weight rates of the
field (SFT 1e-5, RL 1e-6, as ``configs/qwen3-1.7b-bfcl.yaml``), ten times higher with LoRA, whose adapters take about
ten times the full-weight rate (Thinking Machines, "LoRA Without Regret", 2025).
"""

from __future__ import annotations

import logging
from typing import Literal, TypeVar

import torch

from trajlab.config import RLSettings, SFTSettings

logger = logging.getLogger(__name__)

TINY_MODEL_PARAMETERS = 50_000_000  # the tiny models have 2.5M; real-width models start above 100M
TINY_RATES = {"sft": 3e-3, "rl": 2e-3}
FULL_WEIGHT_RATES = {"sft": 1e-5, "rl": 1e-6}
LORA_RATE_FACTOR = 10

Stage = Literal["sft", "rl"]
Settings = TypeVar("Settings", SFTSettings, RLSettings)


def default_learning_rate(stage: Stage, parameters: int, *, lora: bool) -> float:
    """The rate for a model of ``parameters`` (its base weights, before any adapter)."""
    if parameters < TINY_MODEL_PARAMETERS:
        return TINY_RATES[stage]
    return FULL_WEIGHT_RATES[stage] * (LORA_RATE_FACTOR if lora else 1)


def with_learning_rate(settings: Settings, model: torch.nn.Module, stage: Stage) -> Settings:
    """``settings`` with ``learning_rate`` made concrete for ``model`` when it was left unset, saying which it took."""
    if settings.learning_rate is not None:
        return settings
    parameters = sum(p.numel() for p in model.parameters())
    rate = default_learning_rate(stage, parameters, lora=settings.lora is not None)
    tiny = parameters < TINY_MODEL_PARAMETERS
    adapter = "LoRA" if settings.lora is not None else "full-weight"
    kind = "the tiny models' rate" if tiny else f"a real model's {adapter} rate"
    logger.log(logging.INFO if tiny else logging.WARNING,  # a real model's run should say what it trains at
               "%s.learning_rate is not set: %.0e, %s, for a model of %s parameters; set %s.learning_rate to "
               "choose another.", stage, rate, kind, f"{parameters:,}", stage)
    return settings.model_copy(update={"learning_rate": rate})
