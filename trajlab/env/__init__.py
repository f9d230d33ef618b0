"""Environments: the protocol, tool discovery and the registry."""

from trajlab.env.base import EnvHandle, Environment, ToolResult, tool_call_message, tool_names, tool_schemas
from trajlab.env.registry import EnvSpec, load_env, register, registered_names

__all__ = [
    "EnvHandle",
    "Environment",
    "EnvSpec",
    "ToolResult",
    "load_env",
    "register",
    "registered_names",
    "tool_call_message",
    "tool_names",
    "tool_schemas",
]
