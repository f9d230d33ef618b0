"""The ``mcp:`` section: the MCP server whose tools are the env of ``env: mcp`` (``trajlab.env.mcp_env``)."""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trajlab.config.sections import Section
from trajlab.env.registry import EnvSpec


class McpSettings(Section):
    """An MCP server as an env: a stdio command run in the sandbox, or a streamable-HTTP URL (exactly one)."""

    command: list[str] | None = None
    """The stdio server's argv, e.g. ``[/usr/bin/python3, /srv/tools/server.py]``; it runs in the sandbox (its own
    uid and namespaces, no network), seeing the system, its sandbox directory and ``read_only_paths``."""
    url: str | None = None
    """A streamable-HTTP server's endpoint, e.g. ``http://127.0.0.1:8000/mcp``: the user's own process, not
    sandboxed."""
    server: Literal["episode", "shared"] = "episode"
    """``episode``: a new server (stdio) or session (HTTP) per episode; ``shared``: one for all episodes, started
    again when it died, and ``reset_tool`` called at each episode's start."""
    reset_tool: str | None = None
    """With ``server: shared``, a tool of the server called without arguments when an episode starts."""
    call_timeout_s: float = Field(30.0, gt=0)
    """Seconds a tools/call may take; a server silent longer is an infrastructure error (the episode is retried)."""
    startup_timeout_s: float = Field(30.0, gt=0)
    """Seconds a server may take to start and answer initialize and tools/list."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of a stdio server (it gets no other of the host's), e.g. ``{PYTHONPATH: ...}``."""
    read_only_paths: list[str] = Field(default_factory=list)
    """Host paths a stdio server sees read-only at the same path: its program, its Python packages (their files
    must be readable by every user: the sandbox runs as its own uid)."""
    server_cpu_s: int = Field(3600, ge=1)
    """CPU seconds a stdio server's process may use in its life (a shared server lives for the whole run)."""
    server_memory_mb: int = Field(2048, ge=64)
    """Address space of each of a stdio server's processes, in MiB."""
    oracle: str | None = None
    """Import path ``package.module:function`` of a scripted policy of this server's tools, ``oracle(task,
    messages)`` returning the next assistant message: the demonstrator of a collect stage (``policy oracle``), which
    an MCP server does not bring. None: the env has no oracle."""

    @field_validator("oracle")
    @classmethod
    def _importable(cls, path: str | None) -> str | None:
        if path is not None:
            load_oracle(path)
        return path

    @model_validator(mode="after")
    def _one_server(self) -> McpSettings:
        if (self.command is None) == (self.url is None):
            raise ValueError("give the MCP server as exactly one of mcp.command (a stdio server's argv, a list) or "
                             "mcp.url (a streamable-HTTP endpoint)")
        if self.command is not None and not self.command:
            raise ValueError("mcp.command is empty: give the server's argv, e.g. [python3, server.py]")
        if self.reset_tool is not None and self.server != "shared":
            raise ValueError("mcp.reset_tool is called on a shared server only: set mcp.server: shared, or drop it "
                             "(a per-episode server starts fresh)")
        return self

    def spec(self, tasks: list[dict[str, Any]] | None = None) -> EnvSpec:
        """The env of this server (an ``EnvSpec``; see :func:`trajlab.env.mcp_env.mcp_spec`)."""
        from trajlab.env.mcp_env import mcp_spec

        oracle = load_oracle(self.oracle) if self.oracle is not None else None
        return mcp_spec(self, shared=self.server == "shared", reset_tool=self.reset_tool, tasks=tasks, oracle=oracle)


def load_oracle(path: str) -> Any:
    """The function an ``mcp.oracle`` import path names.

    Raises:
        ValueError: not ``module:function``, not importable, no such name, or not callable.
    """
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"mcp.oracle is an import path 'my_pkg.policy:oracle'; got {path!r}")
    try:
        target = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load mcp.oracle {path!r}: {type(exc).__name__}: {exc}; is the package installed, "
                         "or its directory on PYTHONPATH?") from exc
    if not callable(target):
        raise ValueError(f"mcp.oracle {path!r} is a {type(target).__name__}, not a function")
    return target
