"""The sandbox's errors, in a module of their own because every part of the package raises them."""

from __future__ import annotations


class SandboxError(RuntimeError):
    """The sandbox cannot run here, or was used after :meth:`Sandbox.cleanup`."""


class SandboxPathError(ValueError):
    """A path given to :meth:`Sandbox.write_file` / :meth:`Sandbox.read_file` would leave the sandbox directory."""
