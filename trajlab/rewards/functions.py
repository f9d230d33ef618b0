"""Rewards as named, weighted functions: the built-in components and the user's own, by import path.

A config's ``rewards`` maps a name to a weight (a built-in component of :mod:`trajlab.rollout.rewards`) or to a
:class:`RewardFunction` (``{function: "my_pkg.rewards:brevity", weight: 0.2, args: {...}, level: turn}``). Every
function is called as ``fn(trajectory, task, **args)`` (a class is built once with ``args`` and its instances
called as ``fn(trajectory, task)``), may be ``async``, and returns a float (``level: trajectory``) or one float per
model turn (``level: turn``, which feeds ``credit: turn``). Each value is logged as ``reward/<name>``; weight 0 logs
without training on it. A batch's calls run concurrently (sync functions in threads), so a slow judge costs one
round trip per batch, not one per trajectory. A function that raises, or returns something else, marks its
trajectory ``error`` with the reason, and training skips it (an infrastructure failure, not the policy's).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

from trajlab.errors import UserError
from trajlab.rollout.rewards import REWARDS, check_weights
from trajlab.rollout.types import Trajectory

T = TypeVar("T")


class RewardFunction(BaseModel):
    """A reward function of the config, by import path; checked (importable, callable, ``args`` accepted) when the
    config loads."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    function: str
    """Import path ``package.module:name`` of a function ``fn(trajectory, task, **args) -> float`` (may be async),
    or of a class built as ``Class(**args)`` whose instances are such functions (``trajlab.rewards.judge:LLMJudge``)."""
    weight: float = 1.0
    """Weight in the trained reward; 0 logs ``reward/<name>`` without training on it."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments: of each call for a function, of the constructor for a class."""
    level: Literal["trajectory", "turn"] = "trajectory"
    """trajectory: one float per trajectory; turn: one float per model turn (with ``credit: turn`` each is credited
    to its turn; the logged ``reward/<name>`` is their sum)."""

    @model_validator(mode="after")
    def _loadable(self) -> RewardFunction:
        target = load_target(self.function)
        try:
            if inspect.isclass(target):
                inspect.signature(target).bind(**self.args)
            else:
                inspect.signature(target).bind(None, None, **self.args)
        except TypeError as exc:
            raise ValueError(f"{self.function} cannot take args {sorted(self.args)}: {exc}; a reward function is "
                             "called as fn(trajectory, task, **args), a class built as Class(**args)") from exc
        except ValueError:  # a builtin without a signature: nothing to check
            pass
        return self

    def build(self) -> Callable[..., Any]:
        """The callable to score with: the function with its ``args``, or the class built with them."""
        target = load_target(self.function)
        if inspect.isclass(target):
            return target(**self.args)
        return functools.partial(target, **self.args)


def load_target(path: str) -> Callable[..., Any]:
    """``package.module:name`` to the object, which must be callable.

    Raises:
        ValueError: not ``module:name``, not importable, no such name, or not callable.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"a reward function is an import path 'my_pkg.rewards:score'; got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's path or module, said as such
        raise ValueError(f"cannot import {module_name!r} for reward function {path!r}: {type(exc).__name__}: {exc}; "
                         "is the package installed, or its directory on PYTHONPATH?") from exc
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{module_name!r} has no {attr!r} (reward function {path!r})")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"reward function {path!r} is a {type(target).__name__}, not a function or class")
    return target


def _checked(rewards: dict[str, float | RewardFunction]) -> dict[str, float | RewardFunction]:
    check_weights({name: value for name, value in rewards.items() if not isinstance(value, RewardFunction)})
    functions = [name for name, value in rewards.items() if isinstance(value, RewardFunction)]
    if taken := sorted(set(functions) & set(REWARDS)):
        raise ValueError(f"reward name(s) {taken} are built-in components; give your function another name")
    return rewards


RewardConfig = Annotated[
    dict[str, Annotated[Annotated[float, Tag("weight")] | Annotated[RewardFunction, Tag("function")],
                        Discriminator(lambda v: "function" if isinstance(v, dict | RewardFunction) else "weight")]],
    AfterValidator(_checked),
]
"""Named rewards: a weight for a built-in component (``env``, ``progress``, ``format``, ``tool_success``) or a
:class:`RewardFunction`; an unknown built-in name is an error listing the known ones."""


def weight_of(value: float | RewardFunction) -> float:
    """A configured reward's weight."""
    return value.weight if isinstance(value, RewardFunction) else float(value)


@dataclass
class Scores:
    """A batch's rewards: the weighted total of each trajectory, and its per-turn rewards for ``credit: turn`` (the
    ``progress`` weight times the env's dense rewards plus the turn-level functions, weighted)."""

    totals: list[float]
    turns: list[list[float]]


class RewardSet:
    """The configured rewards of a run, their functions built once (a judge keeps its cache and clients).

    Raises:
        pydantic.ValidationError: ``rewards`` is not a valid rewards config.
        UserError: a reward class could not be built with its ``args``.
    """

    def __init__(self, rewards: Mapping[str, float | RewardFunction | dict[str, Any]]) -> None:
        specs = TypeAdapter(RewardConfig).validate_python(dict(rewards))
        self.weights = {name: float(v) for name, v in specs.items() if not isinstance(v, RewardFunction)}
        self.functions = {name: v for name, v in specs.items() if isinstance(v, RewardFunction)}
        self._built: dict[str, Callable[..., Any]] = {}
        for name, spec in self.functions.items():
            try:
                self._built[name] = spec.build()
            except Exception as exc:  # noqa: BLE001 - a constructor's bad argument value, named with its reward
                raise UserError(f"reward {name!r} ({spec.function}) could not be built with args {spec.args}: "
                                f"{exc}") from exc

    def config(self) -> dict[str, Any]:
        """The rewards as plain data (weights and function specs), for a run's record."""
        return self.weights | {name: spec.model_dump() for name, spec in self.functions.items()}

    def score(self, trajectories: Sequence[Trajectory]) -> Scores:
        """:meth:`ascore` from synchronous code (in a thread of its own when an event loop is running here)."""
        return run_sync(lambda: self.ascore(trajectories))

    async def ascore(self, trajectories: Sequence[Trajectory]) -> Scores:
        """Score every trajectory: the built-ins, then every function's calls for the batch at once (a group
        function, one with ``score_group``, once per group of rollouts). Logs each value as
        ``metrics['reward/<name>']``; a failing call marks its trajectories ``error`` (first failure's reason)."""
        totals, turns = [], []
        for trajectory in trajectories:
            total = 0.0
            for name, fn in REWARDS.items():
                trajectory.metrics[f"reward/{name}"] = value = fn(trajectory)
                total += self.weights.get(name, 0.0) * value
            totals.append(total)
            dense = self.weights.get("progress", 0.0)
            turns.append([dense * r for r in trajectory.turn_rewards or []])
        valid = [i for i, t in enumerate(trajectories) if t.status != "error"]
        calls = [(members, name) for name, fn in self._built.items()
                 for members in (_groups(valid, trajectories) if hasattr(fn, "score_group") else [[i] for i in valid])]
        try:
            results = await asyncio.gather(*(self._call(name, [trajectories[i] for i in members])
                                             for members, name in calls))
        finally:  # a function's connections belong to this loop, which ends with the batch when run() made it
            await asyncio.gather(*(fn.aclose() for fn in self._built.values() if hasattr(fn, "aclose")))
        for (members, name), result in zip(calls, results, strict=True):
            weight = self.functions[name].weight
            for i, value in zip(members, result if isinstance(result, list) else [result] * len(members), strict=True):
                trajectory = trajectories[i]
                if isinstance(value, str):
                    if trajectory.status != "error":
                        trajectory.status, trajectory.error = "error", value
                    continue
                if isinstance(value, list):
                    turns[i] = [a + weight * b for a, b in zip(_padded(turns[i], len(value)), value, strict=True)]
                    value = sum(value)
                trajectory.metrics[f"reward/{name}"] = value
                totals[i] += weight * value
        return Scores(totals, turns)

    async def _call(self, name: str, group: list[Trajectory]) -> list[float | list[float]] | str:
        """One function on one trajectory (or, for a group function, on one group): the values, or (a str) why it
        failed."""
        fn, spec = self._built[name], self.functions[name]
        try:
            if hasattr(fn, "score_group"):
                values = await fn.score_group(group, [t.task for t in group])
                if len(values) != len(group):
                    raise ValueError(f"score_group gave {len(values)} values for {len(group)} trajectories")
                return [_number(value) for value in values]
            trajectory = group[0]
            if _is_async(fn):
                value = await fn(trajectory, trajectory.task)
            else:
                value = await asyncio.to_thread(fn, trajectory, trajectory.task)
                if inspect.isawaitable(value):  # a sync callable handing back a coroutine
                    value = await value
            return [_valid(value, spec.level, int(trajectory.metrics.get("turns", 0)))]
        except Exception as exc:  # noqa: BLE001 - any failure of a reward function is recorded, the run goes on
            return f"reward {name!r} ({spec.function}) failed: {type(exc).__name__}: {exc}"


def _groups(indices: list[int], trajectories: Sequence[Trajectory]) -> list[list[int]]:
    """The indices by the trajectories' ``group`` (rollouts of one task), in order; ungrouped ones form one group."""
    groups: dict[str | None, list[int]] = {}
    for i in indices:
        groups.setdefault(trajectories[i].group, []).append(i)
    return list(groups.values())


def _valid(value: Any, level: str, turns: int) -> float | list[float]:
    """A function's value checked against its level: a finite float, or one per model turn."""
    if level == "turn":
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise TypeError(f"a turn-level reward returns one number per model turn, got {type(value).__name__}")
        if len(value) != turns:
            raise ValueError(f"a turn-level reward returns one number per model turn: {turns} turns, "
                             f"{len(value)} numbers")
        return [_number(v) for v in value]
    return _number(value)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        hint = " (one per turn: set level: turn)" if isinstance(value, list | tuple) else ""
        raise TypeError(f"a reward function returns a number, got {type(value).__name__}{hint}")
    if not math.isfinite(value):
        raise ValueError(f"a reward function returned {value}")
    return float(value)


def _padded(values: list[float], length: int) -> list[float]:
    return (values + [0.0] * length)[:length]


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def run_sync(make: Callable[[], Coroutine[Any, Any, T] | Awaitable[T]]) -> T:
    """Run a coroutine to its end from synchronous code, in a thread of its own when this thread already runs an
    event loop (a rollout's ``on_result`` callback)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(asyncio.run(make()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            out.append(exc)

    thread = threading.Thread(target=target, name="trajlab-rewards")
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]
