"""Errors that are the user's to fix, the optional-package check that raises one, and the error that says an episode
failed because of the machinery rather than the policy.

The command line prints a user's error as one line and exits 1; anything else is a bug and keeps its traceback.
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
