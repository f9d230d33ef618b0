"""Online multi-turn RL: roll out whole trajectories with the current policy, then a clipped policy-gradient update.

One step, top to bottom:
1. sample ``tasks_per_step`` train tasks and ``group_size`` rollouts of each with the trajlab engine; the generator
   wraps the very model being trained, so rollouts are on-policy;
2. score each trajectory with the weighted reward components (each logged as ``reward/<name>``);
3. advantages within each task's group (GRPO, Dr.GRPO or RLOO), per trajectory or per turn;
4. one optimizer step per minibatch (by default the whole batch), accumulated over micro-batches: recompute token
   logprobs, clipped ratio against the rollout's logprobs, optional KL to the starting policy, loss on model tokens
   only (``loss_mask``; padding is tracked by ``attention_mask``). Rollouts whose advantage is zero everywhere
   contribute no gradient and, without a KL term, are not run through the model at all. When another engine
   sampled (vLLM), its logprobs are not the trainer's: the ratio is taken against the trainer's own logprobs,
   recomputed before the update, and each token is weighted by the truncated importance weight
   min(p_trainer / p_sampler, cap) (``rl.importance_sampling``); the mismatch is logged every step.
Runs through accelerate, so the same loop trains on several processes (``accelerate launch``): each process rolls
out its share of the step's tasks, every process receives all of the step's trajectories, and the micro-batches of
each minibatch are dealt round-robin to the processes, so the averaged gradient is the single-process one.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from trajlab.chat.parsers import get_parser
from trajlab.config import RLSettings, RolloutSettings
from trajlab.data.store import TrajectoryStore
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec
from trajlab.errors import UserError, require
from trajlab.inference.base import Generator, SamplingParams, TakesWeights
from trajlab.inference.hf import HFGenerator
from trajlab.inference.pixels import image_inputs
from trajlab.models import load_model
from trajlab.rollout.drift import check_token_drift
from trajlab.rollout.engine import Episode, MixtureEngine, RolloutEngine, make_engine
from trajlab.rollout.rewards import score
from trajlab.rollout.types import Trajectory, task_id
from trajlab.rollout.workers import RayRolloutRunner, WorkerSpec
from trajlab.tracking import Trackers
from trajlab.train.advantages import (
    group_advantages,
    group_turn_advantages,
    spread_over_turns,
    turn_rewards_with_terminal,
    turn_starts,
)
from trajlab.train.curriculum import Curriculum, heldout_success
from trajlab.train.feed import RolloutFeed
from trajlab.train.logprobs import chosen_logprobs
from trajlab.train.lora import lora_config
from trajlab.train.placement import check_trainable, training_device

logger = logging.getLogger(__name__)
CHECKPOINT = "checkpoint"
MIN_SHARED_HEAD = 16
"""Rows sharing fewer leading tokens than this are run in full: one extra forward pass would cost more."""


def run_rl(
    model_dir: str | Path | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    chat_template: str,
    env: EnvSpec | EnvMixture | Curriculum,
    settings: RLSettings,
    rollout: RolloutSettings,
    out_dir: str | Path,
    *,
    seed: int = 0,
    resume: bool = False,
    on_step: Callable[[dict[str, float]], None] | None = None,
    sampler: Generator | None = None,
    device: str = "auto",
    dtype: str = "auto",
    backend: str = "hf",
    report_to: Sequence[str] = (),
    processor: Any = None,
) -> Path:
    """Train ``model_dir`` (a directory or a loaded model) with RL on ``env``'s train tasks, or on a curriculum's
    stage after stage; returns ``out_dir/final`` (LoRA merged). ``device`` and ``dtype`` are ``model.device`` /
    ``model.dtype``: the policy, the reference and the rollouts' generator (the policy itself) share them.

    ``sampler`` rolls out instead of the model being trained (None: an ``HFGenerator`` over it, on-policy); one
    that takes weights (the vllm backend) gets the trainer's after every optimizer step (see ``_synced_sampler``).
    With ``rollout.workers``, Ray actors roll out instead, each starting its ``backend`` policy from ``model_dir``
    and taking the trainer's weights after every optimizer step. Each step's metrics (``METRIC_NAMES``) go to
    ``out_dir/metrics.jsonl``, ``on_step`` and the trackers of ``report_to`` (:mod:`trajlab.tracking`).
    ``processor``: a vision-language model's (``trajlab.models.load_processor``): episodes may then show it images,
    which the sampler and every forward pass of the update get the same way (:mod:`trajlab.inference.pixels`).
    A curriculum (:mod:`trajlab.train.curriculum`) adds ``curriculum/...`` to each step's metrics, each promotion to
    ``out_dir/curriculum.jsonl`` and its state to the checkpoint.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    where = training_device(device)
    # The scheduler counts optimizer steps: accelerate would otherwise step a prepared one once per process.
    accelerator = Accelerator(cpu=where.type == "cpu", step_scheduler_with_optimizer=False)
    curriculum = env if isinstance(env, Curriculum) else Curriculum.single(env, rollout.limit_overrides(), seed=seed)
    if rollout.workers and curriculum.staged:
        raise UserError("a curriculum changes envs and limits between steps, which rollout workers start with: set "
                        "rollout.workers: 0 to train with a curriculum.")
    if rollout.workers and accelerator.num_processes > 1:
        raise UserError("rollout.workers runs rollouts on Ray actors from one trainer process; under "
                        f"{accelerator.num_processes} processes (accelerate launch) set rollout.workers: 0, and each "
                        "process rolls out its share of the tasks.")
    set_seed(seed)

    # --- models: the policy (optionally LoRA), and a frozen reference only when a KL penalty asks for one ---
    policy = load_model(model_dir, device=where, dtype=dtype) if isinstance(model_dir, str | Path) else model_dir
    check_trainable(policy)
    if settings.gradient_checkpointing:  # active in train mode only: generation (eval mode) keeps its cache
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if settings.lora:
        peft = require("peft", feature="LoRA (--lora-r, lora: settings)", install="pip install 'trajlab[lora]'")
        policy = peft.get_peft_model(policy, lora_config(settings.lora))
    reference = None
    if settings.kl_coef > 0 and not settings.lora:  # a frozen copy of the starting weights
        reference = (load_model(model_dir, device=where, dtype=policy.dtype) if isinstance(model_dir, str | Path)
                     else copy.deepcopy(model_dir))
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=settings.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(learning_rate_factor, settings=settings))
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    model = accelerator.unwrap_model(policy)
    if reference is not None:
        reference.to(accelerator.device)

    # With max_staleness > 0 rollouts run while the policy trains, so the hf backend samples from a copy of it
    # (the behaviour policy), which takes the trained weights between two steps' rollouts.
    behaviour = copy.deepcopy(model).eval() if settings.max_staleness and sampler is None else None
    generator = sampler if sampler is not None else HFGenerator(behaviour or model, tokenizer,
                                                                  max_batch_size=rollout.concurrency,
                                                                  processor=processor)
    prompted = [rollout.prompted(stage.env) for stage in curriculum.stages]
    envs, system_prompt = [env for env, _ in prompted], prompted[0][1]
    parser = get_parser(rollout.parser, tokenizer)

    def engine_for(stage: int, by: Generator, temperature: float) -> RolloutEngine | MixtureEngine:
        """The engine of a stage's env and limits, sampling from ``by``."""
        return make_engine(envs[stage], by, tokenizer, chat_template=chat_template, parser=parser,
                           sampling=SamplingParams(temperature=temperature), limits=curriculum.stages[stage].limits,
                           system_prompt=system_prompt, seed=seed, processor=processor)

    # temperature only: the recorded logprobs (of the distribution sampled from) are then log_softmax(logits / T),
    # exactly what _token_logprobs recomputes for the ratio
    engines = [engine_for(stage, generator, settings.temperature) for stage in range(len(envs))]
    # Dr.GRPO normalises the token sum by a constant: the most model tokens an episode of any stage can have.
    token_budget = max(e.limits.max_turns * e.limits.max_new_tokens for engine in engines
                       for e in (engine.engines.values() if isinstance(engine, MixtureEngine) else [engine]))

    workers = (_rollout_workers(model_dir, envs[0], system_prompt, settings, rollout, out_dir, seed=seed,
                                backend=backend, device=device, dtype=dtype) if rollout.workers else None)
    synced = workers if workers is not None else generator  # what samples, and may hold weights of its own
    start, state = _resume(accelerator, out_dir) if resume else (0, {})
    if start:  # the sampler started from model_dir, not the checkpoint
        _publish(synced, behaviour, model)
    if curriculum.staged and "curriculum" in state:
        curriculum.restore(state["curriculum"])
    # The hf backend samples from the very model being trained; any other sampler, or older weights, need the
    # correction.
    other_sampler = sampler is not None or workers is not None or settings.max_staleness > 0
    correct = settings.importance_sampling == "on" or (settings.importance_sampling == "auto" and other_sampler)
    plans: dict[int, list[list[Episode]]] = {}
    stage_of: dict[int, int] = {}  # the curriculum stage each step's tasks came from

    async def rollouts(step: int) -> list[Trajectory]:
        """This process's share of the step's tasks, group_size rollouts each."""
        stage_of[step], step_tasks = curriculum.draw(step, settings.tasks_per_step)
        plans[step] = [_group_episodes(step, i, task, settings.group_size) for i, task in enumerate(step_tasks)]
        mine = range(accelerator.process_index, len(step_tasks), accelerator.num_processes)
        runner = workers if workers is not None else engines[stage_of[step]]
        return await runner.run([e for i in mine for e in plans[step][i]], concurrency=rollout.concurrency,
                                retries=rollout.retries, retry_backoff_s=rollout.retry_backoff_s)

    @functools.cache
    def evaluator() -> Generator:
        """What held-out evaluations sample from (made at the first): the trained weights, so the sampler in the
        synchronous loop, the policy itself when the sampler is a behaviour copy that lags behind."""
        return generator if behaviour is None else HFGenerator(model, tokenizer, max_batch_size=rollout.concurrency,
                                                               processor=processor)

    def heldout(stage: int) -> float:
        """The stage's held-out success, greedy; measured by the main process and shared with the others."""
        value = None
        if accelerator.is_main_process:
            with feed.sampler_lock, engine_for(stage, evaluator(), 0.0) as judge:
                value = asyncio.run(heldout_success(
                    judge, curriculum.heldout_tasks(stage), curriculum.stages[stage].heldout_split,
                    f"curriculum:{curriculum.stages[stage].name}:{curriculum.steps}", concurrency=rollout.concurrency,
                    retries=rollout.retries, retry_backoff_s=rollout.retry_backoff_s))
        return broadcast_object_list([value])[0] if accelerator.num_processes > 1 else value

    model.eval()
    outputs = ExitStack()  # what the main process writes: closed with the run
    trackers = outputs.enter_context(Trackers(
        report_to, out_dir.parent, out_dir.name, enabled=accelerator.is_main_process,
        config={"rl": settings.model_dump(mode="json"), "rollout": rollout.model_dump(mode="json"), "seed": seed,
                "backend": backend}))
    main = accelerator.is_main_process
    metrics_file = outputs.enter_context((out_dir / "metrics.jsonl").open("a")) if main else None
    rollouts_file = outputs.enter_context(TrajectoryStore(out_dir / ROLLOUTS_FILE)) if main else None
    promotions_file = (outputs.enter_context((out_dir / CURRICULUM_FILE).open("a")) if main and curriculum.staged
                       else None)
    feed = RolloutFeed(rollouts, start=start, steps=settings.steps, max_staleness=settings.max_staleness,
                       calls=lambda: synced.batches)
    try:
        for step in range(start, settings.steps):
            # --- 1. rollouts: made by the feed's thread, from weights at most max_staleness steps old ---
            waited = time.perf_counter()
            made = feed.next()
            waited = time.perf_counter() - waited
            trajectories = made.trajectories
            if accelerator.num_processes > 1:  # every process computes the same advantages and deals the same batches
                trajectories = gather_object(trajectories)
            order = {e.id: i for i, e in enumerate(itertools.chain(*plans.pop(step)))}  # not finishing order
            trajectories.sort(key=lambda t: order[t.id])
            staleness = [step - int(t.metrics["policy_version"]) for t in trajectories]

            # --- 2-3. rewards and advantages, group by group ---
            rewards = [score(t, settings.rewards) for t in trajectories]
            token_advantages, group_stats = _advantages(trajectories, rewards, settings)

            # --- the drift guard: train only on tokens that are the template's rendering of their messages ---
            started = time.perf_counter()
            clean, drifts = check_token_drift(trajectories, tokenizer, chat_template, parser,
                                              max_drift=settings.max_drift, processor=processor)
            drift_check_s = time.perf_counter() - started
            clean_ids = {id(t) for t in clean}
            # an episode the machinery broke (status error) is no sample of the policy: never trained on; one
            # sampled by weights more than max_staleness steps old is dropped
            kept = [i for i, t in enumerate(trajectories)
                    if id(t) in clean_ids and t.status != "error" and staleness[i] <= settings.max_staleness]

            # --- 4. policy-gradient update on model tokens ---
            model.train()
            started, learning_rate = time.perf_counter(), scheduler.get_last_lr()[0]
            # synchronous: the sampler is idle during the update, so it may free its memory and take the weights;
            # asynchronous: it keeps rolling out the next steps and takes the weights between two of them
            with _synced_sampler(synced, model) if not settings.max_staleness else nullcontext():
                update, trainer_logprobs = _update(
                    policy, reference, optimizer, scheduler, accelerator, [trajectories[i] for i in kept],
                    [token_advantages[i] for i in kept], settings, token_budget, tokenizer.pad_token_id or 0,
                    correct=correct, shuffle_seed=seed * 1_000_003 + step, processor=processor)
            ended = time.perf_counter()
            model.eval()
            overlap_s = feed.timeline.overlap(started, ended, now=ended)
            # the stage's rule, before the next step's rollouts may start: a promotion is in effect for them
            stage_metrics, promotion = curriculum.observe(step, stage_of.pop(step), trajectories, heldout)
            # synchronous, the weights went to the sampler on leaving _synced_sampler
            feed.trained(step + 1, lambda: _publish(synced, behaviour, model) if settings.max_staleness else None)

            if rollouts_file is not None:
                _record_rollouts(rollouts_file, step, trajectories, rewards, token_advantages, set(kept),
                                 {kept[i]: lps for i, lps in trainer_logprobs.items()})
            record = _step_metrics(step, trajectories, rewards, made.ended - made.began, ended - started)
            record |= group_stats | update | _staleness_metrics(staleness, settings.max_staleness)
            record |= {"generate_calls": made.generate_calls, "drift/trajectories": len(drifts),
                       "drift_check_s": drift_check_s, "lr": learning_rate, "processes": accelerator.num_processes,
                       "rollout_wait_s": waited, "overlap_s": overlap_s}
            if workers is not None:
                record["workers_replaced"] = workers.replaced
            if curriculum.staged:
                record |= stage_metrics
            record = namespaced(record)
            if metrics_file is not None:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                trackers.log(record, step=step + 1)
                if on_step:
                    on_step(record)
            if promotion is not None and promotions_file is not None:
                line = promotion.record(curriculum.stages)
                logger.info("curriculum: after step %d, stage %s -> %s (%s %.3f)", line["step"], line["from"],
                            line["to"], line["rule"], line["value"])
                promotions_file.write(json.dumps(line) + "\n")
                promotions_file.flush()
            if (step + 1) % settings.save_steps == 0 or step + 1 == settings.steps:
                _checkpoint(accelerator, out_dir, step + 1,
                            {"curriculum": curriculum.state()} if curriculum.staged else {})
    finally:
        feed.close()
        outputs.close()
        for engine in engines:
            engine.close()
        if workers is not None:
            workers.close()

    final = out_dir / "final"
    if accelerator.is_main_process:
        trained = model.merge_and_unload() if settings.lora else model
        trained.save_pretrained(final)
        tokenizer.save_pretrained(final)
        if processor is not None:
            processor.save_pretrained(final)
    accelerator.wait_for_everyone()
    return final


@contextmanager
def _synced_sampler(sampler: Generator | RayRolloutRunner, model: torch.nn.Module) -> Iterator[None]:
    """Around the update: a sampler that is not the trained model itself (vLLM, rollout workers) frees its memory
    (sleep), then wakes and takes the new weights, so the next rollouts come from them. Nothing for the on-policy
    HFGenerator."""
    if not isinstance(sampler, TakesWeights):
        yield
        return
    sampler.sleep()
    try:
        yield
    finally:
        sampler.wake_up()
    sampler.load_weights(model)


def _publish(sampler: Generator | RayRolloutRunner, behaviour: torch.nn.Module | None, model: torch.nn.Module) -> None:
    """Hand the trained weights to what samples: its own copy (vLLM, rollout workers), or the behaviour policy."""
    if isinstance(sampler, TakesWeights):
        sampler.load_weights(model)
    elif behaviour is not None:
        with torch.no_grad():
            for mine, trained in zip(behaviour.parameters(), model.parameters(), strict=True):
                mine.copy_(trained)


ROLLOUTS_FILE = "rollouts.jsonl"
"""Every step's trajectories, in ``out_dir``: what the update saw, for ``trajlab report``."""
CURRICULUM_FILE = "curriculum.jsonl"
"""A curriculum's promotions, in ``out_dir``: one line each (step, from, to, rule, value)."""


def _record_rollouts(store: TrajectoryStore, step: int, trajectories: list[Trajectory], rewards: list[float],
                     token_advantages: list[list[float]], trained: set[int],
                     trainer_logprobs: dict[int, list[float]]) -> None:
    """Append the step's trajectories with what RL made of them: ``rl/step``, ``rl/reward`` (weighted),
    ``rl/trained`` (1 if the update used it), ``advantage/<turn>`` (each model turn's advantage) and, where the
    update computed them, the trainer's logprobs of the model tokens (none for a rollout whose advantage was zero
    throughout and went through no forward pass; with several processes, those of the main process's passes). A
    resumed run skips the ones already there."""
    for index, trajectory in enumerate(trajectories):
        if trajectory.id in store.ids:
            continue
        update: dict[str, Any] = {}
        extra = {"rl/step": float(step + 1), "rl/reward": rewards[index], "rl/trained": float(index in trained)}
        if trajectory.tokens is not None:
            turns = turn_starts(trajectory.tokens.loss_mask)
            extra |= {f"advantage/{turn}": token_advantages[index][start] for turn, start in enumerate(turns)}
            if index in trainer_logprobs:
                update["tokens"] = trajectory.tokens.model_copy(update={"trainer_logprobs": [
                    lp if bit else None
                    for lp, bit in zip(trainer_logprobs[index], trajectory.tokens.loss_mask, strict=True)]})
        store.append(trajectory.model_copy(update=update | {"metrics": trajectory.metrics | extra}))


METRIC_NAMES = {
    "step": "step",
    "reward": "reward/mean",
    **{name: f"rollout/{name}" for name in (
        "success_rate", "tool_error_rate", "parse_error_rate", "mean_turns", "episodes", "errors", "retries",
        "zero_variance_groups", "groups_short", "groups_skipped", "staleness_mean", "dropped_stale",
        "workers_replaced")},
    "drift/trajectories": "rollout/drifted",
    "loss": "loss/policy", "kl": "loss/kl", "entropy": "loss/entropy", "clip_fraction": "loss/clip_fraction",
    "grad_norm": "optim/grad_norm", "lr": "optim/lr", "trained_sequences": "optim/trained_sequences",
    **{name: f"perf/{name}" for name in (
        "tokens_per_s", "rollout_s", "update_s", "rollout_wait_s", "overlap_s", "generate_calls", "drift_check_s",
        "processes")},
}
"""An RL step's metrics by their names in ``metrics.jsonl`` and the trackers (README, "Metrics")."""
METRIC_PREFIXES = {"reward/": "reward/", "mismatch/": "mismatch/", "staleness/": "rollout/staleness/",
                   "per_env/": "rollout/per_env/", "curriculum/": "curriculum/"}


def namespaced(record: dict[str, float]) -> dict[str, float]:
    """``record`` under the names users see (``METRIC_NAMES``); a metric without one is a bug, not a new name."""
    named = {}
    for key, value in record.items():
        prefix = next((p for p in METRIC_PREFIXES if key.startswith(p)), None)
        named[METRIC_PREFIXES[prefix] + key.removeprefix(prefix) if prefix else METRIC_NAMES[key]] = value
    return named


def _staleness_metrics(staleness: list[int], max_staleness: int) -> dict[str, float]:
    """How many policy versions behind the trained weights each rollout was sampled, and how many were dropped."""
    counts = {f"staleness/{age}": float(staleness.count(age)) for age in sorted(set(staleness))}
    return counts | {"dropped_stale": float(sum(age > max_staleness for age in staleness)),
                     "staleness_mean": sum(staleness) / max(1, len(staleness))}


def _rollout_workers(model_dir: str | Path | PreTrainedModel, env: EnvSpec | EnvMixture, system_prompt: str | None,
                     settings: RLSettings, rollout: RolloutSettings, out_dir: Path, *, seed: int, backend: str,
                     device: str, dtype: str) -> RayRolloutRunner:
    """Ray actors rolling out the policy as the in-process engine would (same sampling, limits, prompt, seed)."""
    if not isinstance(model_dir, str | Path):
        raise UserError("rollout.workers start their policies from a model directory: save the model "
                        "(save_pretrained) and pass its path.")
    spec = WorkerSpec(env=env, policy=str(model_dir), backend=backend, device=device, dtype=dtype,
                      parser=rollout.parser, sampling=SamplingParams(temperature=settings.temperature),
                      limits=rollout.limit_overrides(), system_prompt=system_prompt, seed=seed,
                      max_batch_size=rollout.concurrency)
    return RayRolloutRunner(spec, rollout.workers, address=rollout.ray_address, run_dir=out_dir,
                            worker_gpus=rollout.worker_gpus,
                            concurrency=rollout.concurrency)


def _group_episodes(step: int, index: int, task: dict[str, Any], group_size: int) -> list[Episode]:
    """The ``group_size`` rollouts of the step's ``index``-th task, compared with each other for advantages.

    The group is the task's place in the step, not its id: two envs of a mixture (or a short task cycle) may repeat
    a task id within one step, and each stays its own group.
    """
    group = f"rl:{step}:{index}"
    return [Episode(f"{group}:{task_id(task)}:{g}", task, split="train", group=group) for g in range(group_size)]


def _advantages(
    trajectories: list[Trajectory], rewards: list[float], settings: RLSettings
) -> tuple[list[list[float]], dict[str, float]]:
    """Token advantages per trajectory, and the step's group statistics.

    Rollouts are compared within their ``Trajectory.group``, over the group's valid rollouts only: one that ended
    with status ``error`` (the machinery failed, not the policy) has no reward to compare, gets no advantage and
    counts in no group's statistics; a group left with fewer than two valid rollouts has nothing to compare and is
    skipped. Statistics: the share of groups whose rewards were all equal (no signal), groups computed over fewer
    rollouts than were run, groups skipped.

    Raises:
        ValueError: a trajectory has no group.
    """
    groups: dict[str, list[int]] = {}
    for index, trajectory in enumerate(trajectories):
        if trajectory.group is None:
            raise ValueError(f"trajectory {trajectory.id!r} has no group: RL compares rollouts within a group")
        groups.setdefault(trajectory.group, [])
        if trajectory.status != "error":
            groups[trajectory.group].append(index)
    out: list[list[float]] = [[0.0] * (len(t.tokens.loss_mask) if t.tokens else 0) for t in trajectories]
    flat = short = skipped = 0
    dense_weight = settings.rewards.get("progress", 0.0)
    for members in groups.values():
        short += len(members) < settings.group_size
        if len(members) < 2:
            skipped += 1
            continue
        group_rewards = torch.tensor([rewards[i] for i in members])
        flat += bool(torch.all(group_rewards == group_rewards[0]))
        if settings.credit == "trajectory":
            values = group_advantages(group_rewards, settings.estimator).tolist()
            for i, value in zip(members, values, strict=True):
                mask = trajectories[i].tokens.loss_mask if trajectories[i].tokens else []
                out[i] = [value * bit for bit in mask]
            continue
        per_turn = [
            turn_rewards_with_terminal(trajectories[i].turn_rewards or [], rewards[i], dense_weight) for i in members
        ]
        for i, turn_values in zip(members, group_turn_advantages(per_turn, settings.estimator), strict=True):
            mask = trajectories[i].tokens.loss_mask if trajectories[i].tokens else []
            out[i] = spread_over_turns(mask, turn_values)
    compared = len(groups) - skipped
    return out, {"zero_variance_groups": flat / max(1, compared), "groups_short": float(short),
                 "groups_skipped": float(skipped)}


def _update(
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    accelerator: Accelerator,
    trajectories: list[Trajectory],
    token_advantages: list[list[float]],
    settings: RLSettings,
    token_budget: int,
    pad_id: int,
    *,
    correct: bool = False,
    shuffle_seed: int = 0,
    processor: Any = None,
) -> tuple[dict[str, float], dict[int, list[float]]]:
    """One step's optimizer steps over its rollouts; returns the step's loss statistics with the sampler-trainer
    mismatch (``mismatch/...``), and the trainer's logprobs of each rollout's completion tokens (by index) as they
    were before the first optimizer step, for the rollouts this process computed them for.

    ``correct``: the sampler was not this model's own forward pass, so the trainer's logprobs are recomputed for
    every rollout first (the "old" policy of the clipped ratio) and each token's loss is weighted by the truncated
    importance weight. Without it the mismatch is measured on the passes before the first optimizer step.

    Every process holds all of the step's rollouts. Each minibatch's micro-batches are dealt round-robin to the
    processes; a process with none left runs a pass of weight zero, so all run the same number of backward passes
    (DDP all-reduces on each) and nobody waits forever. Losses are scaled by the process count, since DDP averages
    gradients: the sum over processes is the single-process gradient. ``shuffle_seed`` orders the minibatches.
    """
    usable = [i for i, t in enumerate(trajectories) if t.tokens is not None and any(t.tokens.loss_mask)]
    if not usable:
        return {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0,
                "trained_sequences": 0}, {}
    lengths = {i: len(trajectories[i].tokens.prompt_ids) + len(trajectories[i].tokens.completion_ids) for i in usable}
    trainer_logprobs: dict[int, list[float]] = {}
    mismatch = _MismatchSums()
    if correct:
        trainer_logprobs = _trainer_logprobs(policy, trajectories, sorted(usable, key=lengths.__getitem__), settings,
                                             pad_id, accelerator.device, mismatch, processor)
    # A rollout whose advantage is zero on every token (e.g. a group that all succeeded) adds nothing to the gradient
    # without a KL term: skip its forward and backward. Normalisers still count it, so the step is the same.
    silent = set()
    if settings.kl_coef == 0:
        silent = {i for i in usable if not any(token_advantages[i])}
    totals = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_fraction": 0.0}
    passes = steps = 0
    grad_norm = 0.0
    per_step = settings.minibatch_size or len(usable)
    processes, rank = accelerator.num_processes, accelerator.process_index
    shuffle = torch.Generator().manual_seed(shuffle_seed)
    for _ in range(settings.epochs_per_step):
        order = [usable[i] for i in torch.randperm(len(usable), generator=shuffle).tolist()]
        for start in range(0, len(order), per_step):
            # One optimizer step per minibatch; its micro-batches hold similar lengths to waste little on padding.
            minibatch = sorted(order[start : start + per_step], key=lengths.__getitem__)
            normaliser = _loss_normaliser([trajectories[i] for i in minibatch], settings.estimator, token_budget)
            trained = [i for i in minibatch if i not in silent]
            micro = [trained[first : first + settings.micro_batch_size]
                     for first in range(0, len(trained), settings.micro_batch_size)]
            for turn in range(math.ceil(len(micro) / processes)):
                index = turn * processes + rank
                chosen, weight = (micro[index], 1.0) if index < len(micro) else (micro[0], 0.0)
                batch = _pack([trajectories[i] for i in chosen], [token_advantages[i] for i in chosen], pad_id,
                              accelerator.device, [trainer_logprobs[i] for i in chosen] if correct else None)
                stats = _policy_loss(policy, reference, batch, settings, normaliser, processor)
                accelerator.backward(stats.pop("loss_tensor") * (weight * processes))
                if not weight:  # a pass that only keeps the processes in step
                    continue
                if not correct and steps == 0:  # the weights that sampled: the mismatch is the engines' difference
                    mismatch.add(stats["trainer_logprobs"], batch, settings.importance_cap)
                    trainer_logprobs |= _by_rollout(stats["trainer_logprobs"], batch, chosen, trajectories)
                for key in totals:
                    totals[key] += stats[key]
                passes += 1
            grad_norm += float(accelerator.clip_grad_norm_(policy.parameters(), settings.max_grad_norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            steps += 1
    if processes > 1:  # the statistics of every process's passes
        summed = accelerator.reduce(torch.tensor([*totals.values(), float(passes), *mismatch.sums()],
                                                 device=accelerator.device), reduction="sum").tolist()
        totals = dict(zip(totals, summed[: len(totals)], strict=True))
        passes = int(summed[len(totals)])
        mismatch = _MismatchSums(*summed[len(totals) + 1 :])
    # Micro-batch losses add up to their minibatch's loss; the other statistics are averages over passes.
    averages = {key: value / max(1, passes) for key, value in totals.items()}
    return (averages | {"loss": totals["loss"] / max(1, steps), "grad_norm": grad_norm / max(1, steps),
                        "trained_sequences": len(usable) - len(silent)} | mismatch.means()), trainer_logprobs


def _by_rollout(logprobs: torch.Tensor, batch: dict[str, Any], chosen: list[int],
                trajectories: list[Trajectory]) -> dict[int, list[float]]:
    """A packed batch's (B, T - completion_start) logprobs cut back into each rollout's completion tokens."""
    out = {}
    for row, index in enumerate(chosen):
        tokens = trajectories[index].tokens
        offset = len(tokens.prompt_ids) - batch["completion_start"]
        out[index] = logprobs[row, offset : offset + len(tokens.completion_ids)].tolist()
    return out


class _MismatchSums:
    """Token sums of the sampler-trainer mismatch over a step's model tokens.

    With the sampler's logprob s and the trainer's t of each sampled token: mean |t - s|; the KL from sampler to
    trainer by the k3 estimator (exp(t - s) - (t - s) - 1, unbiased under the sampler's samples, never negative);
    and the share of tokens whose importance weight exp(t - s) exceeds the cap.
    """

    def __init__(self, abs_logprob: float = 0.0, kl: float = 0.0, clipped: float = 0.0, tokens: float = 0.0) -> None:
        self.abs_logprob, self.kl, self.clipped, self.tokens = abs_logprob, kl, clipped, tokens

    def sums(self) -> list[float]:
        return [self.abs_logprob, self.kl, self.clipped, self.tokens]

    def add(self, trainer: torch.Tensor, batch: dict[str, Any], cap: float) -> None:
        start = batch["completion_start"]
        mask, delta = batch["loss_mask"][:, start:], trainer.detach() - batch["old_logprobs"][:, start:]
        self.abs_logprob += (delta.abs() * mask).sum().item()
        self.kl += ((torch.exp(delta) - delta - 1) * mask).sum().item()
        self.clipped += ((torch.exp(delta) > cap).float() * mask).sum().item()
        self.tokens += mask.sum().item()

    def means(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        return {"mismatch/abs_logprob": self.abs_logprob / self.tokens, "mismatch/kl": self.kl / self.tokens,
                "mismatch/clipped_share": self.clipped / self.tokens}


@torch.no_grad()
def _trainer_logprobs(
    policy: torch.nn.Module,
    trajectories: list[Trajectory],
    order: list[int],
    settings: RLSettings,
    pad_id: int,
    device: torch.device,
    mismatch: _MismatchSums,
    processor: Any = None,
) -> dict[int, list[float]]:
    """The trained model's logprob of every completion token of each rollout, before any optimizer step: the "old"
    policy of the clipped ratio when another engine sampled. Eval mode, as sampling ran; micro-batches of
    similar lengths."""
    model = _unwrap(policy)
    training = model.training
    model.eval()
    out: dict[int, list[float]] = {}
    try:
        for first in range(0, len(order), settings.micro_batch_size):
            chosen = order[first : first + settings.micro_batch_size]
            rows = [trajectories[i] for i in chosen]
            batch = _pack(rows, [[0.0] * len(t.tokens.completion_ids) for t in rows], pad_id, device)
            logprobs, _ = _token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                          batch["completion_start"], settings.temperature, batch["images"], processor)
            mismatch.add(logprobs, batch, settings.importance_cap)
            out |= _by_rollout(logprobs, batch, chosen, trajectories)
    finally:
        model.train(training)
    return out


def _loss_normaliser(trajectories: list[Trajectory], estimator: str, token_budget: int) -> float:
    """What a minibatch's summed loss is divided by, so accumulating micro-batches equals one big batch.

    grpo sums per-sequence token means (divide by sequences); dr_grpo divides the token sum by a constant budget per
    sequence (no length bias); rloo averages over every model token of the minibatch.
    """
    if estimator == "grpo":
        return float(len(trajectories))
    if estimator == "dr_grpo":
        return float(len(trajectories) * token_budget)
    return float(max(1, sum(sum(t.tokens.loss_mask) for t in trajectories)))


def learning_rate_factor(done: int, settings: RLSettings) -> float:
    """The rate's multiplier after ``done`` optimizer steps: warm-up that starts above 0 (no step is wasted at rate
    0), then held or decayed to 0 at the run's last planned optimizer step."""
    warmup = min(1.0, (done + 1) / (settings.warmup_steps + 1))
    if settings.lr_scheduler == "constant":
        return warmup
    batch = settings.tasks_per_step * settings.group_size
    per_step = settings.epochs_per_step * math.ceil(batch / (settings.minibatch_size or batch))
    decaying = max(1, settings.steps * per_step - settings.warmup_steps)
    progress = min(1.0, max(0, done - settings.warmup_steps) / decaying)
    decay = 1 - progress if settings.lr_scheduler == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return warmup * decay


def _pack(
    trajectories: list[Trajectory],
    advantages: list[list[float]],
    pad_id: int,
    device: torch.device,
    trainer_logprobs: list[list[float]] | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded (B, T) tensors; padding is marked in attention_mask, never inferred from token ids.

    ``old_logprobs`` are the sampler's; ``trainer_logprobs`` (when given) the trainer's own, recomputed for the
    off-policy correction. ``completion_start`` is the shortest prompt: no position before it carries loss, so no
    logits are needed there.

    Raises:
        ValueError: a model token has no sampler logprob (a backend that returned none cannot be trained on).
    """
    rows = []
    for index, (trajectory, advantage) in enumerate(zip(trajectories, advantages, strict=True)):
        tokens = trajectory.tokens
        if any(lp is None for lp, bit in zip(tokens.logprobs, tokens.loss_mask, strict=True) if bit):
            raise ValueError(f"trajectory {trajectory.id!r} has model tokens without the sampler's logprob: RL needs "
                             "them for its ratio; roll out with a backend that returns logprobs (hf, vllm).")
        prompt = len(tokens.prompt_ids)
        trainer = trainer_logprobs[index] if trainer_logprobs is not None else []
        rows.append((
            tokens.prompt_ids + tokens.completion_ids,
            [0] * prompt + tokens.loss_mask,
            [0.0] * prompt + [lp if lp is not None else 0.0 for lp in tokens.logprobs],
            [0.0] * prompt + advantage,
            [0.0] * prompt + trainer,
        ))
    width = max(len(row[0]) for row in rows)

    def column(index: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([row[index] + [fill] * (width - len(row[index])) for row in rows], dtype=dtype,
                            device=device)

    attention = torch.tensor([[1] * len(row[0]) + [0] * (width - len(row[0])) for row in rows], device=device)
    batch = {
        "input_ids": column(0, pad_id, torch.long),
        "attention_mask": attention,
        "loss_mask": column(1, 0, torch.float32),
        "old_logprobs": column(2, 0.0, torch.float32),
        "advantages": column(3, 0.0, torch.float32),
        "completion_start": min(len(t.tokens.prompt_ids) for t in trajectories),
        "images": [t.image(image_id) for t in trajectories for image_id in t.images],  # rows' placeholders' order
    }
    if trainer_logprobs is not None:
        batch["trainer_logprobs"] = column(4, 0.0, torch.float32)
    return batch


def _token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor, start: int, temperature: float,
    images: Sequence[Any] = (), processor: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (B, T - start) of the tokens from ``start`` on at the sampling temperature, and the entropy
    of each position's distribution.

    The model returns final hidden states, and the output head turns them into log-probabilities a slice at a time
    (``logprobs.chosen_logprobs``): logits over the full vocabulary never exist for the whole batch. Only positions
    from ``start`` on are read: the prompt needs none. The head all rows share (system prompt, tool schemas: often
    half of every sequence) is run once and its key/value states broadcast to every row; gradients flow back through
    the broadcast, so the result equals running each row in full. ``images`` (those whose placeholders the rows
    hold, in order) reach the model as they reached the sampler; rows with images are run in full.
    """
    checkpointing = model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    # checkpointed layers keep no key/value states; image inputs go with the whole sequence
    head = 0 if checkpointing or images else _shared_head(input_ids, start)
    last = {"logits_to_keep": 1, "output_hidden_states": True}  # one position of logits: the head is applied below
    if not head:
        pixels = image_inputs(_unwrap(model), processor, images, input_ids)
        hidden = model(input_ids=input_ids, attention_mask=attention, use_cache=False, **last, **pixels
                       ).hidden_states[-1]
    else:
        rows, width = input_ids.shape
        states = model(input_ids=input_ids[:1, :head], use_cache=True, logits_to_keep=1).past_key_values
        broadcast = [(layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1))
                     for layer in states.layers]
        positions = torch.arange(head, width, device=input_ids.device).expand(rows, -1)
        hidden = model(input_ids=input_ids[:, head:], attention_mask=attention, position_ids=positions,
                       past_key_values=DynamicCache(ddp_cache_data=broadcast, config=model.config), **last
                       ).hidden_states[-1]
    hidden = hidden[:, start - 1 - head : input_ids.shape[1] - 1 - head]  # (B, L, H): position t predicts t + 1
    return chosen_logprobs(hidden, _output_head(model), input_ids[:, start:], temperature)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _output_head(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's hidden-states-to-logits layer, with the logit soft-capping some families (Gemma 2) apply."""
    inner = _unwrap(model)
    linear = inner.get_output_embeddings()
    cap = getattr(inner.config.get_text_config(), "final_logit_softcapping", None)
    if not cap:
        return linear
    return lambda hidden: torch.tanh(linear(hidden) / cap) * cap


def _shared_head(input_ids: torch.Tensor, start: int) -> int:
    """How many leading tokens every row shares, up to the first position whose logits are needed (0: not worth
    sharing, or several processes: DDP, FSDP and DeepSpeed expect one forward pass per backward pass)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if input_ids.shape[0] < 2 or (distributed and torch.distributed.get_world_size() > 1):
        return 0
    differs = (input_ids[:, : start - 1] != input_ids[:1, : start - 1]).any(0).nonzero()
    head = int(differs[0]) if len(differs) else start - 1
    return head if head >= MIN_SHARED_HEAD else 0


def _policy_loss(
    policy: torch.nn.Module,
    reference: torch.nn.Module | None,
    batch: dict[str, Any],
    settings: RLSettings,
    normaliser: float,
    processor: Any = None,
) -> dict[str, Any]:
    input_ids, attention, start = batch["input_ids"], batch["attention_mask"], batch["completion_start"]
    images = batch["images"]
    mask = batch["loss_mask"][:, start:]  # (B, L): model tokens only
    sampler = batch["old_logprobs"][:, start:]
    advantages = batch["advantages"][:, start:]
    corrected = "trainer_logprobs" in batch
    old = batch["trainer_logprobs"][:, start:] if corrected else sampler

    logprobs, entropy = _token_logprobs(policy, input_ids, attention, start, settings.temperature, images,
                                        processor)  # (B, L) each

    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 1 - settings.clip_eps, 1 + settings.clip_eps)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if corrected:  # truncated importance sampling: the tokens came from the sampler, not from `old`
        per_token = per_token * torch.exp(old - sampler).clamp(max=settings.importance_cap)

    kl = torch.zeros_like(per_token)
    if settings.kl_coef > 0:
        with torch.no_grad(), (policy.disable_adapter() if reference is None else nullcontext()):
            ref_model = policy if reference is None else reference
            ref_logprobs, _ = _token_logprobs(ref_model, input_ids, attention, start, settings.temperature, images,
                                              processor)
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1  # k3 estimator: unbiased, always >= 0
        per_token = per_token + settings.kl_coef * kl

    if settings.estimator == "grpo":  # each sequence's token mean; the normaliser counts sequences
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normaliser
    else:  # dr_grpo and rloo: a token sum over a constant (dr_grpo) or the minibatch's token count (rloo)
        loss = (per_token * mask).sum() / normaliser

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clip_fraction = (((ratio - 1).abs() > settings.clip_eps).float() * mask).sum() / n
        stats = {
            "loss": loss.item(),
            "kl": ((kl * mask).sum() / n).item(),
            "entropy": ((entropy * mask).sum() / n).item(),
            "clip_fraction": clip_fraction.item(),
        }
    return stats | {"loss_tensor": loss, "trainer_logprobs": logprobs.detach()}


def _step_metrics(
    step: int,
    trajectories: list[Trajectory],
    rewards: list[float],
    rollout_s: float,
    update_s: float,
) -> dict[str, float]:
    """The step's rollout statistics. Episodes that ended in ``error`` (the machinery's failure) are counted
    (in ``episodes`` and ``errors``; ``retries``: attempts beyond the first over all episodes) but left out of the
    policy's statistics: they say nothing about it."""
    episodes = len(trajectories)
    retries = sum(t.metrics.get("attempts", 1.0) - 1 for t in trajectories)
    errors = sum(t.status == "error" for t in trajectories)
    rewards = [r for r, t in zip(rewards, trajectories, strict=True) if t.status != "error"]
    trajectories = [t for t in trajectories if t.status != "error"]
    n = max(1, len(trajectories))
    calls = sum(t.metrics.get("tool_calls", 0.0) for t in trajectories)
    turns = sum(t.metrics.get("turns", 0.0) for t in trajectories)
    generated = sum(t.metrics.get("model_tokens", 0.0) for t in trajectories)
    record = {
        "step": step + 1,
        "reward": sum(rewards) / n,
        "success_rate": sum(t.status == "success" for t in trajectories) / n,
        "tool_error_rate": sum(t.metrics.get("tool_errors", 0.0) for t in trajectories) / calls if calls else 0.0,
        "parse_error_rate": sum(t.metrics.get("parse_errors", 0.0) for t in trajectories) / turns if turns else 0.0,
        "mean_turns": turns / n,
        "episodes": float(episodes),
        "errors": float(errors),
        "retries": retries,
        "tokens_per_s": generated / rollout_s if rollout_s else 0.0,
        "rollout_s": rollout_s,
        "update_s": update_s,
    }
    for key in sorted({k for t in trajectories for k in t.metrics if k.startswith("reward/")}):
        record[key] = sum(t.metrics.get(key, 0.0) for t in trajectories) / n
    envs = sorted({t.env for t in trajectories})
    if len(envs) > 1:  # a mixture: each env's share of the step, so one env's progress cannot hide another's
        for env in envs:
            mine = [i for i, t in enumerate(trajectories) if t.env == env]
            record[f"per_env/{env}/episodes"] = float(len(mine))
            record[f"per_env/{env}/reward"] = sum(rewards[i] for i in mine) / len(mine)
            record[f"per_env/{env}/success_rate"] = sum(trajectories[i].status == "success" for i in mine) / len(mine)
    if not math.isfinite(record["reward"]):
        raise FloatingPointError(f"non-finite reward at step {step + 1}")
    return record


def _checkpoint(accelerator: Accelerator, out_dir: Path, step: int, extra: dict[str, Any]) -> None:
    """Write the state (with ``extra``, e.g. the curriculum's) to a temp dir, then swap it in: a crash mid-save never
    destroys the last checkpoint."""
    final, partial = out_dir / CHECKPOINT, out_dir / f"{CHECKPOINT}.partial"
    accelerator.save_state(str(partial))
    if accelerator.is_main_process:
        (partial / "trajlab_state.json").write_text(json.dumps({"step": step} | extra))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    accelerator.wait_for_everyone()


def _resume(accelerator: Accelerator, out_dir: Path) -> tuple[int, dict[str, Any]]:
    """The steps a checkpoint holds (its weights and optimizer loaded) and its saved state; none: (0, {})."""
    checkpoint = out_dir / CHECKPOINT
    if not (checkpoint / "trajlab_state.json").exists():
        logger.info("No RL checkpoint in %s: starting from step 0.", out_dir)
        return 0, {}
    accelerator.load_state(str(checkpoint))
    state = json.loads((checkpoint / "trajlab_state.json").read_text())
    return state["step"], state
