"""Run a trajlab env inside TRL's GRPOTrainer: its tasks as dataset rows, its reward as a reward function.

The env class itself needs no adapter (it already follows the ``environment_factory`` contract); what TRL needs
around it is a dataset whose rows are ``reset`` keyword arguments plus a ``prompt``, and a reward function that reads
each episode's env. A mixture of envs maps onto TRL's dict ``environment_factory`` and its ``environment`` column.
"""

from __future__ import annotations

import itertools
from typing import Any

from datasets import Dataset

from trajlab.env.base import EnvHandle
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


def env_reward(environments: list[Any], completions: list[Any] | None = None, **_: Any) -> list[float]:
    """TRL reward function: the reward each episode's env holds when the episode ends.

    An env of several user turns (``next_user_message``, e.g. BFCL) scores a turn when the model answers it; TRL runs
    only the first turn and never says it ended, so a final answer (a last assistant message without tool calls) is
    handed to the env first, as trajlab's engine would.
    """
    rewards = []
    for index, instance in enumerate(environments):
        env = EnvHandle(instance)
        answer = _final_answer(completions[index]) if completions is not None else None
        if answer is not None and not env.done:
            env.next_user_message(answer)
        rewards.append(env.reward)
    return rewards


def _final_answer(completion: Any) -> str | None:
    """The text of a conversational completion's last message, if it is an assistant answer (no tool call)."""
    if isinstance(completion, str):
        return completion
    last = completion[-1] if completion else None
    if not isinstance(last, dict) or last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    content = last.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content or "")
