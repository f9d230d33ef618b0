"""A test-only env for the vLLM lane: its reward is random noise.

Every RL group then has rewards that differ, so each step takes a real optimizer step on the tiny untrained model
(whose rewards on the built-in envs are all 0, which gives no gradient). It measures nothing about learning: it
only makes the update happen, so the tests can check that the new weights reach the vLLM engine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from trajlab.env.base import Environment
from trajlab.env.registry import EnvSpec


class NoisyReward(Environment):
    """Say anything; the reward is random (test only)."""

    def reset(self, **task: Any) -> str:
        super().reset()
        self.reward = random.random()
        return f"Tell me about {task['topic']}."

    def note(self, text: str) -> str:
        """Write a note down.

        Args:
            text: the note
        """
        return "Noted."


def tasks(split: str, seed: int = 0) -> Iterator[dict[str, Any]]:
    rng = random.Random(f"{split}-{seed}")
    for index in range(1000):
        yield {"task_id": f"{split}-{index}", "topic": rng.choice(["cats", "rain", "maps", "tea"])}


SPEC = EnvSpec(name="noisy", env_cls=NoisyReward, tasks=tasks)
