"""Errors that are the user's to fix, and the optional-package check that raises one.

The command line prints such an error as one line and exits 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class UserError(ValueError):
    """A mistake in what the user gave (a file, a name, a setting); the message says what was wrong and the fix.

    A ``ValueError`` so that code catching bad input the usual way keeps working.
    """


class MissingDependency(UserError):
    """An optional package a feature needs is not installed; the message says how to install it."""


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
