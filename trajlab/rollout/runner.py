"""Running many episodes at once: the part every runner shares (the in-process engines of
:mod:`trajlab.rollout.engine`, Ray rollout workers), whatever runs one episode.

An episode is serialisable in (:class:`Episode`) and out (a Trajectory), so where it runs does not change what it is.
What the machinery does wrong ends an episode with status ``error``; such episodes are run again (``retries``) and
are never scored as the policy's failures.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Self

from trajlab.rollout.types import Trajectory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Episode:
    """A unit of rollout work: serialisable in (id + task), a Trajectory out."""

    id: str
    task: dict[str, Any]
    split: str | None = None
    group: str | None = None
    """Copied into ``Trajectory.group``: episodes compared with each other for advantages (RL: one task's samples)."""
    greedy: bool = False
    """Decode every turn greedily, whatever the runner's temperature (RL's ``greedy_rollout``); recorded as
    ``metrics["greedy"]``."""


class EpisodeRunner:
    """Runs many episodes at once on one event loop; subclasses say how one episode runs.

    A runner holds threads for env code: close it when done (``with engine:`` or :meth:`close`).
    """

    async def run_episode(self, episode: Episode) -> Trajectory:
        raise NotImplementedError

    async def run(
        self,
        episodes: Iterable[Episode],
        *,
        concurrency: int,
        retries: int,
        retry_backoff_s: float,
        on_result: Callable[[Trajectory], Awaitable[None] | None] | None = None,
    ) -> list[Trajectory]:
        """Run episodes, at most ``concurrency`` at once; ``on_result`` sees each trajectory as it finishes.

        An episode that ends with status ``error`` (the machinery failed, not the policy) is run again, up to
        ``retries`` times, after ``retry_backoff_s`` seconds, doubling with each retry (a server that went away may
        come back); only its last attempt is returned, with ``metrics["attempts"]`` when there was more than one.
        """
        episodes = list(episodes)
        self._check(episodes)
        gate = asyncio.Semaphore(concurrency)
        results: list[Trajectory] = []

        async def one(episode: Episode) -> None:
            async with gate:
                trajectory = await self.run_episode(episode)
            attempts = 1
            while trajectory.status == "error" and attempts <= retries:
                logger.warning("episode %s: %s; retrying (%d of %d)", episode.id, trajectory.error, attempts, retries)
                await asyncio.sleep(retry_backoff_s * 2 ** (attempts - 1))  # holding no slot: others run meanwhile
                async with gate:
                    trajectory = await self.run_episode(episode)
                attempts += 1
            if attempts > 1:
                trajectory.metrics["attempts"] = float(attempts)
            results.append(trajectory)
            if on_result is not None:
                maybe = on_result(trajectory)
                if maybe is not None:
                    await maybe

        await asyncio.gather(*(one(episode) for episode in episodes))
        return results

    def close(self) -> None:
        """Release the runner's threads; running it again afterwards is an error."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check(self, episodes: list[Episode]) -> None:
        """Refuse episodes this runner cannot run, before any of them starts."""
