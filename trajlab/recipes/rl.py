"""The RL recipe, :func:`trajlab.rl`: build the policy, LoRA, reference, optimizer, scheduler, accelerator and
sampler from the settings, then hand them to the training loop (:func:`trajlab.train.rl.train_rl`).

What samples the rollouts: the ``hf`` backend samples from the very model being trained (through a copy of it when
rollouts run ahead of the update, ``max_staleness`` > 0); the ``vllm`` backend from an in-process engine started
from the model directory; ``rollout.workers`` from Ray actors that each start their policy from it. The last two
get the trainer's weights after every optimizer step.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import PreTrainedModel

from trajlab.chat.parsers import get_parser
from trajlab.chat.template import resolve_chat
from trajlab.collection.engines import resolve_prompts, rollout_engine
from trajlab.config import CurriculumSettings, ModelSettings, RLSettings, RolloutSettings, VLLMSettings
from trajlab.config.sections import REPLAY_PER_STEP
from trajlab.data.store import read_trajectories
from trajlab.env.mixture import EnvMixture
from trajlab.errors import UserError, require
from trajlab.inference.base import Generator
from trajlab.inference.hf import HFGenerator
from trajlab.inference.policy import Policy
from trajlab.recipes.arguments import EnvLike, as_env, model_settings, run_seed, settings_of
from trajlab.recipes.loading import frozen_copy, processor_of, tokenizer_of, trainable_model
from trajlab.rollout.drift import without_drift
from trajlab.rollout.runner import EpisodeRunner
from trajlab.tracking import require_trackers
from trajlab.train.curriculum import Curriculum, build_stages
from trajlab.train.lora import lora_config
from trajlab.train.optim import adamw
from trajlab.train.placement import training_device
from trajlab.train.publish import GatherOnly, WholeCopy
from trajlab.train.rates import with_learning_rate
from trajlab.train.replay import MIN_REPLAYABLE, replayable
from trajlab.train.rl import RLComponents, train_rl
from trajlab.train.schedule import rl_scheduler
from trajlab.train.sharding import shard
from trajlab.train.update import PolicyUpdate

if TYPE_CHECKING:
    from trajlab.collection.workers import RayRolloutRunner

logger = logging.getLogger(__name__)


def rl(
    model: str | Path | PreTrainedModel,
    env: EnvLike,
    out: str | Path,
    *,
    tokenizer: Any = None,
    processor: Any = None,
    rollout: RolloutSettings | Mapping[str, Any] | None = None,
    seed: int | None = None,
    resume: bool = False,
    backend: str | None = None,
    vllm: VLLMSettings | dict | None = None,
    sampler: Generator | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    report_to: Sequence[str] = (),
    curriculum: CurriculumSettings | Mapping[str, Any] | None = None,
    skip_tasks: Collection[str] = (),
    **settings: Any,
) -> Path:
    """Online multi-turn RL of ``model`` on ``env``'s train tasks; returns ``out/final`` (LoRA merged).

    Args:
        model: a model directory or a loaded transformers model (then ``tokenizer`` is required).
        processor: a loaded vision-language model's processor; a model directory's own is loaded (none for a text
            model). Needed for an env that shows the model images.
        backend: ``"hf"`` rolls out with the model being trained; ``"vllm"`` with an in-process vLLM engine started
            from the model directory, which gets the trainer's weights after every optimizer step.
        sampler: a generator that rolls out instead (None: as ``backend`` says); one that takes weights gets the
            trainer's after every optimizer step, and any other is corrected for as another engine.
        on_step: called with each step's metrics (also appended to ``out/metrics.jsonl``).
        report_to: experiment trackers that also get each step's metrics (:mod:`trajlab.tracking`).
        device, dtype: where the policy, its reference and its rollouts run, and the dtype a model directory is
            loaded in (``ModelSettings``; None: its default).
        vllm: the vllm backend's engine arguments (``VLLMSettings``).
        curriculum: train stage after stage instead (``CurriculumSettings``: ``{"stages": [...]}``); a stage
            without an env of its own uses ``env``.
        skip_tasks: ``(env, task_id)`` keys of train tasks RL does not draw: those SFT's demonstrations came from,
            which SFT fits and RL rarely fails (no gradient); ``trajlab.data.store.task_keys`` reads them from a file.
        **settings: ``RLSettings`` fields (``steps``, ``estimator``, ``credit``, ``group_size``, ``rewards``...).
        Other arguments: as for :func:`trajlab.collect`.
    """
    require_trackers(report_to)  # before any model is loaded
    given, placed = settings_of(RLSettings, settings), model_settings(device, dtype, backend, vllm)
    rollout, seed = settings_of(RolloutSettings, rollout), run_seed(seed)
    tokenizer, processor = tokenizer_of(model, tokenizer), processor_of(model, processor)
    chosen = given.resolved()
    demonstrations = _demonstrations(chosen, rollout, tokenizer, processor)
    if given.replay_demonstrations is None:
        chosen = _default_replay(chosen, demonstrations)
    run_env = as_env(env)
    stages = (build_stages(settings_of(CurriculumSettings, curriculum), run_env, rollout) if curriculum is not None
              else None)
    trained_on = (Curriculum(stages, seed=seed, skip=skip_tasks) if stages is not None
                  else Curriculum.single(run_env, rollout.limit_overrides(), seed=seed, skip=skip_tasks))
    where = training_device(placed.device)
    # The scheduler counts optimizer steps: accelerate would otherwise step a prepared one once per process.
    accelerator = Accelerator(cpu=where.type == "cpu", step_scheduler_with_optimizer=False)
    set_seed(seed)
    parts = _components(model, chosen, rollout, placed, trained_on, accelerator, where, tokenizer, processor,
                        sampler=sampler, seed=seed, out=Path(out), demonstrations=demonstrations)
    chosen = parts.update.settings  # the learning rate made concrete for the model
    run_config = {"rl": chosen.model_dump(mode="json"), "rollout": rollout.model_dump(mode="json"), "seed": seed,
                  "backend": placed.backend}
    return train_rl(parts, chosen, rollout, Path(out), seed=seed, resume=resume, on_step=on_step,
                    report_to=report_to, run_config=run_config)


def _components(model: str | Path | PreTrainedModel, settings: RLSettings, rollout: RolloutSettings,
                placed: ModelSettings, curriculum: Curriculum, accelerator: Accelerator, where: torch.device,
                tokenizer: Any, processor: Any, *, sampler: Generator | None, seed: int, out: Path,
                demonstrations: list[Any]) -> RLComponents:
    """The policy (LoRA, reference, optimizer, scheduler, prepared by accelerate), what samples it, and the runners
    of every curriculum stage."""
    sharded = settings.sharding == "fsdp"
    in_process = sampler is None and not rollout.workers and placed.backend != "vllm"
    _check_sharding(settings, placed, in_process, accelerator.num_processes)
    # the hf backend under sharding samples from a whole copy, made before a loaded model is sharded in place
    whole = frozen_copy(model, device=where, dtype=placed.dtype) if sharded and in_process else None
    update = _policy_update(model, settings, placed.dtype, where, accelerator, curriculum, tokenizer, processor)
    policy = accelerator.unwrap_model(update.policy)
    if sampler is None and placed.backend == "vllm" and not rollout.workers:  # workers start engines of their own
        adapter = settings.lora.r if settings.lora and not sharded else None  # sharded: merged weights, gathered
        sampler = _vllm_sampler(model, placed, rollout, seed, adapter, tokenizer, out)
    # With max_staleness > 0 rollouts run while the policy trains, so the hf backend samples from a copy of it (the
    # behaviour policy), which takes the trained weights between two steps' rollouts.
    behaviour = copy.deepcopy(policy).eval() if settings.max_staleness and in_process else None
    generator = sampler or HFGenerator(behaviour or whole or policy, tokenizer, max_batch_size=rollout.concurrency,
                                       processor=processor)
    template, context = resolve_chat(tokenizer, placed.chat_template_kwargs)

    def engine(stage: int, by: Generator, temperature: float) -> EpisodeRunner:
        chosen = curriculum.stages[stage]
        return rollout_engine(chosen.env, Policy(by, tokenizer, template, processor, context), rollout=rollout,
                              temperature=temperature, seed=seed, limits=chosen.limits)

    @functools.cache
    def judge() -> Generator:
        """What held-out evaluations sample from (made at the first): the trained weights, so the sampler in the
        synchronous loop, the policy itself when the sampler is a behaviour copy that lags behind."""
        return generator if behaviour is None else HFGenerator(policy, tokenizer, max_batch_size=rollout.concurrency,
                                                               processor=processor)

    def greedy(stage: int) -> EpisodeRunner:
        return engine(stage, judge(), 0.0)

    # temperature only: the recorded logprobs (of the distribution sampled from) are then log_softmax(logits / T),
    # exactly what the update recomputes for the ratio
    # With rollout workers the main process drives them, rolling out every task; the other processes (accelerate
    # launch) roll out none and train on their share of what it gathered.
    if rollout.workers:
        workers = _workers(model, curriculum, settings, rollout, placed, seed, out) if accelerator.is_main_process \
            else None
        stages = range(len(curriculum.stages))
        runners = [workers.stage(i) if workers else EpisodeRunner() for i in stages]
        sampler = workers or (GatherOnly() if sharded else None)
    else:
        runners = [engine(stage, generator, settings.temperature) for stage in range(len(curriculum.stages))]
        sampler = generator if whole is None else WholeCopy(generator, whole)
    return RLComponents(accelerator=accelerator, model=policy, update=update, curriculum=curriculum,
                        runners=runners, greedy_runner=greedy, sampler=sampler, behaviour=behaviour,
                        off_policy=not in_process or settings.max_staleness > 0, tokenizer=tokenizer,
                        chat_template=template, parser=get_parser(rollout.parser, tokenizer), processor=processor,
                        rollouts_on_main=bool(rollout.workers), demonstrations=demonstrations)


def _policy_update(model: str | Path | PreTrainedModel, settings: RLSettings, dtype: str, where: torch.device,
                   accelerator: Accelerator, curriculum: Curriculum, tokenizer: Any, processor: Any) -> PolicyUpdate:
    """The policy (optionally LoRA) with its optimizer and scheduler, prepared by accelerate (or sharded, with
    ``sharding: fsdp``), and a frozen reference only when a KL penalty asks for one (LoRA's reference is its disabled
    adapter)."""
    sharded = settings.sharding == "fsdp"
    policy = trainable_model(model, device=where, dtype=dtype)
    settings = with_learning_rate(settings, policy, "rl")
    compute = None
    if sharded and policy.dtype == torch.bfloat16 and settings.master_weights:  # FSDP keeps float32 masters itself
        policy, compute = policy.float(), torch.bfloat16
    if settings.gradient_checkpointing:  # active in train mode only: generation (eval mode) keeps its cache
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if settings.lora:
        peft = require("peft", feature="LoRA (--lora-r, lora: settings)", install="pip install 'trajlab[lora]'")
        policy = peft.get_peft_model(policy, lora_config(settings.lora))
    reference = None
    if settings.kl_coef > 0 and not settings.lora:
        reference = frozen_copy(model, device=where, dtype=policy.dtype)
    if sharded:
        policy = shard(policy, compute_dtype=compute)
        if reference is not None:
            reference = shard(reference, compute_dtype=compute)
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=settings.learning_rate)
        scheduler = accelerator.prepare(rl_scheduler(optimizer, settings))  # checkpointed with accelerate's state
    else:
        optimizer = adamw([p for p in policy.parameters() if p.requires_grad], master_weights=settings.master_weights,
                          lr=settings.learning_rate)
        policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, rl_scheduler(optimizer, settings))
        if reference is not None:
            reference.to(accelerator.device)
    return PolicyUpdate(policy, reference, optimizer, scheduler, accelerator, settings, _token_budget(curriculum),
                        tokenizer.pad_token_id or 0, processor)


def _default_replay(settings: RLSettings, demonstrations: list[Any]) -> RLSettings:
    """``settings`` with the default replay off where it has nothing to compare (a given one is refused instead,
    by :class:`~trajlab.train.replay.DemonstrationReplay`), saying why."""
    if settings.demonstrations is None:
        logger.info("No rl.demonstrations, so none replayed: the default recipe replays %d logged demonstrations a "
                    "step from such a file (trajlab rl --demonstrations FILE; trajlab run gives its demos.jsonl).",
                    REPLAY_PER_STEP)
        return settings
    usable = len(replayable(demonstrations))
    if usable < MIN_REPLAYABLE:
        logger.warning("rl.demonstrations: %d of its %d demonstrations can be replayed (not errored, with model "
                       "tokens, no drift), fewer than the %d a replay compares: none replayed.",
                       usable, len(demonstrations), MIN_REPLAYABLE)
        return settings.model_copy(update={"replay_demonstrations": 0})
    return settings


def _demonstrations(settings: RLSettings, rollout: RolloutSettings, tokenizer: Any, processor: Any) -> list[Any]:
    """The drift-checked demonstrations ``replay_demonstrations`` draws from (none without replay).

    Raises:
        UserError: replay without ``demonstrations``, or a file that cannot be read.
    """
    if not settings.replay_demonstrations:
        return []
    if settings.demonstrations is None:
        raise UserError("rl.replay_demonstrations needs rl.demonstrations: a trajectory file with token ids, such as "
                        "trajlab collect's --out (trajlab run uses its own demos.jsonl).")
    try:
        logged = list(read_trajectories(settings.demonstrations))
    except (OSError, ValueError) as exc:
        raise UserError(f"rl.demonstrations: cannot read {settings.demonstrations}: {exc}") from exc
    return without_drift(logged, tokenizer, parser=rollout.parser, max_drift=settings.max_drift, processor=processor)


def _check_sharding(settings: RLSettings, placed: ModelSettings, in_process: bool, processes: int) -> None:
    """Refuse sharding a single process, and what sharded training does not do yet.

    Raises:
        UserError: ``sharding: fsdp`` in one process, or with asynchronous rollouts on the hf backend, or with a
            ``vllm serve`` sampler.
    """
    if settings.sharding != "fsdp":
        return
    if in_process and settings.max_staleness:
        raise UserError("rl.sharding: fsdp with rl.max_staleness > 0 needs a sampler with weights of its own: the "
                        "vllm backend or rollout.workers (the hf backend's copy is refreshed between steps only).")
    if placed.vllm.server:
        raise UserError("rl.sharding: fsdp does not drive model.vllm.server yet: use the in-process vllm backend or "
                        "rollout.workers, or rl.sharding: none.")
    if processes < 2:
        raise UserError("rl.sharding: fsdp shards the policy over the trainer processes, and this run has one: "
                        "launch several (accelerate launch --num_processes N -m trajlab.cli rl ...), or set "
                        "rl.sharding: none.")


def _token_budget(curriculum: Curriculum) -> int:
    """Dr.GRPO normalises the token sum by a constant: the most model tokens an episode of any stage can have."""
    limits = [spec.limits.override(**stage.limits) for stage in curriculum.stages
              for spec in (stage.env.specs.values() if isinstance(stage.env, EnvMixture) else [stage.env])]
    return max(limit.max_turns * limit.max_new_tokens for limit in limits)


def _server_sampler(url: str, lora_rank: int | None, tokenizer: Any, out: Path, timeout_s: float) -> Generator:
    """A running ``vllm serve`` (``model.vllm.server``) as the sampler: rollouts over its API; after each update the
    trained adapter (written under the run directory) loaded into it, or without LoRA every weight broadcast to it,
    through a transfer group opened here, before the first step, so a server that cannot take them fails first."""
    from trajlab.inference.openai_client import ServerError, served_model, split_policy_url
    from trajlab.inference.vllm_server import VLLMServerGenerator

    base_url, name = split_policy_url(url)
    try:
        model = served_model(base_url, name)
    except ValueError as exc:
        raise UserError(f"model.vllm.server: {exc}") from exc
    sampler = VLLMServerGenerator(base_url, model, tokenizer, adapter_dir=out / "adapters", turn_timeout_s=timeout_s)
    if lora_rank is None:
        try:
            sampler.connect_weight_transfer()
        except ServerError as exc:
            raise UserError(f"model.vllm.server ({url}) cannot take full weights: {exc} Or train with rl.lora "
                            "(e.g. --lora-r 16) to send adapters only.") from exc
    return sampler


def _vllm_sampler(model: str | Path | PreTrainedModel, placed: ModelSettings, rollout: RolloutSettings,
                  seed: int, lora_rank: int | None, tokenizer: Any, out: Path) -> Generator:
    """An in-process vLLM engine started from the model directory; with LoRA, serving the adapter unmerged (the base
    weights never move after the start). With ``model.vllm.server``, that running server instead."""
    from trajlab.inference.vllm import VLLMGenerator, adapter_engine_args

    if placed.vllm.server:
        return _server_sampler(placed.vllm.server, lora_rank, tokenizer, out, rollout.server_timeout_s)

    if not isinstance(model, str | Path):
        raise UserError("the vllm backend starts its engine from a model directory: save the model "
                        "(save_pretrained) and pass its path.")
    adapters = adapter_engine_args(lora_rank) if lora_rank else {}
    return VLLMGenerator(model, seed=seed, max_batch_size=rollout.concurrency,
                         engine_args=placed.engine_args() | adapters, batching=placed.vllm.batching)


def _workers(model: str | Path | PreTrainedModel, curriculum: Curriculum, settings: RLSettings,
             rollout: RolloutSettings, placed: ModelSettings, seed: int, out: Path) -> RayRolloutRunner:
    """Ray actors rolling out the policy as the in-process engine would (same sampling, limits, prompt, seed), with
    an engine for each curriculum stage."""
    from trajlab.collection.workers import RayRolloutRunner, WorkerSpec

    if not isinstance(model, str | Path):
        raise UserError("rollout.workers start their policies from a model directory: save the model "
                        "(save_pretrained) and pass its path.")
    env, resolved = resolve_prompts(curriculum.stages[0].env, rollout)
    stages = tuple((resolve_prompts(stage.env, rollout)[0], stage.limits) for stage in curriculum.stages)
    spec = WorkerSpec(env=env, policy=str(model), tokenizer=None, model=placed, rollout=resolved,
                      temperature=settings.temperature, seed=seed, stages=stages)
    return RayRolloutRunner(spec, run_dir=out)
