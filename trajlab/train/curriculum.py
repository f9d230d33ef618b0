"""Curricula: RL in ordered stages, each with its own tasks, difficulty, limits and env mixture, and a rule for
moving on.

Why: a small policy trained on hard tasks alone rarely succeeds, so most groups' rewards are all equal and give no
gradient; on easier tasks first it learns the moves the hard ones are made of. The trainer asks the curriculum for
each step's tasks (from the current stage) and, after the step's update, shows it the step's rollouts; the stage's
promote rule (a step count, the rolling train success over a window, or a held-out success measured every few steps)
then says whether the next step starts the next stage. The state (stage, the step it started, its steps, the window)
is plain data saved with RL checkpoints, so a resumed run goes on in the same stage with the same window.

A run without a curriculum is one stage of the env's train tasks that never ends: the same task stream as ever.

Tasks SFT's demonstrations came from can be left out of every stage's stream (``skip``): the demonstrations are drawn
in the same seeded order, so RL would otherwise start on exactly the tasks SFT was fitted to, where it rarely fails
and its groups carry no gradient.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from trajlab.config import ConfigError, CurriculumSettings, PromoteRule, RolloutSettings
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec
from trajlab.errors import UserError
from trajlab.rollout.runner import Episode, EpisodeRunner
from trajlab.rollout.types import TaskKey, Trajectory, task_id, task_key

FILTER_PROBE = 1000
"""How many of a split's tasks a stage's ``task_filter`` must match one of: a filter that matches nothing is a
mistake (a misspelled field), found before training instead of as a hung task stream."""
HELDOUT_SEED = 0
"""Task order of held-out evaluations: the same tasks in every run, whatever the training seed."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    """A stage, built: its env (at its difficulty), its limit overrides (the rollout's, then its own), its filter and
    its promote rule (None: it runs to the end)."""

    name: str
    env: EnvSpec | EnvMixture
    limits: dict[str, int | float]
    task_filter: dict[str, Any] | None = None
    promote: PromoteRule | None = None

    def tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """The env's tasks of ``split`` that pass the filter."""
        return (task for task in self.env.iter_tasks(split, seed) if matches(task, self.task_filter))

    def key(self, task: dict[str, Any]) -> TaskKey:
        """A task of this stage's env (in a mixture, the env its ``env`` column names) as ``(env, task_id)``."""
        env = self.env.spec_for(task) if isinstance(self.env, EnvMixture) else self.env
        return task_key(env.name, task)

    @property
    def heldout_split(self) -> str:
        return "validation" if "validation" in self.env.splits else "test"


def matches(task: dict[str, Any], task_filter: dict[str, Any] | None) -> bool:
    """Whether every filtered field of ``task`` has the filter's value (or, for a list, one of its items)."""
    return all(task.get(key) == wanted or (isinstance(wanted, list) and task.get(key) in wanted)
               for key, wanted in (task_filter or {}).items())


def build_stages(settings: CurriculumSettings, run_env: EnvSpec | EnvMixture, rollout: RolloutSettings) -> list[Stage]:
    """The configured stages with their envs loaded, knobs set and filters checked.

    Raises:
        ConfigError: a stage's env or knob is bad, or its filter matches none of its first train (or, for a
            held-out rule, test) tasks.
    """
    stages = []
    for stage in settings.stages:
        built = Stage(stage.name, stage.env_spec(run_env), rollout.limit_overrides() | stage.limit_overrides(),
                      stage.task_filter, stage.promote)
        splits = ["train"] + ([built.heldout_split] if stage.promote and stage.promote.metric == "heldout_success"
                              else [])
        for split in splits:
            probe = list(itertools.islice(built.env.iter_tasks(split, 0), FILTER_PROBE))
            if not any(matches(task, built.task_filter) for task in probe):
                fields = sorted({key for task in probe for key in task})
                raise ConfigError(f"curriculum stage '{stage.name}': no {split} task of {built.env.name} among the "
                                  f"first {len(probe)} matches task_filter {built.task_filter} (task fields: "
                                  f"{', '.join(fields)}).")
        stages.append(built)
    return stages


@dataclass(frozen=True)
class Promotion:
    """A stage handing over to the next, after ``step`` steps: what ``curriculum.jsonl`` records."""

    step: int
    source: int
    target: int
    rule: str
    value: float

    def record(self, stages: Sequence[Stage]) -> dict[str, Any]:
        return {"step": self.step, "from": stages[self.source].name, "to": stages[self.target].name,
                "from_index": self.source, "to_index": self.target, "rule": self.rule, "value": self.value}


class Curriculum:
    """Which stage RL draws its tasks from, and when it moves on.

    ``draw`` runs where rollouts are made (the rollout thread), ``observe`` where they are trained on; the stage
    changes only between two steps' draws. Under asynchronous RL a promotion takes effect at the first step not yet
    drawn, and steps drawn from the stage before count for no rule.

    Args:
        stages: in order; all but the last have a promote rule.
        seed: the train tasks' order.
        staged: a configured curriculum (its stage is logged and checkpointed), not a plain run's single stage.
        skip: ``(env, task_id)`` keys of train tasks no stage draws, such as those SFT's demonstrations came from; a
            stage with no other task draws all of its own (with a warning).
    """

    def __init__(self, stages: Sequence[Stage], *, seed: int, staged: bool = True,
                 skip: Collection[TaskKey] = frozenset()) -> None:
        self.stages = list(stages)
        self.seed = seed
        self.staged = staged
        self.skip = frozenset(skip)
        self.index = 0
        self.first_step: int | None = 0  # the first step drawn from the current stage (None: none drawn yet)
        self.steps = 0  # steps of the current stage trained
        self.window: list[tuple[int, int]] = []  # (successes, episodes) of its last steps, for train_success
        self._stream: Iterator[dict[str, Any]] | None = None
        self._lock = threading.Lock()

    @classmethod
    def single(cls, env: EnvSpec | EnvMixture, limits: dict[str, int | float], *, seed: int,
               skip: Collection[TaskKey] = frozenset()) -> Curriculum:
        """A plain run: the env's train tasks (but ``skip``), cycled, for the whole run."""
        return cls([Stage(env.name, env, limits)], seed=seed, staged=False, skip=skip)

    def draw(self, step: int, count: int) -> tuple[int, list[dict[str, Any]]]:
        """The stage and ``count`` train tasks of ``step``: the stage's tasks in a fixed order (cycled), after those
        its earlier steps drew."""
        with self._lock:
            if self._stream is None:
                if self.first_step is None:
                    self.first_step = step
                stream = itertools.cycle(self._train_tasks(self.stages[self.index]))
                self._stream = itertools.islice(stream, (step - self.first_step) * count, None)
            return self.index, [next(self._stream) for _ in range(count)]

    def _train_tasks(self, stage: Stage) -> Iterator[dict[str, Any]]:
        """The stage's train tasks but the skipped ones; all of them when every one is skipped."""
        if not self.skip:
            return stage.tasks("train", self.seed)
        fresh = (task for task in stage.tasks("train", self.seed) if stage.key(task) not in self.skip)
        first = next(fresh, None)
        if first is None:
            logger.warning("curriculum stage '%s': every train task is among the %d skipped (SFT's demonstrations): "
                           "RL draws them all again", stage.name, len(self.skip))
            return stage.tasks("train", self.seed)
        return itertools.chain([first], fresh)

    def observe(self, step: int, stage: int, trajectories: Sequence[Trajectory],
                heldout: Callable[[int], float]) -> tuple[dict[str, float], Promotion | None]:
        """Step ``step``'s rollouts, drawn from ``stage``, are trained on: the step's metrics (``curriculum/...``)
        and the promotion its rule calls for, if any (already in effect for the next draw). ``heldout(stage)``
        measures a stage's held-out success with the weights just trained."""
        metrics = {"curriculum/stage": float(stage)}
        rule = self.stages[stage].promote
        if stage != self.index or rule is None:
            return metrics, None
        self.steps += 1
        if rule.steps is not None:
            name, value, ready = "steps", float(self.steps), self.steps >= rule.steps
        elif rule.metric == "train_success":
            valid = [t for t in trajectories if t.status != "error"]
            self.window = [*self.window, (sum(t.status == "success" for t in valid), len(valid))][-rule.window:]
            name, value = rule.metric, sum(s for s, _ in self.window) / max(1, sum(n for _, n in self.window))
            metrics["curriculum/train_success"] = value
            ready = len(self.window) == rule.window and value >= rule.threshold
        else:
            if self.steps % rule.every:
                return metrics, None
            name, value = "heldout_success", heldout(stage)
            metrics["curriculum/heldout_success"] = value
            ready = value >= rule.threshold
        if not ready:
            return metrics, None
        with self._lock:
            self.index, self.first_step, self.steps, self.window, self._stream = stage + 1, None, 0, [], None
        return metrics, Promotion(step + 1, stage, stage + 1, name, value)

    def heldout_tasks(self, stage: int) -> list[dict[str, Any]]:
        """The tasks a stage's held-out success is measured on: the first of its held-out split (seed 0)."""
        chosen = self.stages[stage]
        assert chosen.promote is not None and chosen.promote.metric == "heldout_success"
        return list(itertools.islice(chosen.tasks(chosen.heldout_split, HELDOUT_SEED), chosen.promote.tasks))

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the stage and its progress (the task stream is recomputed from its first step)."""
        return {"stages": [stage.name for stage in self.stages], "stage": self.index, "first_step": self.first_step,
                "steps": self.steps, "window": [list(pair) for pair in self.window]}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state`.

        Raises:
            UserError: the checkpoint's curriculum had other stages.
        """
        names = [stage.name for stage in self.stages]
        if state["stages"] != names:
            raise UserError(f"the RL checkpoint was made with curriculum stages {state['stages']}, not {names}: "
                            "resume with the same curriculum, or start in a new directory.")
        self.index, self.first_step, self.steps = state["stage"], state["first_step"], state["steps"]
        self.window = [(int(s), int(n)) for s, n in state["window"]]
        self._stream = None


async def heldout_success(engine: EpisodeRunner, tasks: Sequence[dict[str, Any]], split: str, label: str, *,
                          concurrency: int, retries: int, retry_backoff_s: float) -> float:
    """The share of ``tasks`` that ``engine`` (greedy, at the stage's limits) solves; episodes the machinery broke
    (status error) are left out, as in evaluation."""
    episodes = [Episode(f"{label}:{i}:{task_id(task)}", task, split=split) for i, task in enumerate(tasks)]
    trajectories = await engine.run(episodes, concurrency=concurrency, retries=retries,
                                    retry_backoff_s=retry_backoff_s)
    valid = [t for t in trajectories if t.status != "error"]
    return sum(t.status == "success" for t in valid) / max(1, len(valid))
