"""Run a trajlab env inside TRL's GRPOTrainer: its tasks as dataset rows, its reward as a reward function.

The env class itself needs no adapter (it already follows the ``environment_factory`` contract); what TRL needs
around it is a dataset whose rows are ``reset`` keyword arguments plus a ``prompt``, and a reward function that reads
each episode's env. A mixture of envs maps onto TRL's dict ``environment_factory`` and its ``environment`` column.
"""

from __future__ import annotations

import itertools
from typing import Any

from datasets import Dataset

from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec


def trl_dataset(env: EnvSpec | EnvMixture, split: str = "train", size: int = 1000, seed: int = 0) -> Dataset:
    """``size`` tasks of a split as rows TRL passes to ``reset(**row)``.

    TRL appends ``reset``'s observation to the last prompt message, so the prompt is the env's system prompt and an
    empty user turn that the observation fills in. Rows of a mixture also carry TRL's ``environment`` column, which
    routes each row to its env in :func:`trl_environment_factory`'s dict.
    """
    rows = []
    for task in itertools.islice(env.iter_tasks(split, seed), size):
        spec = env.spec_for(task) if isinstance(env, EnvMixture) else env
        prompt = [{"role": "system", "content": spec.system_prompt or ""}, {"role": "user", "content": ""}]
        routing = {"environment": spec.name} if isinstance(env, EnvMixture) else {}
        rows.append({**task, **routing, "prompt": prompt})
    if not rows:
        raise ValueError(f"Environment '{env.name}' has no tasks in split '{split}'.")
    # Envs of a mixture have different task fields: every row gets every column (None where its env has none).
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return Dataset.from_dict({key: [row.get(key) for row in rows] for key in columns})


def trl_environment_factory(env: EnvSpec | EnvMixture) -> type | dict[str, type]:
    """GRPOTrainer's ``environment_factory``: the env class, or for a mixture a dict of classes by env name."""
    if isinstance(env, EnvMixture):
        return {name: spec.env_cls for name, spec in env.specs.items()}
    return env.env_cls


def env_reward(environments: list[Any], **_: Any) -> list[float]:
    """TRL reward function: the reward each episode's env holds when the episode ends."""
    return [float(env.reward) for env in environments]
