"""Running a collection's missing episodes into its trajectory file.

The store holds what earlier runs finished; only the planned episodes it lacks run, so the same command after a
crash (even ``kill -9``) ends with exactly the planned episodes. Episodes stored with status ``error`` (the machinery
failed) run again: their records move to ``FILE.errors.jsonl``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from trajlab.collection.demonstrators import Demonstrator
from trajlab.config import RolloutSettings
from trajlab.data.store import StoreError, TrajectoryStore
from trajlab.rollout.runner import Episode, EpisodeRunner
from trajlab.rollout.types import Trajectory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOutcome:
    """What one run of a collection did: the trajectories it rolled out (in the order they finished), how many
    episodes that had ended in ``error`` it ran again, and how long the rollouts took."""

    new: list[Trajectory]
    errors_run_again: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        """Model tokens generated per second of this run (0 when nothing ran)."""
        tokens = sum(t.metrics.get("model_tokens", 0.0) for t in self.new)
        return tokens / self.elapsed_s if self.new and self.elapsed_s else 0.0


def run_missing(runner: EpisodeRunner, episodes: Sequence[Episode], out: Path, *, rollout: RolloutSettings,
                demonstrator: Demonstrator | None, on_progress: Callable[[int, int], None] | None) -> RunOutcome:
    """Run the ``episodes`` that ``out`` does not hold yet (and those that ended in error) with ``runner``, at the
    rollout settings' concurrency and retries, appending each as it finishes; ``on_progress(done, total)`` counts
    the ones on disk too.

    Raises:
        StoreError: the store refused a write (a full disk); what was stored before is whole.
    """
    with runner, TrajectoryStore(out) as store:
        failed = {episode.id for episode in episodes} & store.errors
        if failed:  # the machinery broke them last time (a server away, a bug since fixed): run them again
            kept_in = errors_file(out)
            store.remove(failed, keep_in=kept_in)
            logger.info("running again %d episodes that ended in error (their records are kept in %s)",
                        len(failed), kept_in)
        todo = [episode for episode in episodes if episode.id not in store.ids]
        done = len(episodes) - len(todo)
        if on_progress:
            on_progress(done, len(episodes))
        refused = False  # the store refused a write (disk full): raised once, later results are not stored

        def save(trajectory: Trajectory) -> None:
            nonlocal done, refused
            if refused:
                return  # not stored: the same command runs it again once there is room
            if demonstrator is not None:
                demonstrator.record_noise(trajectory)
            try:
                store.append(trajectory)
            except StoreError:
                refused = True
                raise
            done += 1
            if on_progress:
                on_progress(done, len(episodes))

        started = time.perf_counter()
        new = asyncio.run(runner.run(todo, concurrency=rollout.concurrency, on_result=save, retries=rollout.retries,
                                     retry_backoff_s=rollout.retry_backoff_s))
        return RunOutcome(new, len(failed), time.perf_counter() - started)


def errors_file(out: Path) -> Path:
    """Where a collection keeps the records of episodes that ended in ``error`` and were run again (one line per
    failed attempt, so an episode may appear once per run it failed in)."""
    return out.with_name(out.stem + ".errors.jsonl")
