"""The sandbox's errors, in a module of their own because every part of the package raises them."""

from __future__ import annotations

from trajlab.errors import InfrastructureError, UserError


class SandboxError(InfrastructureError):
    """The sandbox cannot run here, could not start a command, or was used after :meth:`Sandbox.cleanup`: the
    machinery's failure, so an episode that meets one ends as ``error`` and is retried (not shown to the model)."""


class SandboxPathError(ValueError):
    """A path given to :meth:`Sandbox.write_file` / :meth:`Sandbox.read_file` would leave the sandbox directory, names
    no file (a NUL byte), or is not a regular file (a FIFO, directory, socket)."""


class MissingProtection(UserError):
    """An env that runs model-written code refuses a sandbox weaker than it needs; the message says what to install
    and how to opt out. A user's error: retrying cannot fix it."""
