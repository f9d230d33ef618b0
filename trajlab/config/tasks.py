"""The ``tasks:`` section: an env's tasks from a dataset (a file, a ``datasets`` folder or a cached dataset name)
instead of its generator, in every stage that draws tasks."""

from __future__ import annotations

from pydantic import Field, model_validator

from trajlab.config.sections import Section
from trajlab.data.task_sources import load_task_splits, with_dataset_tasks
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec


class TasksSettings(Section):
    """Where the run's tasks come from when not from the env's generator; each row (after the column mapping) is
    passed to the env as ``reset(**row)``."""

    source: str | dict[str, str]
    """A Parquet, JSONL, JSON or CSV file, a folder written by ``save_to_disk`` (or of such files), a
    ``{split: file}`` mapping, or a Hugging Face dataset name (offline: from the local datasets cache)."""
    subset: str | None = None
    """The dataset's configuration (``load_dataset(name, subset)``) when a named dataset has several."""
    columns: dict[str, str] = Field(default_factory=dict)
    """Dataset column -> task field, e.g. ``{problem: question}``; unmapped columns keep their names."""
    keep: list[str] | None = None
    """The dataset columns kept besides the mapped ones (None: every column; []: the mapped ones only)."""
    splits: dict[str, str] | None = None
    """trajlab split -> dataset split, e.g. ``{train: train, test: validation}``; None: the dataset's own names.
    Stages draw train (collect, rl, evolve) and test (eval) unless their settings name another."""
    test_fraction: float | None = Field(None, gt=0, lt=1)
    """For a dataset of one split: the share of its rows held out as the test split (the rest is train)."""
    split_seed: int = 0
    """The seed of the ``test_fraction`` split: the same rows are held out in every run."""
    shuffle: bool = True
    """Draw each split in a seeded order (each stage's seed, as the env generators do); False: the dataset's order."""

    @model_validator(mode="after")
    def _one_way_to_split(self) -> TasksSettings:
        if self.test_fraction is not None and isinstance(self.source, dict):
            raise ValueError("test_fraction splits a dataset of one split; a {split: file} source has its splits")
        return self

    def apply(self, env: EnvSpec | EnvMixture) -> EnvSpec | EnvMixture:
        """``env`` drawing its tasks from this source.

        Raises:
            FileNotFoundError, ValueError: the source, a column, a split or a row is wrong (see
                :func:`~trajlab.data.task_sources.load_task_splits`).
        """
        rows = load_task_splits(self.source, subset=self.subset, columns=self.columns, keep=self.keep,
                                splits=self.splits, test_fraction=self.test_fraction, split_seed=self.split_seed)
        where = self.source if isinstance(self.source, str) else ", ".join(self.source.values())
        return with_dataset_tasks(env, rows, shuffle=self.shuffle, where=where)
