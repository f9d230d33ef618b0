"""Run a trajlab env inside TRL's GRPOTrainer: its tasks as dataset rows, its reward as a reward function.

The env class itself needs no adapter (it already follows the ``environment_factory`` contract); what TRL needs
around it is a dataset whose rows are ``reset`` keyword arguments plus a ``prompt``, and a reward function that reads
each episode's env.
"""

from __future__ import annotations

import itertools
from typing import Any

from datasets import Dataset

from trajlab.env.registry import EnvSpec


def trl_dataset(spec: EnvSpec, split: str = "train", size: int = 1000, seed: int = 0) -> Dataset:
    """``size`` tasks of a split as rows TRL passes to ``reset(**row)``.

    TRL appends ``reset``'s observation to the last prompt message, so the prompt is the env's system prompt and an
    empty user turn that the observation fills in.
    """
    prompt = [{"role": "system", "content": spec.system_prompt or ""}, {"role": "user", "content": ""}]
    rows = [{**task, "prompt": prompt} for task in itertools.islice(spec.iter_tasks(split, seed), size)]
    if not rows:
        raise ValueError(f"Environment '{spec.name}' has no tasks in split '{split}'.")
    return Dataset.from_list(rows)


def env_reward(environments: list[Any], **_: Any) -> list[float]:
    """TRL reward function: the reward each episode's env holds when the episode ends."""
    return [float(env.reward) for env in environments]
