"""The settings sections of every stage and command: one pydantic model each, unknown keys are errors."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, model_validator

from trajlab.chat.context import check_template_kwargs
from trajlab.env.limits import EpisodeLimits
from trajlab.env.mixture import EnvMixture
from trajlab.env.prompts import check_prompt_sources, prompted
from trajlab.env.registry import EnvSpec
from trajlab.errors import UserError
from trajlab.inference.base import DEFAULT_BATCHING, DEFAULT_SERVER_TIMEOUT_S, Batching
from trajlab.models.devices import AUTO
from trajlab.rewards import RewardConfig


class ConfigError(UserError):
    """A config file that does not validate; the message names each bad key."""


RewardWeights = RewardConfig
"""Named rewards: a weight for a built-in component, or a reward function by import path (``{function: ...,
weight: ..., args: ..., level: ...}``, :class:`trajlab.rewards.RewardFunction`); unknown names are errors."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def _device_name(name: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ValueError(f"{name!r} is not a device: use auto, cpu, cuda or cuda:N")
    return name


class VLLMSettings(Section):
    """Engine arguments of the vllm backend (``vllm.LLM``), read only with ``backend: vllm``."""

    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Share of the GPU's memory the engine takes for weights, activations and its KV cache (None: vLLM's own, 0.9).
    In RL the trainer's weights, gradients and optimizer state are on the same GPU when the engine starts: leave
    them room (e.g. 0.3-0.5)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt plus completion the engine serves (None: the model's context); a shorter one needs less KV
    cache memory. Keep it at least rollout.max_episode_tokens."""
    enforce_eager: bool = True
    """Run the model eagerly (True) or capture CUDA graphs (False: faster decoding, a slower start and more memory).
    Eager is what trajlab has tested weight reloads after every RL update with."""
    batching: Batching = DEFAULT_BATCHING
    """How episodes' turns reach the engine: continuous (each request joins and leaves the running batch on its own,
    so a finished turn's episode goes on while others still generate) or lockstep (batches handed to
    ``LLM.generate``, each waiting for its slowest request). Not an engine argument: trajlab's own."""
    server: str | None = None
    """A running ``vllm serve`` (``http://host:port/v1``, optionally ``#model``) that RL rolls out on instead of an
    in-process engine. After each update it gets the trained LoRA adapter (it runs with ``--enable-lora
    --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and reads the RL output's ``adapters`` folder),
    or without LoRA every weight, broadcast in buckets (it runs with ``--weight-transfer-config
    '{"backend": "trajlab_gloo"}'`` and ``VLLM_SERVER_DEV_MODE=1``, trajlab installed beside vLLM). Either way with
    ``--logprobs-mode processed_logprobs``. Not an engine argument."""


class ModelSettings(Section):
    path: str | None = None
    """A Hugging Face causal-LM directory, or a model name (Qwen/Qwen3-1.7B): its snapshot in the Hugging Face cache,
    downloaded first when it is not there and the network allows. None builds the tiny offline model (the tiny
    vision-language one when the env's tools return images)."""
    init_seed: int = 0
    """Weight seed of the tiny model when ``path`` is None."""
    device: Annotated[str, AfterValidator(_device_name)] = AUTO
    """Where every model of the run is loaded: auto (the GPU when torch sees one, else the CPU), cpu, cuda or
    cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = AUTO
    """Weights' dtype: auto (float32 on the CPU; on a GPU the checkpoint's own, float32 for a bfloat16 checkpoint on a
    GPU without bfloat16), float32, bfloat16 or float16 (inference only: not trained). bfloat16 on a CPU without
    bfloat16 instructions is emulated, often 10x slower than float32 (warned once)."""
    backend: Literal["hf", "vllm"] = "hf"
    """Generation backend for a model directory: hf (transformers) or vllm (an in-process vLLM engine; needs the
    vllm extra). In RL, vllm samples the rollouts and gets the trainer's weights after every optimizer step."""
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(check_template_kwargs)] = Field(
        default_factory=dict)
    """Variables the chat template renders with, as with ``apply_chat_template(**kwargs)``: e.g.
    ``{enable_thinking: false}`` (Qwen3) or ``{reasoning_effort: low}`` (gpt-oss). Recorded with every trajectory,
    with the date a template that writes today's date renders (pinned per run), so the drift guard re-renders them
    the same way later."""
    vllm: VLLMSettings = Field(default_factory=VLLMSettings)
    """The vllm backend's engine arguments (memory share, context length, eager or CUDA graphs)."""

    def engine_args(self) -> dict[str, Any]:
        """The keyword arguments this section gives ``vllm.LLM``: the vllm settings that are set, and the dtype
        unless it is auto (the engine then loads the checkpoint's own)."""
        args = self.vllm.model_dump(exclude_none=True, exclude={"batching", "server"})
        return args if self.dtype == AUTO else args | {"dtype": self.dtype}


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
    server_timeout_s: float = Field(DEFAULT_SERVER_TIMEOUT_S, gt=0)
    """The most one model turn may take on an OpenAI-compatible server (a policy http://host:port/v1,
    model.vllm.server), queueing and retries included; a server silent that long fails the episode (status error,
    naming the server, run again as retries says)."""
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
    """Tool-call parser: auto (by the chat template's format), hermes, llama3, mistral, qwen3_xml, harmony,
    response_template."""
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


class TrainingSettings(Section):
    """What SFT and RL share: the drift guard, activation checkpointing and LoRA."""

    gradient_checkpointing: bool = False
    """Recompute layer activations in the backward pass instead of keeping them: less memory, one more forward."""
    max_drift: float = Field(0.0, ge=0, le=1)
    """Share of trajectories whose tokens may differ from their messages as the chat template renders them (they are
    dropped, never trained on); above it the run stops with the first difference. 0: any drift stops."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter (merged into out/final) instead of all weights; None: full fine-tuning."""
    sharding: Literal["none", "fsdp"] = "none"
    """How the trainer processes (accelerate launch) hold the model. none: each holds all of its weights, gradients
    and AdamW moments (data parallel). fsdp: each holds a slice of them (FSDP2), a decoder layer gathered whole only
    for its forward and backward pass; a bfloat16 model then computes in bfloat16 over float32 sharded weights
    (master_weights). In RL, samplers get the weights gathered a layer at a time; the hf backend samples from a whole
    copy of the policy in each process."""
    padding_free: bool = False
    """Train on micro-batches packed into one row, each sequence attending to itself alone (position ids restart
    with each; varlen attention on a GPU with flash attention), instead of right-padded rows: no compute spent on
    padding. Rollouts with images train padded."""
    master_weights: bool = True
    """A model trained in bfloat16 (model.dtype, or auto for a bfloat16 checkpoint on a GPU) keeps a float32 copy
    of its weights and float32 AdamW moments, and its bfloat16 weights are rounded from the copy after every step:
    stepped in place, bfloat16 weights drop every update under half their precision step, which at 1e-6 is nearly
    all of them. False: AdamW on the bfloat16 weights (6 bytes per parameter less). A float32 model is unaffected."""


class SFTSettings(TrainingSettings):
    epochs: float = Field(2.0, gt=0)
    """Epochs over the data."""
    max_steps: int = -1
    """Stop after this many optimizer steps (-1: run all epochs)."""
    learning_rate: float | None = Field(None, gt=0)
    """Peak learning rate (None: by the model's size, :mod:`trajlab.train.rates`: 3e-3 for the tiny models, 1e-5
    for a real one, 1e-4 with LoRA)."""
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
    logging_steps: int = Field(25, ge=1)
    """Optimizer steps between log lines."""
    save_steps: int = Field(100, ge=1)
    """Optimizer steps between checkpoints."""


REPLAY_PER_STEP = 64
"""Logged demonstrations replayed a step by default, where a file of them is given (BENCHMARKS.md, issue 45)."""


class RLSettings(TrainingSettings):
    """The defaults are one recipe for every env (BENCHMARKS.md, "RL from generic imperfect demonstrations", recipe
    Z): it repairs much of what SFT on noisy demonstrations leaves and moves a model SFT already made right little.
    Its rate, unset, is chosen by the model's size (:mod:`trajlab.train.rates`): Z's 2e-3 on the tiny models, 1e-6 on
    a real one."""

    steps: int = Field(100, ge=1)
    """RL steps (rollouts + update each)."""
    tasks_per_step: int = Field(8, ge=1)
    """Train tasks rolled out per step."""
    group_size: int = Field(8, ge=2)
    """Rollouts per task; advantages compare rollouts of the same task."""
    estimator: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Advantage estimator: grpo, dr_grpo (no std normalisation) or rloo (leave-one-out)."""
    credit: Literal["trajectory", "turn"] = "turn"
    """trajectory: one advantage for all tokens of a rollout; turn: per-turn rewards credited to that turn's tokens."""
    rewards: RewardWeights = Field(default_factory=lambda: {"env": 1.0, "progress": 1.0})
    """Named rewards, each logged as ``reward/<name>``: a weight for a built-in component (env, progress, format,
    tool_success), or a function by import path ``{function: "my_pkg.rewards:brevity", weight: 0.2, args: {...},
    level: trajectory|turn}`` (an LLM judge: ``trajlab.rewards.judge:LLMJudge``). Weight 0 logs without training
    on it; a function that fails marks its trajectory error (not trained on)."""
    learning_rate: float | None = Field(None, gt=0)
    """Learning rate, the base one under ``rate_by_failures``, which scales each step's down (None: by the model's
    size, :mod:`trajlab.train.rates`: 2e-3 for the tiny models, 1e-6 for a real one, 1e-5 with LoRA)."""
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
    micro_batch_tokens: int | None = Field(None, ge=1)
    """At most this many padded tokens (rollouts x the longest one's length) per forward/backward pass, on top of
    ``micro_batch_size`` (None: rollouts alone decide). Activation memory follows tokens: long multi-turn rollouts
    need this to keep the update's peak bounded (a memory knob only; a longer rollout runs alone)."""
    warmup_steps: int = Field(2, ge=0)
    """Optimizer steps of linear learning-rate warm-up; Adam's first steps otherwise move every weight by ~lr."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "cosine"
    """The rate after warm-up: held, or decayed to 0 over the run's optimizer steps (linear, cosine), so the final
    weights are not one noisy step of a full rate away from where training had got to."""
    rate_by_failures: bool = True
    """Each step's rate multiplied by the share of its trained rollouts that did not succeed: large steps while the
    policy still fails the train tasks it draws, small ones once it mostly succeeds, so a model SFT already made
    right is moved little and one SFT left wrong a lot (BENCHMARKS.md, issue 45). A step at rate 0 (every rollout
    succeeded) skips its update's passes, which would move nothing."""
    greedy_rollout: bool | None = None
    """One rollout of each group decodes greedily, the others sample at ``temperature``: the group then compares the
    policy's mode, which held-out evaluation measures, with its samples, so a greedy answer that fails where samples
    succeed is pushed down and they are pulled up (ReMax's greedy baseline, trained on as a member of the group).
    Its success on the train tasks is logged as ``rollout/greedy_success_rate``; needs ``temperature`` 1, at which
    the greedy turns' recorded logprobs are the policy's. None: on at ``temperature`` 1, off at any other."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient-norm clipping."""
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
    replay_demonstrations: int | None = Field(None, ge=0)
    """Logged demonstrations trained beside each step's rollouts (``trajlab.train.replay``), each weighted by its
    reward against the whole log's rewards (one group of all of them, ``estimator`` and ``credit`` as for rollouts): a
    failed one is pushed down, a successful one pulled up. 0: none. They come from ``demonstrations``. None:
    ``REPLAY_PER_STEP`` where ``demonstrations`` is given (under ``trajlab run``, its ``demos.jsonl``), none
    elsewhere."""
    replay_below_baseline: bool = False
    """Replayed demonstrations whose advantage is negative (failed turns) are pushed down (True), or left out, so only
    the log's better-than-average turns are trained on (False: self-imitation learning)."""
    replay_weighting: Literal["advantage", "sign"] = "advantage"
    """A replayed turn's weight: its advantage against the log, or the advantage's sign alone (+1 or -1, so a log
    that mostly succeeds, whose successes sit barely above its average, pulls its better turns as hard as a
    rollout's advantage does: rejection-sampling fine-tuning beside the rollouts, as ReST and RAFT weigh them)."""
    demonstrations: str | None = None
    """The trajectory file ``replay_demonstrations`` draws from, its episodes' token ids kept (``trajlab collect``
    writes such files). None: under ``trajlab run``, the run's ``demos.jsonl``; elsewhere required for replay."""
    save_steps: int = Field(10, ge=1)
    """Steps between checkpoints."""

    @model_validator(mode="after")
    def _greedy_at_temperature_one(self) -> RLSettings:
        if self.greedy_rollout and self.temperature != 1.0:
            raise ValueError(f"rl.greedy_rollout needs rl.temperature 1 (got {self.temperature:g}): the greedy turns "
                             "record the policy's logprobs at temperature 1, which the clipped ratio compares with; "
                             "set rl.temperature: 1.0 or rl.greedy_rollout: false.")
        return self

    def resolved(self) -> RLSettings:
        """These settings with the defaults that depend on others made concrete: ``greedy_rollout`` by the
        temperature, ``replay_demonstrations`` by whether there are demonstrations to replay."""
        replay = self.replay_demonstrations
        if replay is None:
            replay = REPLAY_PER_STEP if self.demonstrations is not None else 0
        greedy = self.temperature == 1.0 if self.greedy_rollout is None else self.greedy_rollout
        return self.model_copy(update={"replay_demonstrations": replay, "greedy_rollout": greedy})


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
    rewards: RewardWeights | None = None
    """Named rewards each episode is scored by, logged as ``reward/<name>``, as ``rl.rewards`` (None: in a run's
    eval stages ``rl.rewards``, in ``trajlab eval`` the env reward alone)."""

    @model_validator(mode="after")
    def _ks_within_samples(self) -> EvalSettings:
        if self.ks and max(self.ks) > self.samples_per_task:
            raise ValueError(f"pass@{max(self.ks)} needs samples_per_task >= {max(self.ks)}; got "
                             f"{self.samples_per_task}.")
        return self

    def pass_at(self) -> list[int]:
        """The pass@k budgets to report."""
        return sorted(set(self.ks or [1, self.samples_per_task]))


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
    """Named rewards scoring each episode, as ``rl.rewards`` (None: the env reward)."""
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
    prefix_cache_mb: int | None = Field(None, ge=0)
    """Memory (MiB) for key/value states kept between a session's calls (hf backend; least recently used dropped
    first): with the model's weights, what bounds the server's memory. None: a quarter of the weights' bytes, at least
    64 MiB, so the server's memory stays in proportion to the model's (a fixed 1 GiB is twice the tiny model's whole
    server)."""
    default_max_tokens: int = Field(1024, ge=1)
    """Completion tokens when a chat request sets no max_tokens (never more than the context has left)."""
    max_choices: int = Field(256, ge=1)
    """Most choices one request may ask for: n times its prompts (a completions request may list thousands, each
    one generation and one record); more get 400."""
    max_context: int | None = Field(None, ge=1)
    """Prompt plus completion tokens a request may use; longer prompts get 400 context_length_exceeded (None: the
    served model's own context; more than that is an error)."""
