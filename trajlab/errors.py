"""Errors that are the user's to fix, the checks that raise one (an optional package, a file that is no regular file),
and the error that says an episode failed because of the machinery rather than the policy.

The command line prints a user's error as one line and exits 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import os
import stat
from pathlib import Path
from types import ModuleType


class UserError(ValueError):
    """A mistake in what the user gave (a file, a name, a setting); the message says what was wrong and the fix.

    A ``ValueError`` so that code catching bad input the usual way keeps working.
    """


class MissingDependency(UserError):
    """An optional package a feature needs is not installed; the message says how to install it."""


class InfrastructureError(RuntimeError):
    """An episode failed because of the machinery, not the policy: a sandbox or service that could not start or
    died, a tool killed by the host, a generator or server that failed.

    Raised from env code or a tool, it is never shown to the model as a tool result: the episode ends with status
    ``error`` and this message as its cause, is run again (``rollout.retries``), and never counts as a reward.
    """


def require(module: str, *, feature: str, install: str) -> ModuleType:
    """Import an optional package, or raise :class:`MissingDependency` naming the feature and the install command.

    Args:
        module: the import name, e.g. ``"gepa"``.
        feature: what needs it, e.g. ``"trajlab evolve"``.
        install: the command that installs it, e.g. ``"pip install 'trajlab[evolve]'"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependency(f"{feature} needs the '{module}' package, which is not installed: {install}") from exc


_FILE_TYPES = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device",
               stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}


def refuse_special_file(path: str | Path, wanted: str) -> None:
    """Raise :class:`UserError` when ``path`` exists and is not a regular file (after links).

    Files read whole or appended to must be regular: a device such as ``/dev/zero`` never ends (read into memory
    until the host runs out), and a FIFO blocks its reader until a writer comes. A path that does not exist passes:
    the caller says so in its own words, or creates it.

    Args:
        wanted: what the user should give instead, e.g. ``"a config file (YAML)"``.
    """
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_TYPES.items() if test(mode)), "a special file")
        raise UserError(f"{path}: not a regular file ({kind}); give {wanted}.")
