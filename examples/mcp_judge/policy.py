"""The scripted demonstrator of the example's collect stage (``mcp.oracle``): an MCP server brings tools but no
policy that uses them, and the tiny offline model calls no tool before it has seen some. It calls ``convert`` with
the task's numbers, then answers with what the tool returned."""

from __future__ import annotations

from typing import Any

from trajlab.env.base import tool_call_message


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The next assistant message: the conversion, then the tool's result as the answer."""
    results = [message["content"] for message in messages if message["role"] == "tool"]
    if not results:
        return tool_call_message("convert", {"value": task["value"], "from_unit": task["from_unit"],
                                             "to_unit": task["to_unit"]})
    return {"role": "assistant", "content": str(results[-1]).strip()}
