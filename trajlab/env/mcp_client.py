"""One MCP server session, used from synchronous env code: the MCP Python SDK's client on a background event loop.

Why: the rollout engine calls env tools synchronously from worker threads, and the SDK is async (anyio). One daemon
thread per process runs an asyncio loop; each :class:`McpConnection` keeps its SDK ``Client`` open in a task on it
(the SDK's context managers must be entered and left in one task) and hands calls to it from any thread.

A stdio server is started by the SDK's ``stdio_client`` with an argv that runs it in a :class:`~trajlab.sandbox.Sandbox`
(its own bwrap, namespaces, uid and rlimits; it sees only the system, its sandbox directory and the read-only paths
the config names, and no network). A streamable-HTTP server is the user's own process, reached at its URL.

What the server does wrong is the machinery's failure, not the model's: a server that cannot start, dies, hangs past
the call timeout or answers what is not MCP raises :class:`~trajlab.errors.InfrastructureError`, and the connection
is marked broken (:attr:`McpConnection.alive`) so that its owner starts a new one. A tool's own failure (an
``isError`` result, or a JSON-RPC error such as unknown arguments) is the model's to read.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import tempfile
import threading
from collections.abc import Sequence
from typing import IO, Any, Protocol

from trajlab.errors import InfrastructureError, require
from trajlab.sandbox import Sandbox, SandboxError, SandboxLimits

_CLOSE_WAIT_S = 10.0  # the SDK's own shutdown (close stdin, SIGTERM, SIGKILL) takes at most about 6 s
_STDERR_TAIL = 600  # characters of a dead server's stderr quoted in the error
_CONNECTION_CLOSED, _REQUEST_TIMEOUT = -32000, -32001  # JSON-RPC codes the SDK gives a dead or silent server


class McpServerOptions(Protocol):
    """What a connection needs to know of the server (``trajlab.config.McpSettings`` is one)."""

    command: list[str] | None
    url: str | None
    env: dict[str, str]
    read_only_paths: list[str]
    call_timeout_s: float
    startup_timeout_s: float
    server_cpu_s: int
    server_memory_mb: int


class McpToolError(Exception):
    """A tool call the server answered with an error (``isError``, or a JSON-RPC error): the model reads it."""


def _loop() -> asyncio.AbstractEventLoop:
    """The process's MCP event loop, started on first use in a daemon thread."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="trajlab-mcp-loop", daemon=True).start()
        return _LOOP


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def root_cause(error: BaseException) -> BaseException:
    """The first leaf of nested exception groups (anyio's task groups wrap what the SDK raises)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


class McpConnection:
    """An open session with one MCP server: its tools (``tools/list``, all pages) and calls to them.

    Args:
        options: the server and its timeouts and sandbox settings.
        label: how errors name the server.
    """

    def __init__(self, options: McpServerOptions, label: str) -> None:
        self.options, self.label = options, label
        self.tools: list[Any] = []  # mcp_types.Tool, as listed when the session opened
        self.alive = False
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._sandbox: Sandbox | None = None
        self._stderr: IO[str] | None = None
        self._open()

    def _open(self) -> None:
        mcp = require("mcp", feature="env: mcp", install="pip install 'trajlab[mcp]'")
        from mcp.client.stdio import stdio_client

        target: Any = self.options.url
        if self.options.command is not None:
            # the server's stderr, quoted when it fails; open as long as the connection (closed by close())
            self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")  # noqa: SIM115
            try:
                self._sandbox = Sandbox(SandboxLimits(cpu_seconds=self.options.server_cpu_s,
                                                      memory_bytes=self.options.server_memory_mb << 20),
                                        read_only_paths=self.options.read_only_paths)
            except SandboxError as exc:  # e.g. a read-only path the sandbox's uid cannot reach
                raise InfrastructureError(f"MCP server {self.label} could not start: {exc} (mcp.read_only_paths)") \
                    from exc
            argv, environment = self._sandbox.process_argv(self.options.command)
            parameters = mcp.StdioServerParameters(command=argv[0], args=argv[1:], cwd=str(self._sandbox.path),
                                                   env={**environment, **self.options.env})
            target = stdio_client(parameters, errlog=self._stderr)
        ready: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        holder = asyncio.run_coroutine_threadsafe(self._hold(mcp.Client, target, ready), _loop())
        try:
            self.tools = ready.result(self.options.startup_timeout_s)
        except concurrent.futures.TimeoutError:
            holder.cancel()
            tail = self._tail()
            self.close()
            raise InfrastructureError(f"MCP server {self.label} did not start within "
                                      f"{self.options.startup_timeout_s:g} s (mcp.startup_timeout_s){tail}") from None
        except BaseException as exc:
            tail = self._tail()
            self.close()
            cause = root_cause(exc)
            raise InfrastructureError(f"MCP server {self.label} could not start: {type(cause).__name__}: "
                                      f"{_one_line(cause)}{tail}") from exc
        self.alive = True

    async def _hold(self, client_cls: type, target: Any, ready: concurrent.futures.Future[list[Any]]) -> None:
        """Open the session, list the tools, and keep the session open until :meth:`close`."""
        self._stop = asyncio.Event()
        try:
            async with client_cls(target, read_timeout_seconds=self.options.call_timeout_s, cache=None) as client:
                tools, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    if (cursor := page.next_cursor) is None:
                        break
                self._client = client
                ready.set_result(tools)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
        finally:
            self.alive = False
            self._ended.set_result(None)

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """Call tool ``name`` and return its ``CallToolResult``.

        Raises:
            McpToolError: the server answered the call with a JSON-RPC error (an unknown tool or bad arguments).
            InfrastructureError: the server is gone, did not answer within ``call_timeout_s``, or answered what is
                not MCP; the connection is then broken for good.
        """
        from mcp import MCPError

        if not self.alive:
            raise InfrastructureError(f"MCP server {self.label} is not running{self._tail()}")
        timeout = self.options.call_timeout_s
        future = asyncio.run_coroutine_threadsafe(self._client.call_tool(name, arguments), _loop())
        try:
            return future.result(timeout + 5)  # the SDK times the call out itself; this guards against a stuck loop
        except MCPError as exc:
            if exc.error.code not in (_CONNECTION_CLOSED, _REQUEST_TIMEOUT):
                raise McpToolError(exc.error.message) from exc
            self._break()
            what = (f"did not answer tools/call '{name}' within {timeout:g} s (mcp.call_timeout_s)"
                    if exc.error.code == _REQUEST_TIMEOUT else f"closed the connection during tools/call '{name}'")
            raise InfrastructureError(f"MCP server {self.label} {what}{self._tail()}") from exc
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._break()
            raise InfrastructureError(f"MCP server {self.label} did not answer tools/call '{name}' within "
                                      f"{timeout:g} s (mcp.call_timeout_s){self._tail()}") from None
        except Exception as exc:  # a result the SDK could not read: the server does not speak MCP
            self._break()
            raise InfrastructureError(f"MCP server {self.label} answered tools/call '{name}' with what is not MCP: "
                                      f"{type(exc).__name__}: {_one_line(exc)}{self._tail()}") from exc

    def _break(self) -> None:
        self.alive = False

    def close(self) -> None:
        """End the session; a stdio server is stopped (the SDK closes its stdin, then kills its process group) and
        its sandbox removed. Idempotent."""
        self.alive = False
        if self._stop is not None:
            _loop().call_soon_threadsafe(self._stop.set)
            with contextlib.suppress(concurrent.futures.TimeoutError):
                self._ended.result(_CLOSE_WAIT_S)
        if self._sandbox is not None:
            self._sandbox.cleanup()
            self._sandbox = None
        if self._stderr is not None:
            self._stderr.close()

    def _tail(self) -> str:
        """The end of a stdio server's stderr, as a suffix of an error message ("" when it wrote none)."""
        if self._stderr is None:
            return ""
        with contextlib.suppress(ValueError, OSError):  # already closed
            self._stderr.flush()
            self._stderr.seek(0)
            text = self._stderr.read().strip()
            if text:
                return f"; its stderr ends: {_one_line(text[-_STDERR_TAIL:])}"
        return ""


def _one_line(value: object) -> str:
    return " ".join(str(value).split())


def result_parts(result: Any) -> list[dict[str, Any]]:
    """A ``CallToolResult``'s content as parts: text (text, and embedded text resources), images (decoded bytes);
    anything else (audio, links, binary resources) as a line of text saying what it was."""
    parts: list[dict[str, Any]] = []
    for item in result.content:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append({"type": "text", "text": item.text})
        elif kind == "image":
            parts.append({"type": "image", "image": base64.b64decode(item.data)})
        elif kind == "resource" and hasattr(item.resource, "text"):
            parts.append({"type": "text", "text": item.resource.text})
        elif kind == "resource_link":
            parts.append({"type": "text", "text": f"[resource {item.uri}]"})
        else:
            parts.append({"type": "text", "text": f"[{kind or type(item).__name__} content, not shown]"})
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append({"type": "text", "text": json.dumps(result.structured_content)})
    return parts


def joined_text(parts: Sequence[dict[str, Any]]) -> str:
    return "\n".join(part["text"] for part in parts if part["type"] == "text")
