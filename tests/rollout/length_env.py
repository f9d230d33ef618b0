"""A test-only env whose reward is a fixed function of what the model wrote (test only).

The tiny untrained model scores 0 on every built-in env, so RL groups have no signal and no update happens. Here
the reward is the length of the model's answer modulo 7, scaled to [0, 1]: rollouts of a group differ, so each RL
step takes a real optimizer step, and the same tokens always get the same reward in any process (unlike a random
reward). It measures nothing about learning.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from trajlab.env.base import Environment
from trajlab.env.registry import EnvSpec


class LengthReward(Environment):
    """Say anything; the reward depends on how long the answer is (test only)."""

    def reset(self, **task: Any) -> str:
        super().reset()
        return f"Tell me about {task['topic']}."

    def next_user_message(self, answer: str | None) -> str | None:
        self.reward = len(answer or "") % 7 / 6
        self.done = True
        return None

    def note(self, text: str) -> str:
        """Write a note down.

        Args:
            text: the note
        """
        return "Noted."


def tasks(split: str, seed: int = 0) -> Iterator[dict[str, Any]]:
    for index in range(1000):
        yield {"task_id": f"{split}-{index}", "topic": ["cats", "rain", "maps", "tea"][(index + seed) % 4]}


SPEC = EnvSpec(name="length", env_cls=LengthReward, tasks=tasks, system_prompt="Answer briefly.")


class SlowLengthReward(LengthReward):
    """LengthReward whose verifier takes ``DELAY_S`` of wall time (a latency wrapper, test only): the time a real
    tool or judge would take, during which the trainer can update."""

    DELAY_S = 0.4

    def next_user_message(self, answer: str | None) -> str | None:
        time.sleep(self.DELAY_S)
        return super().next_user_message(answer)


SLOW = EnvSpec(name="slow_length", env_cls=SlowLengthReward, tasks=tasks, system_prompt="Answer briefly.")


class SucceedingLengthReward(LengthReward):
    """LengthReward whose every episode succeeds while its reward still varies (test only): an env whose success does
    not mean that nothing is left to learn."""

    def reset(self, **task: Any) -> str:
        prompt = super().reset(**task)
        self.success = True
        return prompt


SUCCEEDING = EnvSpec(name="succeeding_length", env_cls=SucceedingLengthReward, tasks=tasks,
                     system_prompt="Answer briefly.")
