"""MCP servers for the tests: one written with the SDK (``MCPServer``), one speaking JSON-RPC by hand that breaks the
protocol on purpose. Each runs as its own process: ``python mcp_servers.py sdk stdio``, ``... sdk http PORT`` or
``python mcp_servers.py raw MODE``; the sandboxed ones see only this file and the venv's packages.
"""

import io
import json
import os
import sys
import time


def png(color: tuple[int, int, int]) -> bytes:
    """A 4x4 PNG of one color (PIL is in the venv the servers run from)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), color).save(buffer, format="PNG")
    return buffer.getvalue()


def sdk_server():  # noqa: ANN201 (the SDK's type, imported here only)
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.utilities.types import Image

    server = MCPServer("trajlab-test")
    count = {"value": 0}

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def red_square() -> Image:
        """A small red image."""
        return Image(data=png((255, 0, 0)), format="png")

    @server.tool()
    def fail(reason: str) -> str:
        """Always fails with the given reason."""
        raise ValueError(reason)

    @server.tool()
    def bump() -> int:
        """Count one more and return the count (state that lives as long as the server)."""
        count["value"] += 1
        return count["value"]

    @server.tool()
    def restart_count() -> str:
        """Set the count back to zero (the reset hook of a shared server)."""
        count["value"] = 0
        return "ok"

    @server.tool()
    def pid() -> int:
        """The server's process id, to tell a restarted server from the first."""
        return os.getpid()

    @server.tool()
    def whoami() -> str:
        """The server's uid and host name (in the sandbox: its own uid, host name 'sandbox')."""
        import socket

        return f"{os.getuid()} {socket.gethostname()}"

    @server.tool()
    def hang(seconds: float) -> str:
        """Sleep, blocking the whole server."""
        time.sleep(seconds)
        return "woke"

    @server.tool()
    def die() -> str:
        """Exit the server process at once, mid-call."""
        os._exit(3)

    return server


def raw_server(mode: str) -> None:
    """A hand-written stdio server: newline-delimited JSON-RPC 2.0, MCP's initialize, tools/list and tools/call.

    ``bad_schema`` lists a tool whose inputSchema is not an object schema; ``garbage`` answers tools/call with a line
    that is not JSON; ``silent`` never answers initialize.
    """
    tools = [{"name": "ok", "description": "Fine.", "inputSchema": {"type": "object", "properties": {}}}]
    if mode == "bad_schema":
        tools.append({"name": "broken", "description": "Its schema is a string.", "inputSchema": {"type": "string"}})
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message:
            continue  # a notification
        method, reply = message["method"], None
        if method == "initialize":
            if mode == "silent":
                continue
            reply = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                     "serverInfo": {"name": "raw", "version": "0"}}
        elif method == "tools/list":
            reply = {"tools": tools}
        elif method == "tools/call":
            if mode == "garbage":
                sys.stdout.write("this is not json\n")
                sys.stdout.flush()
                continue
            reply = {"content": [{"type": "text", "text": "fine"}], "isError": False}
        if reply is None:
            answer = {"jsonrpc": "2.0", "id": message["id"], "error": {"code": -32601, "message": "no such method"}}
        else:
            answer = {"jsonrpc": "2.0", "id": message["id"], "result": reply}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1] == "raw":
        raw_server(sys.argv[2])
    elif sys.argv[2] == "stdio":
        sdk_server().run("stdio")
    else:
        sdk_server().run("streamable-http", host="127.0.0.1", port=int(sys.argv[3]))
