"""What a command shows while it works: progress on long work, its log, and none of the libraries' noise.

``--quiet`` / ``--verbose`` (before the command: ``trajlab -q run ...``) set the level once per command with
:func:`configure`. To a terminal, progress is a live bar and log records are rich lines; to anything else (a file, a
pipe, CI) progress is a line at most every :data:`PROGRESS_EVERY_S` seconds and every log record is exactly one line,
so a log file can be grepped and never breaks in the middle of a number.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum
from typing import TYPE_CHECKING, TextIO

from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from trajlab.cli.common import console

if TYPE_CHECKING:  # importing the recipes here would slow every command's start
    from trajlab.recipes.arguments import Progress

PROGRESS_EVERY_S = 30.0
"""How often progress is written when the output is not a terminal."""
LOG_WIDTH = 200
"""Columns of a table printed to a non-terminal (rich would otherwise use 80 and wrap cells)."""
SAY_WIDTH = 200
"""The longest line :func:`say` prints."""
NOISE = {
    "accelerate": ("Removed shared tensor",),  # every checkpoint of a model with tied embeddings: expected
}
"""Warnings of third-party loggers (and their children) that say nothing a user can act on, by logger name and a
piece of the message."""


class Verbosity(IntEnum):
    QUIET = 0  # results, warnings and errors only
    NORMAL = 1
    VERBOSE = 2  # trajlab's debug records, the libraries' info records and every warning (and, on a terminal, bars)


_verbosity = Verbosity.NORMAL


def configure(verbosity: Verbosity) -> None:
    """Set what this command shows: log handler and levels, the libraries' progress bars and noise."""
    global _verbosity
    _verbosity = verbosity
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_trajlab", False)]:
        root.removeHandler(handler)
    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(console=console, show_path=False, markup=False, rich_tracebacks=False,
                              log_time_format="%H:%M:%S")
    else:
        console.width = max(console.width, LOG_WIDTH)
        handler = _Stderr()
        handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    handler._trajlab = True  # type: ignore[attr-defined]
    if verbosity < Verbosity.VERBOSE:
        handler.addFilter(DropNoise(NOISE))
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbosity == Verbosity.VERBOSE else logging.WARNING)
    logging.getLogger("trajlab").setLevel(
        {Verbosity.QUIET: logging.WARNING, Verbosity.NORMAL: logging.INFO, Verbosity.VERBOSE: logging.DEBUG}[verbosity])
    logging.captureWarnings(True)  # warnings.warn through the handler: one line each, filtered like the rest
    _quiet_libraries(verbosity)


def _quiet_libraries(verbosity: Verbosity) -> None:
    import huggingface_hub.utils
    import transformers.utils.logging

    # loading, saving and mapping bars: instant at our sizes, and a wall of carriage returns in a log file
    bars = verbosity == Verbosity.VERBOSE and console.is_terminal
    for on, off in ((transformers.utils.logging.enable_progress_bar, transformers.utils.logging.disable_progress_bar),
                    (huggingface_hub.utils.enable_progress_bars, huggingface_hub.utils.disable_progress_bars)):
        (on if bars else off)()
    if "datasets" in sys.modules:
        import datasets

        (datasets.enable_progress_bars if bars else datasets.disable_progress_bars)()
    else:  # read when it is imported; importing it here would slow every command down by half a second
        os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "0" if bars else "1"
    transformers.utils.logging.set_verbosity(
        {Verbosity.QUIET: logging.ERROR, Verbosity.NORMAL: logging.WARNING, Verbosity.VERBOSE: logging.INFO}[verbosity])
    transformers.utils.logging.disable_default_handler()  # its records reach the root handler, one line each
    transformers.utils.logging.enable_propagation()
    if verbosity == Verbosity.QUIET:
        warnings.simplefilter("ignore")


class DropNoise(logging.Filter):
    """Drops the records of :data:`NOISE`: a known logger (or a child of it) saying a known, harmless thing."""

    def __init__(self, noise: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        self.noise = noise

    def filter(self, record: logging.LogRecord) -> bool:
        for name, pieces in self.noise.items():
            if record.name == name or record.name.startswith(name + "."):
                message = record.getMessage()
                if any(piece in message for piece in pieces):
                    return False
        return True


class _Stderr(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is when a record comes (a test runner swaps it)."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ sets it; the property decides
        pass


class OneLineFormatter(logging.Formatter):
    """One line per record: newlines (a multi-line message, a traceback) become ``\\n``."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", "").replace("\n", "\\n")


def say(message: str) -> None:
    """A line of the command's own account (a stage finished, a step's numbers), timestamped; not when quiet.

    A longer or multi-line message (a GEPA candidate's whole prompt) is cut to its first :data:`SAY_WIDTH`
    characters: whole texts are in the files the work writes.
    """
    if _verbosity == Verbosity.QUIET:
        return
    text = message.strip()
    line = text.splitlines()[0] if text else ""
    if len(line) > SAY_WIDTH or line != text:
        line = line[:SAY_WIDTH] + " [...]"
    console.print(Text.assemble((time.strftime("%H:%M:%S"), "dim"), " ", line), soft_wrap=True, highlight=False)


@contextmanager
def progress(label: str) -> Iterator[Progress]:
    """Progress of one long piece of work, fed by the ``on_progress(done, total)`` it yields: a live bar on a
    terminal, a line now and then elsewhere, nothing when quiet."""
    if _verbosity == Verbosity.QUIET:
        yield lambda done, total: None
    elif console.is_terminal:
        with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                      transient=True) as bar:
            task = bar.add_task(label, total=None)
            yield lambda done, total: bar.update(task, completed=done, total=total)
    else:
        yield _ProgressLines(label)


class _ProgressLines:
    """Progress as log lines: the first, then one every PROGRESS_EVERY_S seconds, and the last."""

    def __init__(self, label: str) -> None:
        self.label, self.started, self.shown = label, time.monotonic(), -PROGRESS_EVERY_S

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.shown < PROGRESS_EVERY_S and done < total:
            return
        self.shown = now
        share = f" ({100 * done / total:.0f}%)" if total else ""
        say(f"{self.label}: {done}/{total}{share}, {now - self.started:.0f}s")
