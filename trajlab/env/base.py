"""The environment protocol: an env class whose public methods are tools.

The contract is TRL's ``environment_factory`` contract, so a trajlab env also runs inside TRL's GRPOTrainer:
``reset(**task)`` starts an episode and returns the first observation, every public function defined on the
class (other than ``reset``) is a tool, and the env holds its own ``reward``. trajlab adds ``done``, ``metrics``
and optional ``turn_rewards`` / ``success``, all plain attributes the rollout engine reads after each step.

Two optional extensions serve envs whose episodes differ in shape (BFCL's multi-turn conversations): an env may set
``episode_tools`` in ``reset`` to show the model only some of its tools this episode, and may define
``_next_user_message`` to hold a conversation of several user turns. Both stay outside TRL's tool discovery, which
ignores attributes and names starting with ``_``; under TRL such an env runs its first user turn with every tool.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic
from transformers.utils import get_json_schema

# Names that are part of the protocol, never tools. Mirrors TRL's discovery rule (``reset`` and ``get_reward``).
PROTOCOL_METHODS = frozenset({"reset", "get_reward"})


class Environment:
    """Base class for trajlab environments (subclassing is optional: any class with the same shape works).

    Attributes:
        reward: the episode reward so far; the env sets it, the engine reads it when the episode ends.
        done: set to True when the episode is over (solved or failed); the engine stops the episode.
        success: optional verdict; when left as None, success means ``reward >= 1.0``.
        turn_rewards: optional dense rewards, one entry appended per tool call the env handles; the engine sums
            them per model turn for turn-level credit. Without it, a turn's reward is its change in ``reward``.
        metrics: numbers worth logging for this episode (e.g. ``{"guesses": 4}``).
        episode_tools: optional JSON schemas of the tools offered in this episode (a subset of the class's tools);
            None offers them all. The prompt shows the list as it is after ``reset``; a tool added to the list later
            (announced to the model in a user message) becomes callable from then on.
    """

    reward: float
    done: bool
    success: bool | None
    turn_rewards: list[float] | None
    metrics: dict[str, float]
    episode_tools: list[dict[str, Any]] | None

    def __init__(self) -> None:
        self.reward = 0.0
        self.done = False
        self.success = None
        self.turn_rewards = None
        self.metrics = {}
        self.episode_tools = None

    def reset(self, **task: Any) -> str | None:
        """Start an episode for one task (a dataset row) and return the first observation, if any."""
        self.reward = 0.0
        self.done = False
        self.success = None
        self.turn_rewards = None
        self.metrics = {}
        self.episode_tools = None
        return None

    def _next_user_message(self, answer: str | None) -> str | None:
        """The user's next message after a model turn, or None to let the episode go on (or end) as usual.

        Called after every model turn that parsed: ``answer`` is the turn's text when it made no tool call (the
        model answered the user), None when it called tools. Returning a message continues the episode with it as a
        new user turn (after the tool results, if any); an env without more user turns keeps this default.
        """
        return None


def tool_names(env_cls: type) -> list[str]:
    """Names of the tools of an env class, with TRL's rule: public functions defined on the class, minus reset."""
    return [
        name
        for name, _ in inspect.getmembers(env_cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in PROTOCOL_METHODS
    ]


def tool_schemas(env_cls: type) -> list[dict[str, Any]]:
    """JSON schemas of the tools, derived from type hints and Google docstrings by transformers.

    An env whose tools are specified elsewhere (BFCL's function docs) gives their schemas as a class attribute
    ``_tool_schemas`` mapping each tool name to its schema; those are used as they are.

    Raises:
        TypeError: if a tool lacks type hints or a docstring entry; the message names the tool and what to add.
    """
    given = getattr(env_cls, "_tool_schemas", None)
    if given is not None:
        names = tool_names(env_cls)
        if sorted(given) != names:
            raise TypeError(f"{env_cls.__name__}._tool_schemas must have one schema per tool: tools without one "
                            f"{sorted(set(names) - set(given))}, schemas of no tool {sorted(set(given) - set(names))}.")
        return [given[name] for name in names]
    schemas = []
    for name in tool_names(env_cls):
        try:
            schemas.append(get_json_schema(getattr(env_cls, name)))
        except Exception as exc:  # transformers raises its own error types; re-raise with the env's name
            raise TypeError(
                f"Tool {env_cls.__name__}.{name} has no usable schema: {exc}. Every public method is a tool and "
                "needs type hints on its arguments and a Google-style docstring with an 'Args:' entry per argument "
                "(prefix the name with '_' if it is not meant to be a tool)."
            ) from exc
    return schemas


@dataclass
class ToolResult:
    """What one tool call returned: the observation text, and the error kind if the call failed."""

    content: str
    error: str | None = None  # "unknown_tool" | "bad_arguments" | "exception" | "timeout" | "episode_over"


def bind_tool(env: Any, name: str) -> Callable[..., Any] | None:
    """The env's tool ``name`` wrapped with argument validation, or None if there is no such tool."""
    if name not in tool_names(type(env)):
        return None
    return pydantic.validate_call(getattr(env, name), config=pydantic.ConfigDict(arbitrary_types_allowed=True))


def describe_validation_error(name: str, error: pydantic.ValidationError, schema: dict[str, Any]) -> str:
    """An error message for the model: which arguments were wrong and what the tool expects."""
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "arguments"
        if item["type"] == "unexpected_keyword_argument":
            problems.append(f"unknown argument '{where}'")
        elif item["type"] == "missing_argument":
            problems.append(f"missing required argument '{where}'")
        else:
            problems.append(f"argument '{where}': {item['msg']} (got {item.get('input')!r})")
    params = schema["function"]["parameters"]
    signature = ", ".join(
        f"{arg}: {spec.get('type', 'any')}" + ("" if arg in params.get("required", []) else " (optional)")
        for arg, spec in params.get("properties", {}).items()
    )
    return f"Error: bad arguments for tool '{name}': {'; '.join(problems)}. Expected {name}({signature})."


def tool_call_message(name: str, arguments: dict[str, Any], content: str = "") -> dict[str, Any]:
    """An assistant message making one tool call, in the chat-template convention (arguments as a dict)."""
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }
