"""Tasks from a dataset instead of an env's generator: the ``tasks:`` section's loading, mapping and splits.

A source is a Hugging Face ``datasets`` directory (``save_to_disk``), a Parquet, JSON Lines, JSON or CSV file (or a
``{split: file}`` mapping of them), a folder of such files, or a dataset name, which ``load_dataset`` finds in the
local Hugging Face cache when the network is off. ``datasets`` reads every one of them; this module only maps the
columns to task fields, picks the splits and checks each row against the env's own tasks, so a row the env cannot
run is refused, with its number, before any episode. The env then draws its tasks from the rows
(:func:`with_dataset_tasks`) in every stage: collect, eval, rl, evolve and curricula.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trajlab.env.mixture import ENV_COLUMN, EnvMixture
from trajlab.env.registry import EnvSpec

if TYPE_CHECKING:  # imported where used: every command reads the config, which imports this module
    import datasets

TaskSplits = dict[str, list[tuple[str, dict[str, Any]]]]
"""trajlab split name (``train``, ``test``, ...) -> its task rows in the dataset's order, each with where it is in
the source (its dataset split and row number, e.g. ``train row 3``) for error messages."""

ROW_COLUMN = "__trajlab_row__"
"""A column added while loading, holding each row's place in the source; dropped from the tasks."""

BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
"""The ``datasets`` builder of each file type a task file may have."""

SAVED_MARKERS = ("dataset_dict.json", "state.json")
"""Files of a folder written by ``save_to_disk`` (a DatasetDict's, a Dataset's)."""


def load_task_splits(source: str | Mapping[str, str], *, subset: str | None, columns: Mapping[str, str],
                     keep: Sequence[str] | None, splits: Mapping[str, str] | None, test_fraction: float | None,
                     split_seed: int) -> TaskSplits:
    """The task rows of each trajlab split: ``source`` loaded with ``datasets``, its columns renamed by ``columns``
    (dataset column -> task field) and cut to those and ``keep`` (None: every column), then split.

    ``splits`` maps trajlab splits to the dataset's (None: the dataset's own names); a dataset of one split is
    first split into ``train`` and ``test`` by ``test_fraction`` (seeded by ``split_seed``) when that is given. A
    dataset written by ``trajlab dataset --kind rl`` (and pushed, say) gives back the tasks it was written from.

    Raises:
        FileNotFoundError: a file or folder that does not exist.
        ValueError: a name the cache does not hold, a column or split the dataset lacks (the message lists those it
            has), a ``test_fraction`` for a dataset that already has several splits, or an empty split.
    """
    from trajlab.data.datasets import RL_COLUMNS  # imports datasets, as loading does anyway

    where = _describe(source)
    try:
        loaded = _load(source, subset)
    except ValueError as exc:  # datasets' own word for an empty split: 'Instruction "test" corresponds to no data!'
        empty = re.search(r'Instruction "(.+)" corresponds to no data', str(exc))
        if empty is None:
            raise
        raise ValueError(f"{where}: split {empty[1]!r} has no rows; give it at least one task.") from exc
    written_by_trajlab = set(loaded[next(iter(loaded))].column_names) == set(RL_COLUMNS) and not columns and (
        keep is None)
    loaded = _mapped(loaded, columns, keep, where)
    if test_fraction is not None:
        if len(loaded) != 1:
            raise ValueError(f"{where}: tasks.test_fraction splits a dataset of one split, and this one has "
                             f"{', '.join(loaded)}; map them with tasks.splits instead.")
        (only,) = loaded.values()
        if len(only) < 2:
            raise ValueError(f"{where}: {len(only)} row(s) cannot be split into train and test.")
        loaded = only.train_test_split(test_size=test_fraction, seed=split_seed)
    chosen = dict(splits) if splits is not None else {name: name for name in loaded}
    missing = {ours: theirs for ours, theirs in chosen.items() if theirs not in loaded}
    if missing:
        ours, theirs = next(iter(missing.items()))
        raise ValueError(f"{where}: no split {theirs!r} (for trajlab's {ours!r} in tasks.splits); its splits: "
                         f"{', '.join(loaded)}.")
    return {ours: [(row.pop(ROW_COLUMN), _task_of(row) if written_by_trajlab else row)
                   for row in loaded[theirs].to_list()] for ours, theirs in chosen.items()}


def _mapped(loaded: datasets.DatasetDict, columns: Mapping[str, str], keep: Sequence[str] | None,
            where: str) -> datasets.DatasetDict:
    """Every split with its columns renamed and cut, and each row's place in the source added (``ROW_COLUMN``)."""
    import datasets

    names = loaded[next(iter(loaded))].column_names
    for column in [*columns, *(keep or [])]:
        if column not in names:
            raise ValueError(f"{where}: no column {column!r} (tasks.columns / tasks.keep); its columns: "
                             f"{', '.join(names)}.")
    kept = [*columns, *(c for c in keep if c not in columns)] if keep is not None else names
    targets = list(columns.values())
    clashes = sorted({t for t in targets if targets.count(t) > 1 or (t in kept and t not in columns)})
    if clashes:
        raise ValueError(f"{where}: tasks.columns gives a task two fields named {', '.join(clashes)} (two columns "
                         "mapped to it, or one mapped onto a column kept as it is); map one column to each field, "
                         "and leave the other out with tasks.keep.")
    return datasets.DatasetDict({name: part.select_columns(kept).rename_columns(dict(columns)).add_column(
        ROW_COLUMN, [f"{name} row {number}" for number in range(1, len(part) + 1)]) for name, part in loaded.items()})


def _task_of(row: dict[str, Any]) -> dict[str, Any]:
    """The task of a row of ``trajlab dataset --kind rl``: its ``task`` column, JSON text (Parquet, a folder) or
    an object (JSON Lines)."""
    task = row["task"]
    return json.loads(task) if isinstance(task, str) else task


def _describe(source: str | Mapping[str, str]) -> str:
    return str(source) if isinstance(source, str) else ", ".join(f"{k}={v}" for k, v in source.items())


def _load(source: str | Mapping[str, str], subset: str | None) -> datasets.DatasetDict:
    """Every split of ``source``, loaded by ``datasets``."""
    import datasets

    if not isinstance(source, str):
        paths = {split: Path(file) for split, file in source.items()}
        for path in paths.values():
            _require_file(path)
        builders = {_builder(path) for path in paths.values()}
        if len(builders) > 1:
            raise ValueError(f"{_describe(source)}: the split files are of different types; give one type.")
        return datasets.load_dataset(builders.pop(), data_files={k: str(v) for k, v in paths.items()})
    path = Path(source).expanduser()
    if path.is_dir() and any((path / marker).exists() for marker in SAVED_MARKERS):
        saved = datasets.load_from_disk(str(path))
        return saved if isinstance(saved, datasets.DatasetDict) else datasets.DatasetDict({"train": saved})
    if path.is_dir():
        return datasets.load_dataset(str(path))
    if path.exists() or path.suffix in BUILDERS or source.startswith((".", "/", "~")):
        _require_file(path)
        return datasets.load_dataset(_builder(path), data_files=str(path))
    return _load_named(source, subset)


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such task file (tasks.source: a Parquet, JSONL, JSON or CSV file, a "
                                "folder written by save_to_disk, or a dataset name in the Hugging Face cache).")


def _builder(path: Path) -> str:
    if path.suffix not in BUILDERS:
        raise ValueError(f"{path}: a task file is Parquet, JSONL, JSON or CSV ({', '.join(BUILDERS)}), not "
                         f"{path.suffix or 'a file without a suffix'}.")
    return BUILDERS[path.suffix]


def _load_named(name: str, subset: str | None) -> datasets.DatasetDict:
    """A dataset by Hugging Face name: from the Hub where the network allows, else from the local cache."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    try:
        loaded = datasets.load_dataset(name, subset)
    except (DatasetNotFoundError, ConnectionError, FileNotFoundError, ValueError) as exc:
        why = " ".join(str(exc).split())[:300]
        raise ValueError(f"tasks.source {name!r} is no file here, and loading it as a Hugging Face dataset failed: "
                         f"{why}. Offline, a name loads from the datasets cache ({datasets.config.HF_DATASETS_CACHE}"
                         "): load it once where the network allows, or give a file.") from exc
    if not isinstance(loaded, datasets.DatasetDict):
        raise ValueError(f"tasks.source {name!r} loaded as a {type(loaded).__name__}, not a dataset of splits.")
    return loaded


def with_dataset_tasks(env: EnvSpec | EnvMixture, rows: TaskSplits, *, shuffle: bool,
                       where: str) -> EnvSpec | EnvMixture:
    """``env`` drawing its tasks from ``rows`` instead of its generator, in every split it has there: in a seeded
    order when ``shuffle`` (a stage's seed, as the generators do), else in the dataset's order. In a mixture each
    row goes to the env its ``env`` column names.

    Raises:
        ValueError: a row the env cannot run (unlike its own tasks, or naming an env outside the mixture), named by
            its split and row number.
    """
    checks: dict[str, Callable[[dict[str, Any]], list[str]]] = {}
    routed: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for split, part in rows.items():
        seen: dict[str, str] = {}
        for place, task in part:
            content = json.dumps(task, sort_keys=True, default=str)
            if content in seen:  # episodes are keyed by their task's content: a second copy would collide mid-run
                raise ValueError(f"{where}: {seen[content]} and {place} are the same task (every field equal); "
                                 "remove the duplicates (Dataset.unique, pandas drop_duplicates) or give each row a "
                                 "task_id column; nothing was run.")
            seen[content] = place
            try:
                spec = env.spec_for(task) if isinstance(env, EnvMixture) else _single(env, task)
            except ValueError as exc:
                raise ValueError(f"{where}, {place}: {exc}") from exc
            check = checks.setdefault(spec.name, spec.task_check())
            if problems := check(task):
                raise ValueError(f"{where}, {place}: not a valid {spec.name} task: {'; '.join(problems)}. Fix the row "
                                 "or map the columns (tasks.columns); nothing was run.")
            routed.setdefault(spec.name, {}).setdefault(split, []).append(task)
    if isinstance(env, EnvMixture):
        return replace(env, specs={name: _drawing(spec, routed.get(name, {}), rows, shuffle, where)
                                   for name, spec in env.specs.items()})
    return _drawing(env, routed.get(env.name, {}), rows, shuffle, where)


def _single(env: EnvSpec, task: dict[str, Any]) -> EnvSpec:
    if ENV_COLUMN in task and task[ENV_COLUMN] != env.name:
        raise ValueError(f"the task is for env {task[ENV_COLUMN]!r} but runs in '{env.name}'; give env: "
                         f"[{env.name}, {task[ENV_COLUMN]}] to run a mixed dataset.")
    return env


def _drawing(spec: EnvSpec, own: dict[str, list[dict[str, Any]]], every: TaskSplits, shuffle: bool,
             where: str) -> EnvSpec:
    """``spec`` with a generator over its rows of each split (a split the dataset has but none for this env: no
    rows, so a mixture's other envs fill it)."""
    fixed = {split: own.get(split, []) for split in every}

    def tasks(split: str, seed: int, **_knobs: int) -> Iterator[dict[str, Any]]:
        order = list(range(len(fixed[split])))
        if shuffle:
            random.Random(seed).shuffle(order)
        return (dict(fixed[split][i]) for i in order)

    return replace(spec, tasks=tasks, splits=tuple(fixed), knobs=(), options={},
                   metadata={**spec.metadata, "tasks_source": where})
