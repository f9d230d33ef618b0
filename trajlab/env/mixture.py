"""Several envs trained and evaluated as one: tasks carry an ``env`` column naming the env that runs them.

A mixture looks like an :class:`~trajlab.env.registry.EnvSpec` to the recipes (a name, a task stream, a reference
policy), so ``collect``, ``eval``, ``rl`` and ``run`` take ``--env wordle,driving`` (or ``env: [wordle, driving]`` in a
config) without a code path of their own. The rollout side routes each episode to its env's engine; trajectories keep
their own env's name, and reports break every metric down per env.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from trajlab.env.registry import EnvSpec, load_env

ENV_COLUMN = "env"
"""The task field naming the env of a task in a mixed dataset (TRL's dict ``environment_factory`` calls it
``environment``; :func:`trajlab.env.trl.trl_dataset` writes both)."""


@dataclass(frozen=True)
class EnvMixture:
    """Envs sharing one task stream, one policy and one training run; tasks are routed by their ``env`` column."""

    specs: dict[str, EnvSpec]
    weights: dict[str, float] | None = None
    """Each env's share of the task stream, relative to the others' (None: equal shares)."""

    def __post_init__(self) -> None:
        if len(self.specs) < 2:
            raise ValueError("A mixture needs at least two envs; pass a single env name for one.")
        if self.weights is not None and (set(self.weights) != set(self.specs)
                                         or any(w <= 0 for w in self.weights.values())):
            raise ValueError(f"A mixture's weights give each of its envs ({self.name}) a positive share, got "
                             f"{self.weights}.")

    @property
    def name(self) -> str:
        return ",".join(self.specs)

    @property
    def splits(self) -> tuple[str, ...]:
        """Splits every env of the mixture has."""
        first, *rest = self.specs.values()
        return tuple(s for s in first.splits if all(s in spec.splits for spec in rest))

    @property
    def system_prompt(self) -> None:
        return None  # each env keeps its own

    @property
    def shows_images(self) -> bool:
        return any(spec.shows_images for spec in self.specs.values())

    @property
    def oracle(self) -> Any:
        """A reference policy routing each task to its env's, or None unless every env has one."""
        if any(spec.oracle is None for spec in self.specs.values()):
            return None
        return lambda task, messages: self.spec_for(task).oracle(task, messages)

    def spec_for(self, task: dict[str, Any]) -> EnvSpec:
        """The env of a task, from its ``env`` column.

        Raises:
            ValueError: the task has no ``env`` column or names an env outside the mixture.
        """
        name = task.get(ENV_COLUMN)
        if name is None:
            raise ValueError(f"Task {task.get('task_id', task)!r} has no '{ENV_COLUMN}' field; in a mixture of "
                             f"{self.name} every task names its env.")
        if name not in self.specs:
            raise ValueError(f"Task {task.get('task_id', '')!r} names env {name!r}, which is not in the mixture "
                             f"({self.name}).")
        return self.specs[name]

    def with_options(self, **knobs: int) -> EnvMixture:
        """The mixture with each knob set on the envs that have it (see :meth:`EnvSpec.with_options`).

        Raises:
            ValueError: a knob no env of the mixture has (the message lists theirs), or a bad value.
        """
        known = {knob.name for spec in self.specs.values() for knob in spec.knobs}
        unknown = sorted(set(knobs) - known)
        if unknown:
            raise ValueError(f"No env of the mixture {self.name} has the difficulty knob(s) {unknown}; their knobs: "
                             f"{', '.join(sorted(known)) or 'none'}.")
        return replace(self, specs={name: spec.with_options(**{k: v for k, v in knobs.items()
                                                                 if k in {knob.name for knob in spec.knobs}})
                                    for name, spec in self.specs.items()})

    def iter_tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """The envs' tasks of a split, interleaved in turn by their weights (equal weights: one per env in turn; an
        env that runs out drops out).

        Each round credits every env its weight over the largest one, and an env yields a task for each whole unit
        of credit it holds, in the mixture's order: weights 2 and 1 give a, a, b, a, a, b, ...
        """
        missing = [name for name, spec in self.specs.items() if split not in spec.splits]
        if missing:
            raise ValueError(f"Split '{split}' is missing from {missing}; the mixture has splits {list(self.splits)}.")
        streams = {name: spec.iter_tasks(split, seed) for name, spec in self.specs.items()}
        shares = _shares(self.weights or dict.fromkeys(self.specs, 1.0))
        credit = dict.fromkeys(self.specs, 0.0)
        while streams:
            for name, stream in list(streams.items()):
                credit[name] += shares[name]
                while credit[name] >= 1 - 1e-9 and name in streams:
                    credit[name] -= 1
                    task = next(stream, None)
                    if task is None:
                        del streams[name]
                    else:
                        yield {**task, ENV_COLUMN: name}


def _shares(weights: Mapping[str, float]) -> dict[str, float]:
    """Weights over the largest: the heaviest env gets one task per round."""
    top = max(weights.values())
    return {name: weight / top for name, weight in weights.items()}


def load_envs(names: str | Sequence[str]) -> EnvSpec | EnvMixture:
    """One env, or a mixture for several names (a list, or one string with commas: ``"wordle,driving"``).

    Raises:
        ValueError: an unknown name (see :func:`load_env`), or a name given twice.
    """
    if isinstance(names, str):
        names = [name.strip() for name in names.split(",") if name.strip()]
    if not names:
        raise ValueError("No environment given.")
    if len(names) == 1:
        return load_env(names[0])
    repeated = sorted({name for name in names if list(names).count(name) > 1})
    if repeated:
        raise ValueError(f"Environment(s) {repeated} listed more than once in the mixture {','.join(names)}.")
    return EnvMixture({name: _named(load_env(name), name) for name in names})


def _named(spec: EnvSpec, name: str) -> EnvSpec:
    """The spec under the name the mixture routes by (an import path keeps its path as name)."""
    return spec if spec.name == name else replace(spec, name=name)
