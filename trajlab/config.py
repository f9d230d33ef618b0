"""The settings of every stage: one pydantic model per config section, unknown keys are errors.

Each setting (name, type, default, help text) is written here once. A YAML config, ``trajlab`` command-line options
(``--max-turns``, ``--set rollout.max_turns=4``) and the Python API (``trajlab.evaluate(..., num_tasks=50)``) are
three views of the same fields, all validated by these models, so ``trajlab eval`` and the ``eval`` stage of
``trajlab run`` measure the same thing by default. A misspelled section or key fails validation with its path and
the closest valid name, instead of silently falling back to a default.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from trajlab.env.limits import EpisodeLimits
from trajlab.env.mixture import EnvMixture, load_envs
from trajlab.env.prompts import check_prompt_sources, prompted
from trajlab.env.registry import EnvSpec
from trajlab.errors import UserError
from trajlab.rollout.rewards import check_weights
from trajlab.tracking import TrackerName

Stage = Literal["collect", "sft", "eval", "rl", "evolve"]


def _known_weights(weights: dict[str, float]) -> dict[str, float]:
    check_weights(weights)
    return weights


RewardWeights = Annotated[dict[str, float], AfterValidator(_known_weights)]
"""Weights of named reward components; an unknown name is an error listing the known ones."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def _device_name(name: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ValueError(f"{name!r} is not a device: use auto, cpu, cuda or cuda:N")
    return name


class ModelSettings(Section):
    path: str | None = None
    """A local Hugging Face causal-LM directory; None builds the tiny offline model."""
    init_seed: int = 0
    """Weight seed of the tiny model when ``path`` is None."""
    device: Annotated[str, AfterValidator(_device_name)] = "auto"
    """Where every model of the run is loaded: auto (the GPU when torch sees one, else the CPU), cpu, cuda or
    cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights' dtype: auto (float32 on the CPU; on a GPU the checkpoint's own, float32 for a bfloat16 checkpoint on a
    GPU without bfloat16), float32, bfloat16 or float16 (inference only: not trained)."""
    backend: Literal["hf", "vllm"] = "hf"
    """Generation backend for a model directory: hf (transformers) or vllm (an in-process vLLM engine; needs the
    vllm extra). In RL, vllm samples the rollouts and gets the trainer's weights after every optimizer step."""


def _overrides_of(limits: type[BaseModel]) -> dict[str, Any]:
    """The env's episode limits as optional settings: same names, types, bounds and help; None keeps the env's."""
    fields = {}
    for name, field in limits.model_fields.items():
        kind = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        fields[name] = (kind | None, Field(None, description=f"{field.description} Default: the env's own (see "
                                           "`trajlab envs`)."))
    return fields


class _Overrides(Section):
    def limit_overrides(self) -> dict[str, int | float]:
        """The limits the user set (the engine applies each env's own for the rest)."""
        return {name: value for name in EpisodeLimits.model_fields if (value := getattr(self, name)) is not None}


LimitSettings = create_model("LimitSettings", __base__=_Overrides, **_overrides_of(EpisodeLimits))
"""The episode limits a user may set; each left at None is the env's own (:attr:`EnvSpec.limits`)."""


class RolloutSettings(LimitSettings):
    concurrency: int = Field(32, ge=1)
    """Episodes run at once."""
    retries: int = Field(2, ge=0)
    """Times an episode that failed because of the machinery (status error: a generator or server error, an env
    that could not start, an InfrastructureError) is run again before it is kept as an error."""
    retry_backoff_s: float = Field(1.0, ge=0)
    """Wait before the first retry of an episode, doubling with each further one."""
    workers: int = Field(0, ge=0)
    """Ray actors that run the episodes, each with its own generator and envs (0: in this process). Needs the
    policy as a model directory, a server URL or oracle, and `pip install 'trajlab[ray]'`."""
    worker_gpus: float = Field(0.0, ge=0)
    """GPUs Ray gives each worker (e.g. 1 for a vllm or hf policy on its own GPU; 0.5 shares one between two). A
    cluster without that many free GPUs is an error, not a wait."""
    ray_address: str = "local"
    """With workers: local (start a Ray cluster in this process, its files under the run directory), auto (join the
    cluster `ray start` runs on this machine), or a cluster address."""
    parser: str = "auto"
    """Tool-call parser: auto, hermes, llama3, response_template."""
    system_prompt: str | None = None
    """Replaces the env's system prompt; "" means none."""
    prompt_file: str | None = None
    """Instead of ``system_prompt``: trajlab evolve's ``result/best_candidate.json`` (system prompt and evolved tool
    descriptions), or a text file holding the system prompt."""

    @model_validator(mode="after")
    def _one_prompt_source(self) -> RolloutSettings:
        check_prompt_sources(self.system_prompt, self.prompt_file)  # at load time, not when a stage starts
        return self

    def prompted(self, env: EnvSpec | EnvMixture) -> tuple[EnvSpec | EnvMixture, str | None]:
        """The env with the prompt file's tool descriptions, and the system prompt to use (None: the env's)."""
        return prompted(env, self.system_prompt, self.prompt_file)


class CollectSettings(Section):
    episodes: int = Field(1000, ge=1)
    """Episodes to collect (the run's collect stage: reference-policy demonstrations)."""
    split: str = "train"
    """Task split: train or test (validation where the env has one, e.g. bfcl)."""
    samples_per_task: int = Field(1, ge=1)
    """Episodes per task."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy)."""
    reference: str | None = None
    """Which reference policy demonstrates (policy oracle): one of the env's imperfect ones by name (trajlab envs
    lists them, e.g. driving's overconfident). None: the env's own."""
    reference_noise: float = Field(0.0, ge=0, le=1)
    """Imperfect demonstrations: the reference policy (policy oracle) makes a plausible wrong call, derived from the
    tool schemas, in this share of the situations it meets, the same one whenever it meets a situation again
    (seeded by seed). Each trajectory records it in metrics reference_noise and reference_noise/turns. 0: the
    reference as it is."""


class LoraSettings(Section):
    r: int = Field(16, ge=1)
    """LoRA rank."""
    alpha: int = Field(32, ge=1)
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA branch."""
    target_modules: list[str] | str = "all-linear"
    """Modules given adapters: names, or "all-linear"."""


class DatasetSettings(Section):
    include_failures: bool = False
    """Keep failed and truncated episodes too, with a `success` column."""
    shortest_per_task: bool = False
    """Keep only the shortest success of each task."""
    max_tokens: int | None = None
    """Drop trajectories longer than this many tokens (None: keep all)."""


class SFTSettings(Section):
    epochs: float = Field(2.0, gt=0)
    """Epochs over the data."""
    max_steps: int = -1
    """Stop after this many optimizer steps (-1: run all epochs)."""
    learning_rate: float = Field(3e-3, gt=0)
    """Peak learning rate."""
    batch_size: int = Field(8, ge=1)
    """Sequences per device step."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Device steps per optimizer step."""
    warmup_steps: int = Field(10, ge=0)
    """Optimizer steps of learning-rate warm-up."""
    lr_scheduler: str = "cosine"
    """A transformers scheduler name, e.g. cosine, constant_with_warmup."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    gradient_checkpointing: bool = False
    """Recompute layer activations in the backward pass instead of keeping them: less memory, one more forward."""
    logging_steps: int = Field(25, ge=1)
    """Optimizer steps between log lines."""
    max_drift: float = Field(0.0, ge=0, le=1)
    """Share of trajectories whose tokens may differ from their messages as the chat template renders them (they are
    dropped, never trained on); above it the run stops with the first difference. 0: any drift stops."""
    save_steps: int = Field(100, ge=1)
    """Optimizer steps between checkpoints."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter (merged into out/final) instead of all weights; None: full fine-tuning."""


class RLSettings(Section):
    steps: int = Field(30, ge=1)
    """RL steps (rollouts + update each)."""
    tasks_per_step: int = Field(8, ge=1)
    """Train tasks rolled out per step."""
    group_size: int = Field(8, ge=2)
    """Rollouts per task; advantages compare rollouts of the same task."""
    estimator: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Advantage estimator: grpo, dr_grpo (no std normalisation) or rloo (leave-one-out)."""
    credit: Literal["trajectory", "turn"] = "trajectory"
    """trajectory: one advantage for all tokens of a rollout; turn: per-turn rewards credited to that turn's tokens."""
    rewards: RewardWeights = Field(default_factory=lambda: {"env": 1.0})
    """Weights of named reward components; weight 0 logs a component without training on it."""
    learning_rate: float = Field(1e-4, gt=0)
    """Learning rate."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the rollouts."""
    clip_eps: float = Field(0.2, gt=0)
    """PPO-style ratio clipping range."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the starting policy (0: no reference model is kept)."""
    epochs_per_step: int = Field(1, ge=1)
    """Passes over each step's rollouts."""
    minibatch_size: int | None = Field(None, ge=1)
    """Rollouts per optimizer step (None: the whole step's batch, one optimizer step per epoch)."""
    micro_batch_size: int = Field(16, ge=1)
    """Rollouts per forward/backward pass; gradients accumulate up to ``minibatch_size`` (a memory knob only)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear learning-rate warm-up; Adam's first steps otherwise move every weight by ~lr."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """The rate after warm-up: held, or decayed to 0 over the run's optimizer steps (linear, cosine), so the final
    weights are not one noisy step of a full rate away from where training had got to."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient-norm clipping."""
    gradient_checkpointing: bool = False
    """Recompute layer activations in the backward pass instead of keeping them: less memory, one more forward."""
    importance_sampling: Literal["auto", "on", "off"] = "auto"
    """Correct for a sampler that is not the trainer's own forward pass (vllm): the clipped ratio is taken against
    the trainer's recomputed logprobs, and each token is weighted by min(p_trainer / p_sampler, importance_cap).
    auto: on whenever such a sampler rolls out or rollouts may be stale (max_staleness > 0), off for the hf backend
    sampling synchronously (from the trained model itself)."""
    importance_cap: float = Field(2.0, ge=1)
    """Upper bound of the truncated importance weight p_trainer / p_sampler."""
    max_staleness: int = Field(0, ge=0)
    """Asynchronous RL: rollouts of the next K steps run while the current step trains, from weights at most K steps
    old (each trajectory records its policy version; older ones are dropped); the update corrects for the lag with
    importance sampling (on under auto). 0: synchronous, every step sampled by the weights just trained."""
    max_drift: float = Field(0.0, ge=0, le=1)
    """Share of trajectories whose tokens may differ from their messages as the chat template renders them (they are
    dropped, never trained on); above it the run stops with the first difference. 0: any drift stops."""
    save_steps: int = Field(10, ge=1)
    """Steps between checkpoints."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter (merged into out/final) instead of all weights; None: full fine-tuning."""



class EvalSettings(Section):
    num_tasks: int = Field(100, ge=1)
    """Held-out tasks per evaluation (a tasks file: all of its tasks)."""
    samples_per_task: int = Field(1, ge=1)
    """Episodes per task; pass@k needs k <= this."""
    ks: list[Annotated[int, Field(ge=1)]] | None = None
    """pass@k budgets to report (None: 1 and samples_per_task)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature (0: greedy)."""
    split: str = "test"
    """Task split to evaluate on."""
    seed: int = 0
    """Task order seed: fixed by default so runs with different training seeds are scored on the same tasks."""

    @model_validator(mode="after")
    def _ks_within_samples(self) -> EvalSettings:
        if self.ks and max(self.ks) > self.samples_per_task:
            raise ValueError(f"pass@{max(self.ks)} needs samples_per_task >= {max(self.ks)}; got "
                             f"{self.samples_per_task}.")
        return self

    def pass_at(self) -> list[int]:
        """The pass@k budgets to report."""
        return sorted(set(self.ks or [1, self.samples_per_task]))


class PromoteRule(Section):
    """When a curriculum stage hands over to the next one: after a number of RL steps, or once a success rate reaches
    a threshold (``{steps: N}``, ``{metric: train_success, window: W, threshold: T}`` or ``{metric: heldout_success,
    every: K, tasks: N, threshold: T}``)."""

    steps: int | None = Field(None, ge=1)
    """Promote after this many RL steps in the stage."""
    metric: Literal["train_success", "heldout_success"] | None = None
    """train_success: the success rate of the stage's rollouts over its last ``window`` steps; heldout_success: the
    greedy success rate on the stage's first ``tasks`` held-out tasks (validation split, else test; seed 0; the
    stage's difficulty, filter and limits), measured every ``every`` steps of the stage."""
    threshold: float | None = Field(None, ge=0, le=1)
    """Promote once the metric reaches this (a success rate, 0 to 1)."""
    window: int = Field(5, ge=1)
    """train_success: steps of the stage averaged (promotion waits until the stage has run this many)."""
    every: int = Field(5, ge=1)
    """heldout_success: steps of the stage between two held-out evaluations."""
    tasks: int = Field(20, ge=1)
    """heldout_success: held-out tasks per evaluation."""

    @model_validator(mode="after")
    def _one_rule(self) -> PromoteRule:
        # a field at its default counts as not given: a dumped rule (trajlab config show) holds every field
        fields = PromoteRule.model_fields
        given = {name for name in self.model_fields_set if getattr(self, name) != fields[name].default}
        if (self.steps is None) == (self.metric is None):
            raise ValueError("a promote rule is either {steps: N} or {metric: train_success | heldout_success, "
                             "threshold: T, ...}")
        if self.metric is not None and self.threshold is None:
            raise ValueError(f"metric {self.metric} needs a threshold (a success rate, 0 to 1)")
        own = {None: {"steps"}, "train_success": {"metric", "threshold", "window"},
               "heldout_success": {"metric", "threshold", "every", "tasks"}}[self.metric]
        if stray := sorted(given - own):
            rule = "steps" if self.metric is None else self.metric
            raise ValueError(f"a {rule} rule takes {', '.join(sorted(own))}, not {', '.join(stray)}")
        return self


class StageSettings(LimitSettings):
    """One stage of a curriculum: which tasks RL draws, with what limits, until its promote rule says to move on. The
    limits (max_turns...) override ``rollout``'s in this stage."""

    name: str
    """The stage's name in logs and ``curriculum.jsonl``."""
    env: str | list[str] | dict[str, Annotated[float, Field(gt=0)]] | None = None
    """The env (a name), a mixture (names, or names with weights: ``{arithmetic: 3, guess: 1}`` draws 3 arithmetic
    tasks per guess task); None: the run's env."""
    difficulty: dict[str, int] = Field(default_factory=dict)
    """Difficulty knobs of the stage's env(s) (``trajlab envs`` lists them); a knob left out is at its default, not at
    the run's ``difficulty``."""
    task_filter: dict[str, Any] | None = None
    """Only train tasks whose fields have these values (a list: any of its items), e.g. ``{kind: encoding}``."""
    promote: PromoteRule | None = None
    """When to move to the next stage; the last stage has none and runs until ``rl.steps``."""

    def env_spec(self, run_env: EnvSpec | EnvMixture) -> EnvSpec | EnvMixture:
        """The stage's env or mixture (``run_env`` unless it names its own) at the stage's difficulty.

        Raises:
            ConfigError: an unknown env, weights for one env, or a bad knob (each named with the stage).
        """
        try:
            env = run_env if self.env is None else load_envs(list(self.env) if isinstance(self.env, dict) else self.env)
            if isinstance(self.env, dict):
                if not isinstance(env, EnvMixture):
                    raise ValueError("weights share the steps between several envs: name one env as env: NAME")
                env = replace(env, weights=dict(self.env))
            return env.with_options(**self.difficulty)
        except ValueError as exc:
            raise ConfigError(f"curriculum stage '{self.name}': {exc}") from exc


class CurriculumSettings(Section):
    """RL in ordered stages, e.g. easy tasks first: each step draws its tasks from the current stage, and a stage's
    promote rule moves training on to the next one."""

    stages: list[StageSettings] = Field(min_length=1)
    """The stages, in order; every stage but the last has a promote rule."""

    @model_validator(mode="after")
    def _promotions(self) -> CurriculumSettings:
        names = [stage.name for stage in self.stages]
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"stage names must be unique; repeated: {', '.join(repeated)}")
        if missing := [stage.name for stage in self.stages[:-1] if stage.promote is None]:
            raise ValueError(f"every stage but the last needs a promote rule (only the last runs until rl.steps); "
                             f"none in: {', '.join(missing)}")
        if self.stages[-1].promote is not None:
            raise ValueError(f"the last stage ({self.stages[-1].name}) runs until rl.steps: it has no promote rule")
        return self


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
    """Tasks per reflection minibatch."""
    tools: list[str] | Literal["all"] = Field(default_factory=list)
    """Tool descriptions to evolve along with the system prompt: names, or "all"."""
    use_merge: bool = False
    """Also propose candidates by merging two Pareto-front candidates (GEPA's merge proposer)."""
    rewards: RewardWeights | None = None
    """Weights of named reward components scoring each episode (None: the env reward)."""
    temperature: float = Field(0.0, ge=0)
    """The policy's sampling temperature; at 0 a candidate's score on a task is reproducible."""
    reflection_max_new_tokens: int = Field(1024, ge=1)
    """Tokens the reflection LM may write per proposal."""
    reflection_temperature: float = Field(0.7, ge=0)
    """Sampling temperature of the reflection LM."""


class ServeSettings(Section):
    """``trajlab serve``: the recording server. What it serves is the ``model`` section (``path``, ``device``,
    ``dtype``, ``backend``), its tool-call parser ``rollout.parser``; with ``upstream`` set neither is read."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 exposes the server to the network."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port to listen on."""
    record_dir: str = "runs/serve/sessions"
    """One JSONL file of call records per session."""
    served_model_name: str | None = None
    """Name clients pass as `model` (None: the model directory's name)."""
    upstream: str | None = None
    """Instead of serving model.path: forward to this OpenAI-compatible server (e.g. http://127.0.0.1:8001/v1) and
    record in between. The model section, rollout.parser, served_model_name, max_batch_size, prefix_cache_mb,
    default_max_tokens and max_context are then not used: the upstream has its own."""
    max_batch_size: int = Field(32, ge=1)
    """Most generations batched together."""
    max_body_bytes: int = Field(4 << 20, ge=1)
    """Larger request bodies get 413 before they are parsed."""
    body_timeout_s: float = Field(30.0, gt=0)
    """Seconds a request body may take to arrive whole; then 408 (a client that sends less than its Content-Length
    would otherwise hold its connection forever)."""
    prefix_cache_mb: int = Field(1024, ge=0)
    """Memory (MiB) for key/value states kept between a session's calls (hf backend; least recently used dropped
    first): with the model's weights, what bounds the server's memory."""
    default_max_tokens: int = Field(1024, ge=1)
    """Completion tokens when a chat request sets no max_tokens (never more than the context has left)."""
    max_context: int | None = Field(None, ge=1)
    """Prompt plus completion tokens a request may use; longer prompts get 400 context_length_exceeded (None: the
    served model's own context; more than that is an error)."""



class PipelineConfig(Section):
    """The whole pipeline: collect demonstrations -> dataset -> SFT -> eval -> RL -> eval, and optionally evolve."""

    run_dir: str = "runs/run"
    """Where every stage writes its results; re-running resumes from them."""
    env: str | list[str] | None = None
    """A registered env name or import path; a list (or comma-separated names) mixes envs in one run. Every stage
    but sft needs one."""
    difficulty: dict[str, int] = Field(default_factory=dict)
    """Difficulty knobs of the env (``trajlab envs`` lists each env's), e.g. ``{max_operand: 20}``; in a mixture each
    knob goes to the envs that have it. Every stage uses them except RL under a curriculum (its stages set theirs)."""
    seed: int = 0
    """Training seed (and task order of the collect and RL stages)."""
    report_to: list[TrackerName] = Field(default_factory=list)
    """Experiment trackers that also get every stage's metrics (sft, rl, eval, evolve): any of tensorboard, wandb,
    trackio, mlflow, each in its offline or local mode unless its own settings say otherwise (README, "Metrics")."""
    stages: list[Stage] = Field(default_factory=lambda: ["collect", "sft", "eval", "rl", "eval"])
    """Stages run in order: collect, sft, eval, rl, evolve (eval may repeat)."""
    model: ModelSettings = Field(default_factory=ModelSettings)
    """The starting model."""
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    """How episodes are rolled out in every stage."""
    collect: CollectSettings = Field(default_factory=CollectSettings)
    """The collect stage (and `trajlab collect`)."""
    dataset: DatasetSettings = Field(default_factory=DatasetSettings)
    """Turning demonstrations into the SFT dataset."""
    sft: SFTSettings = Field(default_factory=SFTSettings)
    """Supervised fine-tuning."""
    rl: RLSettings = Field(default_factory=RLSettings)
    """Online multi-turn RL."""
    eval: EvalSettings = Field(default_factory=EvalSettings)
    """Every eval stage (and `trajlab eval`)."""
    evolve: EvolveSettings = Field(default_factory=EvolveSettings)
    """Prompt evolution with GEPA."""
    serve: ServeSettings = Field(default_factory=ServeSettings)
    """`trajlab serve`: the recording server."""
    curriculum: CurriculumSettings | None = None
    """RL in stages (tasks, difficulty, limits and env mixture of each, and when to move on); None: RL on the run's
    env throughout."""

    def env_spec(self) -> EnvSpec | EnvMixture:
        """The configured env (or mixture), loaded, at the configured difficulty.

        Raises:
            ConfigError: no env is configured.
        """
        if self.env is None:
            raise ConfigError("no env: give --env, or a --config naming one (or --set env=NAME).")
        env = load_envs(self.env)
        return env.with_options(**self.difficulty) if self.difficulty else env


class ConfigError(UserError):
    """A config file that does not validate; the message names each bad key."""


def load_config(path: str | Path | None, overrides: dict | None = None) -> PipelineConfig:
    """Read and validate a YAML config; ``overrides`` (nested dicts, e.g. from ``--set``) replace values from the file
    (or, with no file, are the whole config). Every ``--config`` of every command goes through here.

    Raises:
        ConfigError: the file is missing or not YAML, or a section or key is unknown or invalid (each named, with
            the closest valid name).
    """
    data, source = {}, "the command's options"
    if path is not None:
        path = source = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise ConfigError(f"{path}: no such config file") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a config is a mapping of sections, got {type(data).__name__}")
    _merge(data, overrides or {})
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid config: {describe_errors(exc)}") from exc


def _merge(base: dict, overrides: dict) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's problem and its line and column, in one line (its own message spans several, with a caret)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def describe_errors(error: ValidationError, root: type[BaseModel] = PipelineConfig) -> str:
    """Every problem in one line, "; "-separated: where it is, what is wrong; an unknown key names the closest valid
    one."""
    return "; ".join(_describe(item, root) for item in error.errors())


def _describe(error: Any, root: type[BaseModel]) -> str:
    where = ".".join(str(part) for part in error["loc"])
    if error["type"] != "extra_forbidden":
        message = error["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
        return f"{where}: {message}"
    section: type[BaseModel] = root
    for part in error["loc"][:-1]:
        if isinstance(part, int):  # a list's item: its model is the list's, found at the list's name
            continue
        annotation = section.model_fields[str(part)].annotation
        section = next((a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)
                        and issubclass(a, BaseModel)), section)
    close = difflib.get_close_matches(str(error["loc"][-1]), list(section.model_fields), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{where}: unknown key{hint} (valid keys here: {', '.join(section.model_fields)})"
