"""The YAML config of ``trajlab run``: one pydantic model per section, unknown keys are errors.

Defaults live here and nowhere else. A misspelled key fails validation with the key's path and the closest valid
name, instead of silently falling back to a default.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trajlab.rollout.engine import RolloutLimits
from trajlab.rollout.rewards import REWARDS

Stage = Literal["collect", "sft", "eval", "rl"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSettings(Section):
    path: str | None = None
    """A local Hugging Face causal-LM directory; None builds the tiny offline model."""
    init_seed: int = 0
    """Weight seed of the tiny model when ``path`` is None."""


class RolloutSettings(Section):
    max_turns: int = Field(6, ge=1)
    max_episode_tokens: int = Field(1024, ge=16)
    max_new_tokens: int = Field(48, ge=1)
    tool_timeout_s: float = Field(10.0, gt=0)
    concurrency: int = Field(32, ge=1)
    parser: str = "auto"
    system_prompt: str | None = None
    """Replaces the env's system prompt; "" means none."""

    def limits(self) -> RolloutLimits:
        return RolloutLimits(max_turns=self.max_turns, max_episode_tokens=self.max_episode_tokens,
                             tool_timeout_s=self.tool_timeout_s)


class CollectSettings(Section):
    episodes: int = Field(1000, ge=1)
    """Reference-policy demonstrations collected on the train split."""


class LoraSettings(Section):
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | str = "all-linear"


class DatasetSettings(Section):
    include_failures: bool = False
    shortest_per_task: bool = False
    max_tokens: int | None = None


class SFTSettings(Section):
    epochs: float = Field(2.0, gt=0)
    max_steps: int = -1
    """Stop after this many optimizer steps (-1: run all epochs)."""
    learning_rate: float = Field(3e-3, gt=0)
    batch_size: int = Field(8, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    warmup_steps: int = Field(10, ge=0)
    lr_scheduler: str = "cosine"
    weight_decay: float = 0.0
    logging_steps: int = Field(25, ge=1)
    save_steps: int = Field(100, ge=1)
    lora: LoraSettings | None = None


class RLSettings(Section):
    steps: int = Field(30, ge=1)
    tasks_per_step: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    """Rollouts per task; advantages compare rollouts of the same task."""
    estimator: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    credit: Literal["trajectory", "turn"] = "trajectory"
    """trajectory: one advantage for all tokens of a rollout; turn: per-turn rewards credited to that turn's tokens."""
    rewards: dict[str, float] = Field(default_factory=lambda: {"env": 1.0})
    """Weights of named reward components; weight 0 logs a component without training on it."""
    learning_rate: float = Field(1e-4, gt=0)
    temperature: float = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the starting policy (0: no reference model is kept)."""
    epochs_per_step: int = Field(1, ge=1)
    minibatch_size: int | None = Field(None, ge=1)
    """Rollouts per optimizer step (None: the whole step's batch, one optimizer step per epoch)."""
    micro_batch_size: int = Field(16, ge=1)
    """Rollouts per forward/backward pass; gradients accumulate up to ``minibatch_size`` (a memory knob only)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear learning-rate warm-up; Adam's first steps otherwise move every weight by ~lr."""
    max_grad_norm: float = Field(1.0, gt=0)
    save_steps: int = Field(10, ge=1)
    lora: LoraSettings | None = None

    @field_validator("rewards")
    @classmethod
    def _known_rewards(cls, weights: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(weights) - set(REWARDS))
        if unknown:
            raise ValueError(f"unknown reward component(s) {unknown}; known: {sorted(REWARDS)}")
        return weights


class EvalSettings(Section):
    tasks: int = Field(100, ge=1)
    """Held-out tasks per evaluation."""
    samples_per_task: int = Field(1, ge=1)
    ks: list[int] = Field(default_factory=lambda: [1])
    temperature: float = Field(0.0, ge=0)
    split: str = "test"
    seed: int = 0
    """Task order seed: fixed by default so runs with different training seeds are scored on the same tasks."""


class PipelineConfig(Section):
    """The whole pipeline: collect demonstrations -> dataset -> SFT -> eval -> RL -> eval."""

    run_dir: str = "runs/run"
    env: str | list[str]
    """A registered env name or import path; a list (or comma-separated names) mixes envs in one run."""
    seed: int = 0
    stages: list[Stage] = Field(default_factory=lambda: ["collect", "sft", "eval", "rl", "eval"])
    model: ModelSettings = Field(default_factory=ModelSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    collect: CollectSettings = Field(default_factory=CollectSettings)
    dataset: DatasetSettings = Field(default_factory=DatasetSettings)
    sft: SFTSettings = Field(default_factory=SFTSettings)
    rl: RLSettings = Field(default_factory=RLSettings)
    eval: EvalSettings = Field(default_factory=EvalSettings)


class ConfigError(ValueError):
    """A config file that does not validate; the message names each bad key."""


def load_config(path: str | Path, overrides: dict | None = None) -> PipelineConfig:
    """Read and validate a YAML config; ``overrides`` (nested dicts) replace values from the file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such config file") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a mapping of sections, got {type(data).__name__}")
    _merge(data, overrides or {})
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid config:\n" + "\n".join(_describe(e) for e in exc.errors())) from exc


def _merge(base: dict, overrides: dict) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _describe(error: dict) -> str:
    where = ".".join(str(part) for part in error["loc"])
    if error["type"] != "extra_forbidden":
        return f"  {where}: {error['msg']}"
    section: type[BaseModel] = PipelineConfig
    for part in error["loc"][:-1]:
        annotation = section.model_fields[str(part)].annotation
        section = next((a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)
                        and issubclass(a, BaseModel)), section)
    close = difflib.get_close_matches(str(error["loc"][-1]), list(section.model_fields), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"  {where}: unknown key{hint}; valid keys here: {', '.join(section.model_fields)}"
