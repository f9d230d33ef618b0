"""Online multi-turn RL: the training loop over components the recipe built (:mod:`trajlab.recipes.rl`).

One step, top to bottom:
1. the step's rollouts: ``tasks_per_step`` train tasks (from the curriculum's current stage), ``group_size``
   rollouts of each, made by the feed's thread from weights at most ``max_staleness`` steps old;
2. each trajectory's weighted reward (each component logged as ``reward/<name>``);
3. advantages within each task's group (GRPO, Dr.GRPO or RLOO), per trajectory or per turn;
4. the drift guard: only tokens that are the chat template's rendering of their messages are trained on;
5. the update (:class:`~trajlab.train.update.PolicyUpdate`): clipped policy-gradient loss on model tokens, optional
   KL to the starting policy, the off-policy correction when another engine sampled; the sampler then gets the new
   weights (:mod:`trajlab.train.publish`);
6. the curriculum's promote rule, metrics, the step's rollouts for the report, and a checkpoint every
   ``save_steps``.

Runs through accelerate, so the same loop trains on several processes (``accelerate launch``): each process rolls
out its share of the step's tasks, every process receives all of the step's trajectories, and the update deals the
micro-batches to the processes, so the averaged gradient is the single-process one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from trajlab.chat.parsers import ToolCallParser
from trajlab.config import RLSettings, RolloutSettings
from trajlab.data.store import TrajectoryStore
from trajlab.rewards import RewardSet, Scores
from trajlab.rollout.drift import check_token_drift
from trajlab.rollout.runner import Episode, EpisodeRunner
from trajlab.rollout.samples import split_advantages, turn_samples
from trajlab.rollout.types import Trajectory, task_id
from trajlab.tracking import Trackers
from trajlab.train.advantages import step_advantages
from trajlab.train.checkpoints import MetricsLog, load_checkpoint, save_checkpoint, save_final
from trajlab.train.curriculum import Curriculum, Promotion, heldout_success
from trajlab.train.feed import RolloutFeed, StepRollouts
from trajlab.train.publish import publish, synced_sampler
from trajlab.train.replay import DemonstrationReplay, without_sampler_logprobs
from trajlab.train.schedule import failed_share
from trajlab.train.sharding import is_sharded
from trajlab.train.step_metrics import namespaced, record_rollouts, staleness_metrics, step_metrics
from trajlab.train.update import PolicyUpdate

logger = logging.getLogger(__name__)
ROLLOUTS_FILE = "rollouts.jsonl"
"""Every step's trajectories, in the output directory: what the update saw, for ``trajlab report``."""
CURRICULUM_FILE = "curriculum.jsonl"
"""A curriculum's promotions, in the output directory: one line each (step, from, to, rule, value)."""


@dataclass
class RLComponents:
    """What the loop trains with, built by the recipe.

    Attributes:
        model: the policy itself (accelerate's wrapper removed; a PEFT model with LoRA): trained, and saved at the
            end.
        update: the policy as accelerate prepared it, with its reference, optimizer and scheduler.
        runners: one per curriculum stage: rolls out the stage's tasks with the sampler.
        greedy_runner: a stage's engine sampling greedily from the trained weights (held-out success).
        sampler: what samples the rollouts; one with weights of its own (vLLM, rollout workers) gets the trained
            ones after every update.
        behaviour: asynchronous RL on the ``hf`` backend: the copy of the policy the rollouts sample from.
        off_policy: the rollouts are not sampled by the trained model's own forward pass (another engine, workers,
            or possibly stale weights): ``importance_sampling: auto`` corrects for it.
        rollouts_on_main: the main process rolls out every task (on rollout workers) and the others none; else each
            process rolls out its share. Either way every process then trains on its share of all of them.
    """

    accelerator: Accelerator
    model: torch.nn.Module
    update: PolicyUpdate
    curriculum: Curriculum
    runners: list[EpisodeRunner]
    greedy_runner: Callable[[int], EpisodeRunner]
    sampler: Any
    behaviour: torch.nn.Module | None
    off_policy: bool
    tokenizer: Any
    chat_template: str
    parser: ToolCallParser
    processor: Any = None
    rollouts_on_main: bool = False
    demonstrations: list[Trajectory] = field(default_factory=list)
    """The logged demonstrations ``replay_demonstrations`` draws from, drift-checked."""


def train_rl(parts: RLComponents, settings: RLSettings, rollout: RolloutSettings, out_dir: Path, *, seed: int,
             resume: bool, on_step: Callable[[dict[str, float]], None] | None, report_to: Sequence[str],
             run_config: dict[str, Any]) -> Path:
    """Train for ``settings.steps`` steps (from the checkpoint in ``out_dir`` when ``resume``); returns
    ``out_dir/final`` (LoRA merged). Each step's metrics go to ``out_dir/metrics.jsonl``, ``on_step`` and the
    trackers of ``report_to`` (which also get ``run_config``)."""
    loop = _Loop(parts, settings, rollout, out_dir, seed=seed)
    start = loop.resume() if resume else 0
    parts.model.eval()
    try:
        with loop.outputs(report_to, run_config, resumed_at=start if resume else None, on_step=on_step):
            calls = lambda: getattr(parts.sampler, "batches", 0)  # noqa: E731 - a sampler may not count its calls
            loop.feed = RolloutFeed(loop.rollouts, start=start, steps=settings.steps,
                                    max_staleness=settings.max_staleness, calls=calls)
            try:
                for step in range(start, settings.steps):
                    waited = time.perf_counter()
                    made = loop.feed.next()
                    loop.step(step, made, waited_s=time.perf_counter() - waited)
            finally:
                loop.feed.close()
    finally:
        for runner in {id(r): r for r in parts.runners}.values():
            runner.close()
    return save_final(parts.model, parts.tokenizer, parts.processor, out_dir / "final", lora=bool(settings.lora),
                      accelerator=parts.accelerator)


class _Loop:
    """The loop's state across steps: the episodes each step planned, the curriculum stage they came from, and
    where the main process writes."""

    def __init__(self, parts: RLComponents, settings: RLSettings, rollout: RolloutSettings, out_dir: Path, *,
                 seed: int) -> None:
        self.parts, self.settings, self.rollout, self.out_dir, self.seed = parts, settings, rollout, out_dir, seed
        out_dir.mkdir(parents=True, exist_ok=True)
        self.rewards = RewardSet(settings.rewards)  # built once: a judge keeps its cache and connections
        self.replay = (DemonstrationReplay(parts.demonstrations, self.rewards, settings, seed)
                       if settings.replay_demonstrations else None)
        self.correct = settings.importance_sampling == "on" or (settings.importance_sampling == "auto"
                                                                and parts.off_policy)
        self.plans: dict[int, list[list[Episode]]] = {}
        self.stage_of: dict[int, int] = {}  # the curriculum stage each step's tasks came from
        self.feed: RolloutFeed | None = None
        self.log: Callable[[dict[str, float]], None] = lambda record: None
        self.store: TrajectoryStore | None = None
        self.promotions: MetricsLog | None = None
        self.warned_rate_zero = False

    def resume(self) -> int:
        """Load the checkpoint (weights, optimizer, curriculum); the steps it holds."""
        start, state = load_checkpoint(self.parts.accelerator, self.out_dir, self._sharded())
        if start:  # the sampler started from the model directory, not the checkpoint
            publish(self.parts.sampler, self.parts.behaviour, self.parts.model)
        if self.parts.curriculum.staged and "curriculum" in state:
            self.parts.curriculum.restore(state["curriculum"])
        return start

    @contextmanager
    def outputs(self, report_to: Sequence[str], run_config: dict[str, Any], resumed_at: int | None,
                on_step: Callable[[dict[str, float]], None] | None) -> Iterator[None]:
        """Open what the main process writes for the run: metrics (file, trackers, ``on_step``), rollouts and a
        curriculum's promotions."""
        main = self.parts.accelerator.is_main_process
        with (Trackers(report_to, self.out_dir.parent, self.out_dir.name, enabled=main, config=run_config)
              as trackers, TrajectoryStore(self.out_dir / ROLLOUTS_FILE) if main else nullcontext() as store):
            metrics = MetricsLog(self.out_dir / "metrics.jsonl", resumed_at) if main else None
            if main and self.parts.curriculum.staged:
                self.promotions = MetricsLog(self.out_dir / CURRICULUM_FILE, resumed_at)

            def log(record: dict[str, float]) -> None:
                if metrics is not None:
                    metrics.write(record)
                    trackers.log(record, step=int(record["step"]))
                    if on_step:
                        on_step(record)

            self.log, self.store = log, store
            yield

    async def rollouts(self, step: int) -> list[Trajectory]:
        """This process's share of the step's tasks, ``group_size`` rollouts each (on the feed's thread)."""
        self.stage_of[step], step_tasks = self.parts.curriculum.draw(step, self.settings.tasks_per_step)
        self.plans[step] = [group_episodes(step, i, task, self.settings.group_size,
                                           greedy=self.settings.greedy_rollout)
                            for i, task in enumerate(step_tasks)]
        accelerator = self.parts.accelerator
        if self.parts.rollouts_on_main:
            mine = range(len(step_tasks) if accelerator.is_main_process else 0)
        else:
            mine = range(accelerator.process_index, len(step_tasks), accelerator.num_processes)
        runner = self.parts.runners[self.stage_of[step]]
        return await runner.run([e for i in mine for e in self.plans[step][i]], concurrency=self.rollout.concurrency,
                                retries=self.rollout.retries, retry_backoff_s=self.rollout.retry_backoff_s)

    def heldout(self, stage: int) -> float:
        """The stage's held-out success, greedy; measured by the main process and shared with the others."""
        parts, curriculum, value = self.parts, self.parts.curriculum, None
        if parts.accelerator.is_main_process:
            with self.feed.sampler_lock, parts.greedy_runner(stage) as judge:
                value = asyncio.run(heldout_success(
                    judge, curriculum.heldout_tasks(stage), curriculum.stages[stage].heldout_split,
                    f"curriculum:{curriculum.stages[stage].name}:{curriculum.steps}",
                    concurrency=self.rollout.concurrency, retries=self.rollout.retries,
                    retry_backoff_s=self.rollout.retry_backoff_s))
        return broadcast_object_list([value])[0] if parts.accelerator.num_processes > 1 else value

    def step(self, step: int, made: StepRollouts, *, waited_s: float) -> None:
        """Train on one step's rollouts (``waited_s``: how long the trainer waited for them), log its metrics and
        promotion, and checkpoint when it is time."""
        parts, settings = self.parts, self.settings
        trajectories = gather_object(made.trajectories) if parts.accelerator.num_processes > 1 else made.trajectories
        order = {e.id: i for i, e in enumerate(itertools.chain(*self.plans.pop(step)))}  # not finishing order
        trajectories.sort(key=lambda t: order[t.id])
        staleness = [step - int(t.metrics["policy_version"]) for t in trajectories]

        # --- rewards and advantages, group by group ---
        # a reward function that fails marks its trajectory error: masked below like any broken episode
        scores = self.score(trajectories)
        rewards = scores.totals
        token_advantages, group_stats = step_advantages(trajectories, rewards, settings, turn_rewards=scores.turns)

        # --- the drift guard: train only on tokens that are the template's rendering of their messages ---
        started = time.perf_counter()
        clean, drifts = check_token_drift(trajectories, parts.tokenizer, parts.chat_template, parts.parser,
                                          max_drift=settings.max_drift, processor=parts.processor)
        drift_check_s = time.perf_counter() - started
        clean_ids = {id(t) for t in clean}
        # an episode the machinery broke (status error) is no sample of the policy: never trained on; one sampled
        # by weights more than max_staleness steps old is dropped
        kept = [i for i, t in enumerate(trajectories)
                if id(t) in clean_ids and t.status != "error" and staleness[i] <= settings.max_staleness]

        # --- the update; the sampler gets the new weights ---
        parts.model.train()
        started, learning_rate = time.perf_counter(), parts.update.scheduler.get_last_lr()[0]
        # synchronous: the sampler is idle during the update, so it may free its memory and take the weights;
        # asynchronous: it keeps rolling out the next steps and takes the weights between two of them
        samples, advantages, owners = [], [], []  # an episode kept one sample per turn trains as those samples
        for i in kept:
            for sample, advantage in zip(turn_samples(trajectories[i]),
                                         split_advantages(trajectories[i], token_advantages[i]), strict=True):
                samples.append(sample)
                advantages.append(advantage)
                owners.append(i)
        replayed: dict[str, float] = {}
        if self.replay is not None:  # logged demonstrations beside the rollouts, "old" logprobs the model's own now
            demonstrations, demonstration_advantages = self.replay.draw(step)
            samples += without_sampler_logprobs(demonstrations)
            advantages += demonstration_advantages
            replayed = self.replay.metrics(demonstration_advantages)
        rate_scale = self._rate_scale(step, [trajectories[i] for i in kept], [token_advantages[i] for i in kept])
        with synced_sampler(parts.sampler, parts.model) if not settings.max_staleness else nullcontext():
            update, trainer_logprobs = parts.update(samples, advantages, correct=self.correct,
                                                    shuffle_seed=self.seed * 1_000_003 + step, rate_scale=rate_scale)
        ended = time.perf_counter()
        parts.model.eval()
        overlap_s = self.feed.timeline.overlap(started, ended, now=ended)
        # the stage's rule, before the next step's rollouts may start: a promotion is in effect for them
        stage_metrics, promotion = parts.curriculum.observe(step, self.stage_of.pop(step), trajectories, self.heldout)
        # rollout workers: how many died and were replaced up to now, read before the next step's rollouts may kill one
        replaced = {"workers_replaced": parts.sampler.replaced} if hasattr(parts.sampler, "replaced") else {}
        self.feed.trained(step + 1, lambda: publish(parts.sampler, parts.behaviour, parts.model)
                          if settings.max_staleness else None)  # synchronous: published on leaving synced_sampler

        if self.store is not None:
            record_rollouts(self.store, step, trajectories, rewards, token_advantages, set(kept),
                            {owners[j]: lps for j, lps in trainer_logprobs.items()
                             if j < len(owners) and trajectories[owners[j]].branches is None})
        record = step_metrics(step, trajectories, rewards, made.ended - made.began, ended - started)
        record |= group_stats | update | replayed | staleness_metrics(staleness, settings.max_staleness)
        record |= {"generate_calls": made.generate_calls, "drift/trajectories": len(drifts),
                   "drift_check_s": drift_check_s, "lr": learning_rate * rate_scale,
                   "processes": parts.accelerator.num_processes, "rollout_wait_s": waited_s, "overlap_s": overlap_s}
        self.log(namespaced(record | replaced | (stage_metrics if parts.curriculum.staged else {})))
        self._after(step, promotion)

    def _rate_scale(self, step: int, trained: list[Trajectory], advantages: list[list[float]]) -> float:
        """The step's rate multiplier: its failed share under ``rl.rate_by_failures``, else 1. Warns once when that
        is 0 while the rollouts' advantages are not: every rollout succeeded, yet their rewards differ within a
        group, so the env's success (or a reward function scoring what it does not) leaves something to learn that
        this setting throws away."""
        if not self.settings.rate_by_failures:
            return 1.0
        scale = failed_share(trained)
        if scale == 0 and not self.warned_rate_zero and any(map(any, advantages)):
            self.warned_rate_zero = True
            logger.warning("rl step %d: every rollout succeeded, so rl.rate_by_failures trains it at rate 0, yet "
                           "rewards differ within its groups: success does not mean nothing is left to learn here. "
                           "Set rl.rate_by_failures: false to train on those differences.", step + 1)
        return scale

    def score(self, trajectories: list[Trajectory]) -> Scores:
        """The step's rewards. With several processes (each holding every trajectory) the main one calls the
        reward functions, once per trajectory, and the others take its scores and what they wrote on the
        trajectories (status, error, metrics): a judge is asked once, not once per process."""
        accelerator = self.parts.accelerator
        if accelerator.num_processes == 1:
            return self.rewards.score(trajectories)
        payload = None
        if accelerator.is_main_process:
            scores = self.rewards.score(trajectories)
            payload = (scores, [(t.status, t.error, t.metrics) for t in trajectories])
        scores, records = broadcast_object_list([payload])[0]
        for trajectory, (status, error, metrics) in zip(trajectories, records, strict=True):
            trajectory.status, trajectory.error, trajectory.metrics = status, error, metrics
        return scores

    def _after(self, step: int, promotion: Promotion | None) -> None:
        """A promotion's line, and a checkpoint every ``save_steps`` and at the end (after the step's metrics: a run
        resumed from it logs no step twice)."""
        curriculum = self.parts.curriculum
        if promotion is not None and self.promotions is not None:
            line = promotion.record(curriculum.stages)
            logger.info("curriculum: after step %d, stage %s -> %s (%s %.3f)", line["step"], line["from"],
                        line["to"], line["rule"], line["value"])
            self.promotions.write(line)
        if (step + 1) % self.settings.save_steps == 0 or step + 1 == self.settings.steps:
            save_checkpoint(self.parts.accelerator, self.out_dir, step + 1,
                            {"curriculum": curriculum.state()} if curriculum.staged else {}, self._sharded())

    def _sharded(self) -> tuple[torch.nn.Module, torch.optim.Optimizer] | None:
        """A sharded policy with its optimizer (their slices are checkpointed by each process); else None."""
        update = self.parts.update
        return (update.policy, update.optimizer) if is_sharded(update.policy) else None


def group_episodes(step: int, index: int, task: dict[str, Any], group_size: int, *,
                   greedy: bool = False) -> list[Episode]:
    """The ``group_size`` rollouts of the step's ``index``-th task, compared with each other for advantages; with
    ``greedy``, the first decodes greedily (``rl.greedy_rollout``).

    The group is the task's place in the step, not its id: two envs of a mixture (or a short task cycle) may repeat
    a task id within one step, and each stays its own group.
    """
    group = f"rl:{step}:{index}"
    return [Episode(f"{group}:{task_id(task)}:{g}", task, split="train", group=group, greedy=greedy and g == 0)
            for g in range(group_size)]
