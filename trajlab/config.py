"""The YAML config of ``trajlab run``: one pydantic model per section, unknown keys are errors.

Defaults live here and nowhere else. A misspelled key fails validation with the key's path and the closest valid
name, instead of silently falling back to a default.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec
from trajlab.evolve.candidate import check_prompt_sources, prompted
from trajlab.rollout.rewards import check_weights

Stage = Literal["collect", "sft", "eval", "rl", "evolve"]


def _known_weights(weights: dict[str, float]) -> dict[str, float]:
    check_weights(weights)
    return weights


RewardWeights = Annotated[dict[str, float], AfterValidator(_known_weights)]
"""Weights of named reward components; an unknown name is an error listing the known ones."""


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
    prompt_file: str | None = None
    """Instead of ``system_prompt``: trajlab evolve's ``result/best_candidate.json`` (system prompt and evolved tool
    descriptions), or a text file holding the system prompt."""

    @model_validator(mode="after")
    def _one_prompt_source(self) -> RolloutSettings:
        check_prompt_sources(self.system_prompt, self.prompt_file)  # at load time, not when a stage starts
        return self

    def limits(self) -> dict[str, int | float | None]:
        """These settings as overrides of the env's episode limits (``RolloutEngine``'s ``limits``)."""
        return {"max_turns": self.max_turns, "max_episode_tokens": self.max_episode_tokens,
                "max_new_tokens": self.max_new_tokens, "tool_timeout_s": self.tool_timeout_s}

    def prompted(self, env: EnvSpec | EnvMixture) -> tuple[EnvSpec | EnvMixture, str | None]:
        """The env with the prompt file's tool descriptions, and the system prompt to use (None: the env's)."""
        return prompted(env, self.system_prompt, self.prompt_file)


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
    rewards: RewardWeights = Field(default_factory=lambda: {"env": 1.0})
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



class EvalSettings(Section):
    tasks: int = Field(100, ge=1)
    """Held-out tasks per evaluation."""
    samples_per_task: int = Field(1, ge=1)
    ks: list[int] = Field(default_factory=lambda: [1])
    temperature: float = Field(0.0, ge=0)
    split: str = "test"
    seed: int = 0
    """Task order seed: fixed by default so runs with different training seeds are scored on the same tasks."""


class EvolveSettings(Section):
    """Prompt evolution with GEPA; the policy is the stage's current model (or ``trajlab evolve --policy``)."""

    reflection: str | None = None
    """The reflection LM: a model directory or http://host:port/v1[#model]; None: the policy's own model."""
    max_metric_calls: int = Field(200, ge=1)
    """Rollout budget: every episode GEPA asks for counts once (a run may end one iteration past it)."""
    train_tasks: int = Field(32, ge=1)
    """Train-split tasks GEPA draws its reflection minibatches from."""
    val_tasks: int = Field(16, ge=1)
    """The next train-split tasks: every accepted candidate is scored on all of them (Pareto selection)."""
    minibatch_size: int = Field(3, ge=1)
    tools: list[str] | Literal["all"] = Field(default_factory=list)
    """Tool descriptions to evolve along with the system prompt: names, or "all"."""
    use_merge: bool = False
    """Also propose candidates by merging two Pareto-front candidates (GEPA's merge proposer)."""
    rewards: RewardWeights | None = None
    """Weights of named reward components scoring each episode (None: the env reward)."""
    temperature: float = Field(0.0, ge=0)
    """The policy's sampling temperature; at 0 a candidate's score on a task is reproducible."""
    reflection_max_new_tokens: int = Field(1024, ge=1)
    reflection_temperature: float = Field(0.7, ge=0)



class PipelineConfig(Section):
    """The whole pipeline: collect demonstrations -> dataset -> SFT -> eval -> RL -> eval, and optionally evolve."""

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
    evolve: EvolveSettings = Field(default_factory=EvolveSettings)


class ConfigError(ValueError):
    """A config file that does not validate; the message names each bad key."""


def load_config(path: str | Path | None, overrides: dict | None = None) -> PipelineConfig:
    """Read and validate a YAML config; ``overrides`` (nested dicts) replace values from the file (or, with no
    file, are the whole config)."""
    data, source = {}, "the given settings"
    if path is not None:
        path = source = Path(path)
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
        raise ConfigError(f"{source}: invalid config:\n" + "\n".join(_describe(e) for e in exc.errors())) from exc


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
