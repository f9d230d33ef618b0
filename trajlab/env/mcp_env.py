"""``env: mcp``: an env whose tools are those an MCP server lists, called through the MCP Python SDK.

Why: agents' tools already exist as MCP servers; training on them should need a config, not a Python env class.
:func:`mcp_spec` connects once, reads ``tools/list`` and makes an env class for that server with one tool per MCP
tool (its schema and description as the server gives them, as BFCL's generated tools are), so tool discovery, the
engine, ``check_env`` and ``trajlab envs`` treat it like any other env.

An episode's task is a row of a tasks file: ``prompt`` (the first user message) and, optionally, ``answer``. The
env's own reward is 1.0 when the model's final answer (its last turn without a tool call) matches ``answer``
(:func:`answer_matches`), else 0; without ``answer`` it is 0, for reward functions to score.
"""

from __future__ import annotations

import atexit
import random
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from trajlab.env.base import PROTOCOL_METHODS, Environment
from trajlab.env.content import Content
from trajlab.env.limits import EpisodeLimits
from trajlab.env.mcp_client import McpConnection, McpServerOptions, McpToolError, joined_text, result_parts
from trajlab.env.registry import EnvSpec, Oracle
from trajlab.errors import InfrastructureError, UserError

_TIMEOUT_MARGIN_S = 5.0
"""How much longer than ``call_timeout_s`` the engine waits for a call, so that the server's silence is caught as
the infrastructure error it is rather than as a slow tool."""


class McpServer:
    """The server of one MCP env: a connection per episode, or one shared by all episodes (restarted when it died,
    its ``reset_tool`` called at each episode's start).

    Args:
        options: the server, its timeouts and sandbox settings.
        shared: one session for every episode instead of one per episode.
        reset_tool: with ``shared``, the tool called (without arguments) when an episode starts.
    """

    def __init__(self, options: McpServerOptions, *, shared: bool, reset_tool: str | None) -> None:
        self.options, self.shared, self.reset_tool = options, shared, reset_tool
        self.label = " ".join(options.command) if options.command is not None else str(options.url)
        self._lock = threading.Lock()
        self._shared: McpConnection | None = None
        self.restarts = 0

    def first(self) -> McpConnection:
        """A connection for listing the tools; kept as the shared one when the server is shared."""
        connection = McpConnection(self.options, self.label)
        if self.shared:
            self._shared = connection
            atexit.register(self.close)
        return connection

    def connect(self) -> McpConnection:
        """The connection an episode uses (a new one per episode, or the shared one, started again if it died).

        Raises:
            InfrastructureError: the server could not start, or its reset tool failed.
        """
        if not self.shared:
            return McpConnection(self.options, self.label)
        with self._lock:
            if self._shared is None or not self._shared.alive:
                if self._shared is not None:
                    self._shared.close()
                    self.restarts += 1
                self._shared = McpConnection(self.options, self.label)
            connection = self._shared
        if self.reset_tool is not None:
            try:
                result = connection.call(self.reset_tool, {})
            except McpToolError as exc:
                raise InfrastructureError(f"MCP server {self.label}: the reset tool '{self.reset_tool}' failed: "
                                          f"{exc}") from exc
            if result.is_error:
                raise InfrastructureError(f"MCP server {self.label}: the reset tool '{self.reset_tool}' failed: "
                                          f"{joined_text(result_parts(result))}")
        return connection

    def release(self, connection: McpConnection) -> None:
        """An episode is done with ``connection``: a per-episode server stops."""
        if not self.shared:
            connection.close()

    def close(self) -> None:
        """Stop the shared server, if any."""
        with self._lock:
            if self._shared is not None:
                self._shared.close()
                self._shared = None


class McpEnv(Environment):
    """Tools served by an MCP server; the reward is 1.0 for a final answer that matches the task's ``answer``.

    Each server gets its own subclass (:func:`mcp_env_class`), whose public functions are the server's tools.
    """

    server: ClassVar[McpServer]

    def reset(self, **task: Any) -> str | None:
        """Start an episode: connect (or reset the shared server) and remember the expected answer."""
        super().reset()
        self.expected = task.get("answer")
        self.connection: McpConnection | None = None
        self.connection = type(self).server.connect()
        return None  # the task's prompt is the first user message

    def next_user_message(self, answer: str | None) -> str | None:
        """The model answered (no tool call): the episode ends, rewarded when the answer matches."""
        if answer is not None:
            self.done = True
            self.success = self.expected is not None and answer_matches(answer, self.expected)
            self.reward = 1.0 if self.success else 0.0
        return None

    def close(self) -> None:
        """Stop a per-episode server (a shared one keeps running for the next episode)."""
        connection, self.connection = getattr(self, "connection", None), None
        if connection is not None:
            type(self).server.release(connection)

    def _call(self, name: str, arguments: dict[str, Any]) -> Content:
        if self.connection is None:
            raise InfrastructureError("an MCP tool was called outside an episode (before reset() or after close())")
        result = self.connection.call(name, arguments)
        parts = result_parts(result)
        if result.is_error:
            raise McpToolError(joined_text(parts) or "the tool reported an error")
        if any(part["type"] == "image" for part in parts):
            return parts
        return joined_text(parts)


def _tool_function(name: str, description: str) -> Callable[..., Content]:
    def tool(self: McpEnv, **arguments: Any) -> Content:
        return self._call(name, arguments)

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = description
    return tool


def tool_problems(tools: list[Any]) -> list[str]:
    """Why some listed tools cannot be env tools: a name the env protocol or trajlab's tool discovery takes."""
    reserved = PROTOCOL_METHODS | {name for name in dir(McpEnv) if not name.startswith("_")} | {
        "expected", "connection", "server", "reward", "done", "success", "turn_rewards", "metrics", "episode_tools"}
    problems = []
    for tool in tools:
        if tool.name.startswith("_") or tool.name in reserved:
            problems.append(f"tool '{tool.name}' has a name trajlab's env protocol reserves")
    return problems


def mcp_env_class(server: McpServer, tools: list[Any]) -> type[McpEnv]:
    """An env class for ``server`` whose tools are ``tools`` (as ``tools/list`` gave them).

    Raises:
        UserError: a tool has a name the env protocol reserves.
    """
    if problems := tool_problems(tools):
        raise UserError(f"MCP server {server.label}: {'; '.join(problems)}; rename it in the server.")
    schemas = {tool.name: {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                                            "parameters": tool.input_schema}} for tool in tools}
    namespace: dict[str, Any] = {name: _tool_function(name, schema["function"]["description"])
                                 for name, schema in schemas.items()}
    namespace |= {"server": server, "_tool_schemas": schemas, "__module__": __name__,
                  "__doc__": f"Tools served by the MCP server {server.label}.\n\n{McpEnv.__doc__}"}
    return type("McpEnv", (McpEnv,), namespace)


def answer_matches(answer: str, expected: Any) -> bool:
    """Whether a final answer matches the expected one (or one of a list of them): equal once both are lowercased,
    their whitespace collapsed and the quotes, periods and spaces around them stripped."""
    accepted = expected if isinstance(expected, list) else [expected]
    return any(_normalized(answer) == _normalized(str(item)) for item in accepted)


def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip(" \"'`.").casefold()


def tasks_generator(rows: list[dict[str, Any]]) -> Callable[..., Iterator[dict[str, Any]]]:
    """A task generator over given rows: a row's ``split`` field places it, and without any such field every row
    is in every split; the order is shuffled by the seed."""
    split_field = any("split" in row for row in rows)

    def tasks(split: str, seed: int) -> Iterator[dict[str, Any]]:
        chosen = [row for row in rows if not split_field or row.get("split") == split]
        random.Random(seed).shuffle(chosen)
        yield from chosen

    return tasks


def mcp_spec(options: McpServerOptions, *, shared: bool, reset_tool: str | None,
             tasks: list[dict[str, Any]] | None = None, oracle: Oracle | None = None) -> EnvSpec:
    """The env of an MCP server: connects once to list its tools (a shared server stays running).

    Args:
        options: the server, its timeouts and sandbox settings (``trajlab.config.McpSettings``).
        shared: one server for all episodes instead of one per episode.
        reset_tool: with ``shared``, a tool called without arguments at each episode's start.
        tasks: rows (``prompt``, optional ``answer``, optional ``split``) RL and the other stages draw from; without
            them, tasks come from a tasks file (``--tasks``).
        oracle: a scripted policy of the server's tools (``policy oracle``, the collect stage's demonstrator).

    Raises:
        UserError: the server could not start or its ``tools/list`` answer is not MCP, it lists no tool, a tool has
            a reserved name, or ``reset_tool`` is not one of its tools.
    """
    server = McpServer(options, shared=shared, reset_tool=reset_tool)
    try:
        connection = server.first()
    except InfrastructureError as exc:  # before any episode: the config's server is wrong, the user's to fix
        raise UserError(f"{exc}. Check the mcp: section (docs/mcp.md).") from exc
    try:
        tools = connection.tools
        names = [tool.name for tool in tools]
        if not tools:
            raise UserError(f"MCP server {server.label} lists no tools: an env needs at least one.")
        if reset_tool is not None and reset_tool not in names:
            raise UserError(f"mcp.reset_tool '{reset_tool}' is not a tool of MCP server {server.label}; its tools: "
                            f"{', '.join(names)}.")
        env_cls = mcp_env_class(server, tools)
    finally:
        if not shared:
            connection.close()
    limits = EpisodeLimits(tool_timeout_s=options.call_timeout_s + _TIMEOUT_MARGIN_S)
    return EnvSpec(name="mcp", env_cls=env_cls, tasks=None if tasks is None else tasks_generator(tasks),
                   limits=limits, oracle=oracle, metadata={"mcp_server": server.label})
