"""Executing one tool call on an env: validation, timeout, and errors turned into observations.

A tool that raises, times out, or gets bad arguments never ends the episode: the model receives an error
observation that says what went wrong, and the error kind is counted in the trajectory's metrics.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from concurrent.futures import Executor
from typing import Any

import pydantic

from trajlab.env.base import ToolResult, bind_tool, describe_validation_error


async def execute_tool(
    env: Any,
    name: str,
    arguments: dict[str, Any],
    schemas: dict[str, dict[str, Any]],
    *,
    timeout_s: float,
    executor: Executor | None = None,
) -> ToolResult:
    """Run ``env.<name>(**arguments)`` with argument validation and a wall-clock limit.

    Synchronous tools run in ``executor`` so a slow tool does not block other episodes; a timed-out synchronous
    tool cannot be interrupted and finishes in the background, its result discarded. Untrusted commands belong in
    the sandbox, which kills them.
    """
    tool = bind_tool(env, name) if name in schemas else None
    if tool is None:
        available = ", ".join(sorted(schemas)) or "none"
        return ToolResult(f"Error: unknown tool '{name}'. Available tools: {available}.", "unknown_tool")
    try:
        if inspect.iscoroutinefunction(getattr(type(env), name)):
            value = await asyncio.wait_for(tool(**arguments), timeout_s)
        else:
            call = functools.partial(tool, **arguments)
            value = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(executor, call), timeout_s)
    except pydantic.ValidationError as exc:
        return ToolResult(describe_validation_error(name, exc, schemas[name]), "bad_arguments")
    except TimeoutError:
        return ToolResult(f"Error: tool '{name}' did not finish within {timeout_s:g} seconds.", "timeout")
    except Exception as exc:  # a tool's own bug is an observation for the model, not a crash of the rollout
        return ToolResult(f"Error: tool '{name}' failed: {type(exc).__name__}: {exc}", "exception")
    return ToolResult(value if isinstance(value, str) else str(value))
