"""Environments by name, loaded lazily from ``module:attr`` entry points (Gymnasium's registry pattern).

An env is described by an :class:`EnvSpec`: the env class plus what trajlab needs around it (a task generator with
a train/test split, an optional scripted reference policy, a default system prompt, the difficulty knobs its task
generator takes). Those live outside the env class on purpose: every public method of the class is a tool.
"""

from __future__ import annotations

import difflib
import importlib
import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trajlab.env.base import tool_names, tool_schemas
from trajlab.env.limits import EpisodeLimits
from trajlab.errors import refuse_special_file

TaskGenerator = Callable[..., Iterable[dict[str, Any]]]
"""``tasks(split, seed, **knobs)``: the tasks of a split, in a fixed order for a given seed; ``knobs`` are the
generator's difficulty settings (:class:`Knob`), each left at its default unless set."""

Oracle = Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any]]
"""``oracle(task, messages)``: the next assistant message (content and/or tool_calls) of a scripted policy."""


@dataclass(frozen=True)
class Knob:
    """A difficulty setting of an env's task generator (an integer within bounds), e.g. arithmetic's largest operand.

    Declared on the :class:`EnvSpec` so that ``trajlab envs`` and the env's docs page list it, and so that a wrong
    name or value is refused before any episode runs. Its default reproduces the env's tasks as they were before
    the knob existed; a task's split never depends on a knob.
    """

    name: str
    default: int
    help: str
    low: int
    high: int


@dataclass(frozen=True)
class EnvSpec:
    """An environment and what trajlab needs to run it."""

    name: str
    env_cls: type
    tasks: TaskGenerator | None = None
    oracle: Oracle | None = None
    references: dict[str, Oracle] = field(default_factory=dict)
    """Other reference policies by name, imperfect on purpose: demonstrators with a flaw the reward sees, whose
    demonstrations RL has to improve on (``collect.reference``). One that takes a keyword argument ``rng`` draws per
    episode (:mod:`trajlab.inference.scripted`)."""
    system_prompt: str | None = None
    splits: tuple[str, ...] = ("train", "test")
    metadata: dict[str, Any] = field(default_factory=dict)
    check_task: Callable[[dict[str, Any]], list[str]] | None = None
    """What else makes a given task one this env cannot run (a value outside its choices, say), as problems; run by
    :meth:`task_check` on tasks whose fields have the right types, so a bad row is refused before any episode."""
    tool_descriptions: dict[str, str] = field(default_factory=dict)
    """Descriptions shown to the model instead of the docstrings' (e.g. evolved by ``trajlab evolve``)."""
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    """What this env's episodes need (turns, tokens, tool time); used unless the user sets other limits."""
    knobs: tuple[Knob, ...] = ()
    """The difficulty knobs ``tasks`` takes as keyword arguments."""
    options: dict[str, int] = field(default_factory=dict)
    """The knobs set away from their defaults (:meth:`with_options`); ``iter_tasks`` passes them to ``tasks``."""

    @property
    def description(self) -> str:
        doc = (self.env_cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    @property
    def tools(self) -> list[dict[str, Any]]:
        schemas = tool_schemas(self.env_cls)
        if not self.tool_descriptions:
            return schemas
        return [_described(schema, self.tool_descriptions.get(schema["function"]["name"])) for schema in schemas]

    @property
    def shows_images(self) -> bool:
        """Whether a tool returns an image (its return annotation is a PIL image): the policy must see them."""
        return any(schema["function"].get("return", {}).get("type") == "image" for schema in self.tools)

    def with_tool_descriptions(self, descriptions: dict[str, str]) -> EnvSpec:
        """This env with some tools described differently; only what the model reads changes, not the tools.

        Raises:
            ValueError: a name is not a tool of the env (the message lists its tools).
        """
        known = tool_names(self.env_cls)
        unknown = sorted(set(descriptions) - set(known))
        if unknown:
            raise ValueError(f"Environment '{self.name}' has no tool(s) {unknown}; its tools: {', '.join(known)}.")
        return replace(self, tool_descriptions={**self.tool_descriptions, **descriptions})

    def with_options(self, **knobs: int) -> EnvSpec:
        """This env generating its tasks at the given knob values, every other knob at its default.

        Raises:
            ValueError: a name that is not one of the env's knobs (the message lists them and the closest), a value
                outside the knob's bounds, or settings under which a split has no task.
        """
        declared = {knob.name: knob for knob in self.knobs}
        for name, value in knobs.items():
            if name not in declared:
                close = difflib.get_close_matches(name, declared, n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                listed = ", ".join(declared) if declared else "none"
                raise ValueError(f"Environment '{self.name}' has no difficulty knob '{name}'.{hint} Its knobs: "
                                 f"{listed}.")
            knob = declared[name]
            if isinstance(value, bool) or not isinstance(value, int) or not knob.low <= value <= knob.high:
                raise ValueError(f"{self.name} knob '{name}' is an integer from {knob.low} to {knob.high}, got "
                                 f"{value!r}.")
        chosen = {name: knobs.get(name, knob.default) for name, knob in declared.items()}
        for name, low in chosen.items():
            upper = "max_" + name.removeprefix("min_")
            if name.startswith("min_") and upper in chosen and low > chosen[upper]:
                raise ValueError(f"{self.name}: {name} {low} is above {upper} {chosen[upper]}.")
        spec = replace(self, options={name: value for name, value in knobs.items() if value != declared[name].default})
        for split in spec.splits:
            if next(iter(spec.iter_tasks(split, PROBE_SEED)), None) is None:
                raise ValueError(f"Environment '{self.name}' has no {split} task at {knobs}.")
        return spec

    def make(self) -> Any:
        """A fresh env instance: one per episode, never shared."""
        return self.env_cls()

    def task_check(self) -> Callable[[dict[str, Any]], list[str]]:
        """A check of given tasks against this env's own: it lists what makes a task unlike them (a field every one
        of them has that it lacks, a value of another JSON type than theirs), then what the env's ``check_task``
        finds. Run before any episode, so a bad row of a tasks file is refused with its line number instead of
        stored as an ``error`` episode. An env without a task generator has no reference: only ``check_task``
        runs."""
        reference = [] if self.tasks is None else list(itertools.islice(self.iter_tasks(self.splits[0], PROBE_SEED),
                                                                         TASK_REFERENCE_SIZE))
        fields = sorted(set.intersection(*(set(t) for t in reference)) - {"task_id", "env"}) if reference else []
        kinds = {key: {_json_kind(t[key]) for t in reference} for key in fields}

        def problems(task: dict[str, Any]) -> list[str]:
            found = []
            for key in fields:
                example = reference[0][key]
                if key not in task:
                    found.append(f"missing field {key!r} (every {self.name} task has one, e.g. {example!r})")
                elif len(kinds[key]) == 1 and _json_kind(task[key]) not in kinds[key]:
                    found.append(f"field {key!r} is a {_json_kind(task[key])} ({task[key]!r}) where {self.name}'s "
                                 f"tasks have a {_json_kind(example)}, e.g. {example!r}")
            if not found and self.check_task is not None:
                found = self.check_task(task)
            return found

        return problems

    def iter_tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        if self.tasks is None:
            raise ValueError(
                f"Environment '{self.name}' has no task generator; pass tasks from a file (--tasks FILE.jsonl)."
            )
        if split not in self.splits:
            source = self.metadata.get("tasks_source")
            hint = (f" (its tasks come from {source}: map a dataset split to '{split}' with tasks.splits, or split "
                    "a dataset of one split with tasks.test_fraction)") if source else ""
            raise ValueError(f"Environment '{self.name}' has splits {list(self.splits)}, not '{split}'{hint}.")
        yield from self.tasks(split, seed, **self.options)


_REGISTRY: dict[str, str] = {
    "arithmetic": "trajlab.env.builtin.arithmetic:SPEC",
    "bfcl": "trajlab.env.builtin.bfcl:SPEC",
    "ctf": "trajlab.env.builtin.ctf:SPEC",
    "driving": "trajlab.env.builtin.driving:SPEC",
    "guess": "trajlab.env.builtin.guess:SPEC",
    "odd_one_out": "trajlab.env.builtin.odd_one_out:SPEC",
    "wordle": "trajlab.env.builtin.wordle:SPEC",
}


def _described(schema: dict[str, Any], description: str | None) -> dict[str, Any]:
    if description is None:
        return schema
    return {**schema, "function": {**schema["function"], "description": description}}


def register(name: str, entry_point: str) -> None:
    """Register an env under ``name``; ``entry_point`` is ``module:attr`` naming an EnvSpec or an env class."""
    _REGISTRY[name] = entry_point


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


def load_env(name_or_path: str) -> EnvSpec:
    """Resolve a registered name or an import path ``my_pkg.envs:MyEnv`` (an EnvSpec or an env class).

    Raises:
        ValueError: for an unknown name (listing the registered ones and the closest match) or a bad import path.
    """
    if name_or_path in _REGISTRY:
        return _load_entry_point(_REGISTRY[name_or_path], name_or_path)
    if ":" in name_or_path:
        return _load_entry_point(name_or_path, name_or_path)
    close = difflib.get_close_matches(name_or_path, _REGISTRY, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ValueError(
        f"Unknown environment '{name_or_path}'.{hint} Registered: {', '.join(registered_names())}. "
        "A custom env is given as an import path, e.g. 'my_pkg.envs:MyEnv'."
    )


def _load_entry_point(entry_point: str, name: str) -> EnvSpec:
    module_name, _, attr = entry_point.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"Cannot load environment '{entry_point}': {exc}. An import path names a module importable "
                         "here (installed, or its folder on PYTHONPATH) and an env class or EnvSpec in it, "
                         "'module.path:Name'.") from exc
    if isinstance(target, EnvSpec):
        return target
    if isinstance(target, type):
        if not callable(getattr(target, "reset", None)):
            raise ValueError(f"'{entry_point}' is not an environment: it has no reset() method.")
        if not tool_names(target):
            raise ValueError(f"'{entry_point}' has no tools: give it at least one public method with type hints.")
        return EnvSpec(name=name, env_cls=target)
    raise ValueError(f"'{entry_point}' is neither an EnvSpec nor an environment class (got {type(target).__name__}).")


TASK_REFERENCE_SIZE = 32
"""How many of an env's own tasks the check of :meth:`EnvSpec.task_check` compares a given task with."""
PROBE_SEED = 0
"""The task order of the env's own checks (a knob that leaves a split empty, the task check): any one would do."""


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "list", dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def read_tasks_file(path: str | Path) -> list[dict[str, Any]]:
    """Tasks from a JSONL file, one JSON object (the kwargs of ``reset``) per line."""
    refuse_special_file(path, "a tasks file (JSONL)")  # a device would never end, a FIFO block
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise FileNotFoundError(f"{path}: no such tasks file (JSONL: one task object per line)") from exc
    tasks = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg}).") from exc
        if not isinstance(task, dict):
            raise ValueError(f"{path}:{number}: a task must be a JSON object, got {type(task).__name__}.")
        tasks.append(task)
    return tasks
