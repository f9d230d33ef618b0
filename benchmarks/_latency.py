"""A latency wrapper for benchmark envs: every tool sleeps first, standing in for a sandbox or an API."""

from __future__ import annotations

import functools
import time
from typing import Any

from trajlab.env.base import tool_names
from trajlab.env.registry import EnvSpec


def slow_tools(spec: EnvSpec, latency_s: float) -> EnvSpec:
    """``spec`` with every tool sleeping ``latency_s`` before it runs (a latency wrapper, for benchmarks only)."""

    def slowed(tool: Any) -> Any:
        @functools.wraps(tool)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            time.sleep(latency_s)
            return tool(self, *args, **kwargs)

        return call

    tools = {name: slowed(getattr(spec.env_cls, name)) for name in tool_names(spec.env_cls)}
    slow_cls = type(f"SlowTools{spec.env_cls.__name__}", (spec.env_cls,), tools)
    return EnvSpec(name=f"slow_{spec.name}", env_cls=slow_cls, tasks=spec.tasks, oracle=spec.oracle,
                   system_prompt=spec.system_prompt, splits=spec.splits, limits=spec.limits)
