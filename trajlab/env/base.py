"""The environment protocol: an env class whose public methods are tools, plus a few named hooks and attributes.

The contract is TRL's ``environment_factory`` contract, so a trajlab env also runs inside TRL's GRPOTrainer:
``reset(**task)`` starts an episode and returns the first observation, every public function defined on the
class (other than ``reset``) is a tool, and the env holds its own ``reward``. trajlab adds the attributes ``done``,
``success``, ``turn_rewards``, ``metrics`` and ``episode_tools``, which the rollout engine reads after each step,
and two hooks it calls: ``next_user_message`` (conversations of several user turns) and ``close`` (the end of an
episode's life, as in Gymnasium).

Hooks are public names, yet must never be offered to the model as tools. Tool discovery (TRL's and
:func:`tool_names`) lists the *functions* found on the class, so :class:`Environment` stores each hook, its own and a
subclass's override, as a small descriptor: a method on an instance, not a function on the class. An env that does
not subclass :class:`Environment` works too (:class:`EnvHandle` reads it), but TRL would offer its hooks as tools;
``trajlab.check_env`` says so.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FunctionType, MethodType
from typing import Any

import pydantic

from trajlab.env.content import Content

HOOKS = ("next_user_message", "close")
"""Methods the engine calls on an env; never tools."""

PROTOCOL_METHODS = frozenset({"reset", "get_reward", *HOOKS})
"""Names that are part of the protocol, never tools: TRL's (``reset``, ``get_reward``) and trajlab's hooks."""


class _Hook:
    """A protocol hook stored on an env class: the bound method on an instance, a non-function on the class.

    Reading it on the class gives this object, which :func:`inspect.isfunction` rejects, so tool discovery skips it;
    calling it with the instance first (``Environment.close(env)``) still works.
    """

    def __init__(self, func: FunctionType) -> None:
        self.__func__ = func
        functools.update_wrapper(self, func)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return self if instance is None else MethodType(self.__func__, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(*args, **kwargs)


class Environment:
    """Base class for trajlab environments (subclassing is optional: any class with the same shape works).

    Attributes:
        reward: the episode reward so far; the env sets it, the engine reads it when the episode ends.
        done: set to True when the episode is over (solved or failed); the engine stops the episode.
        success: optional verdict; when left as None, success means ``reward >= 1.0``.
        turn_rewards: optional dense rewards, one entry appended per tool call the env handles; the engine sums
            them per model turn for turn-level credit. Without it, a turn's reward is its change in ``reward``.
        metrics: numbers worth logging for this episode (e.g. ``{"guesses": 4}``); other values are not logged.
        episode_tools: optional JSON schemas of the tools offered in this episode (a subset of the class's tools);
            None offers them all. The prompt shows the list as it is after ``reset``; a tool added to the list later
            (announced to the model in a user message) becomes callable from then on.

    Subclasses override the hooks :meth:`next_user_message` and :meth:`close` as plain methods; the class stores
    them so that no tool discovery lists them (see the module docstring).
    """

    reward: float
    done: bool
    success: bool | None
    turn_rewards: list[float] | None
    metrics: dict[str, float]
    episode_tools: list[dict[str, Any]] | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_next_user_message" in vars(cls):
            raise TypeError(f"{cls.__qualname__}._next_user_message is now the public hook next_user_message: "
                            "rename the method.")
        for name in HOOKS:
            if isinstance(vars(cls).get(name), FunctionType):
                setattr(cls, name, _Hook(vars(cls)[name]))

    def __init__(self) -> None:
        Environment.reset(self)

    def reset(self, **task: Any) -> str | None:
        """Start an episode for one task (a dataset row) and return the first observation, if any. Sets the
        protocol's attributes to a new episode's (also what a fresh instance starts with)."""
        self.reward = 0.0
        self.done = False
        self.success = None
        self.turn_rewards = None
        self.metrics = {}
        self.episode_tools = None
        return None

    @_Hook
    def next_user_message(self, answer: str | None) -> str | None:
        """The user's next message after a model turn, or None to let the episode go on (or end) as usual.

        Called after every model turn that parsed: ``answer`` is the turn's text when it made no tool call (the
        model answered the user), None when it called tools. Returning a message continues the episode with it as a
        new user turn (after the tool results, if any); an env without more user turns keeps this default. Under
        TRL, only the first user turn runs (``trajlab.env.trl.env_reward`` hands the final answer to this hook).
        """
        return None

    @_Hook
    def close(self) -> None:
        """Release what the episode holds (processes, files, connections); the engine calls it once per episode.

        Called when the episode ends, however it ends (also after a ``reset`` or a tool that raised), on the same
        kind of worker thread as the tools; an exception is recorded in the trajectory's ``error``.
        """


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Each protocol attribute: its default when an env lacks it, what it must be, and the check.
_ATTRIBUTES: dict[str, tuple[Any, str, Callable[[Any], bool]]] = {
    "reward": (0.0, "a number", _is_number),
    "done": (False, "a bool", lambda v: isinstance(v, bool)),
    "success": (None, "None or a bool", lambda v: v is None or isinstance(v, bool)),
    "turn_rewards": (None, "None or a list of numbers",
                     lambda v: v is None or (isinstance(v, list) and all(map(_is_number, v)))),
    "metrics": ({}, "a dict of numbers by name", lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v)),
    "episode_tools": (None, "None or a list of tool schemas (dicts with a 'function' entry)",
                      lambda v: v is None or (isinstance(v, list) and all(isinstance(s, dict) and "function" in s
                                                                          for s in v))),
}


class EnvHandle:
    """Typed access to one env instance, whether or not its class subclasses :class:`Environment`.

    Code that runs envs (the rollout engine, ``trajlab.check_env``, TRL's reward function) reads the protocol
    through this class only: an attribute or hook the env lacks reads as its default (no reward, not done, no other
    user turn, nothing to close), so duck-typed envs keep working.
    """

    __slots__ = ("env",)

    def __init__(self, env: Any) -> None:
        self.env = env

    @property
    def reward(self) -> float:
        return float(getattr(self.env, "reward", 0.0) or 0.0)

    @property
    def done(self) -> bool:
        return bool(getattr(self.env, "done", False))

    @property
    def success(self) -> bool:
        """The env's verdict, or ``reward >= 1.0`` when it gives none."""
        verdict = getattr(self.env, "success", None)
        return bool(verdict) if verdict is not None else self.reward >= 1.0

    @property
    def turn_rewards(self) -> list[float] | None:
        rewards = getattr(self.env, "turn_rewards", None)
        return None if rewards is None else [float(r) for r in rewards]

    @property
    def metrics(self) -> dict[str, float]:
        """The env's numeric metrics (other values are not logged)."""
        values = getattr(self.env, "metrics", None) or {}
        return {name: float(value) for name, value in values.items() if _is_number(value)}

    @property
    def episode_tools(self) -> list[dict[str, Any]] | None:
        return getattr(self.env, "episode_tools", None)

    def reset(self, task: Mapping[str, Any]) -> str | None:
        return self.env.reset(**task)

    def next_user_message(self, answer: str | None) -> str | None:
        hook = getattr(self.env, "next_user_message", None)
        return None if hook is None else hook(answer)

    def close(self) -> None:
        hook = getattr(self.env, "close", None)
        if hook is not None:
            hook()

    def tool(self, name: str) -> Callable[..., Any] | None:
        """The tool ``name`` with argument validation (see :func:`bind_tool`), or None."""
        return bind_tool(self.env, name)

    def attribute_problems(self) -> list[str]:
        """One sentence per protocol attribute of the wrong type; ``reward`` and ``done`` must exist."""
        problems = []
        owner = type(self.env).__name__
        for name, (_, expected, valid) in _ATTRIBUTES.items():
            if not hasattr(self.env, name):
                if name in ("reward", "done"):
                    problems.append(f"{owner} has no '{name}' attribute after reset(); set it there (it must be "
                                    f"{expected}).")
                continue
            value = getattr(self.env, name)
            if not valid(value):
                problems.append(f"{owner}.{name} is {value!r:.60} ({type(value).__name__}) after reset(); it must "
                                f"be {expected}.")
        return problems


def tool_names(env_cls: type) -> list[str]:
    """Names of the tools of an env class, with TRL's rule: public functions defined on the class, minus the
    protocol's names (which only a class that does not subclass :class:`Environment` shows as functions)."""
    return [
        name
        for name, _ in inspect.getmembers(env_cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in PROTOCOL_METHODS
    ]


def tool_schema(env_cls: type, name: str) -> dict[str, Any]:
    """The JSON schema of one tool, derived from its type hints and Google docstring by transformers.

    An env whose tools are specified elsewhere (BFCL's function docs) gives their schemas as a class attribute
    ``_tool_schemas`` mapping each tool name to its schema; those are used as they are.

    Raises:
        TypeError: the tool lacks type hints or a docstring entry; the message names the tool and what to add.
    """
    from transformers.utils import get_json_schema  # here: importing transformers takes a second

    given = getattr(env_cls, "_tool_schemas", None)
    if given is not None and name in given:
        return given[name]
    try:
        return get_json_schema(getattr(env_cls, name))
    except Exception as exc:  # transformers raises its own error types; re-raise with the env's name
        raise TypeError(
            f"Tool {env_cls.__name__}.{name} has no usable schema: {exc}. Every public method is a tool and "
            "needs type hints on its arguments and a Google-style docstring with an 'Args:' entry per argument "
            "(prefix the name with '_' if it is not meant to be a tool)."
        ) from exc


def tool_schemas(env_cls: type) -> list[dict[str, Any]]:
    """JSON schemas of all tools of an env class, in :func:`tool_names` order (see :func:`tool_schema`).

    Raises:
        TypeError: a tool has no usable schema, or ``_tool_schemas`` does not have exactly one schema per tool.
    """
    names = tool_names(env_cls)
    given = getattr(env_cls, "_tool_schemas", None)
    if given is not None and sorted(given) != names:
        raise TypeError(f"{env_cls.__name__}._tool_schemas must have one schema per tool: tools without one "
                        f"{sorted(set(names) - set(given))}, schemas of no tool {sorted(set(given) - set(names))}.")
    return [tool_schema(env_cls, name) for name in names]


@dataclass
class ToolResult:
    """What one tool call returned: the observation (text, or text and image parts: see
    :mod:`trajlab.env.content`), and the error kind if the call failed."""

    content: Content
    error: str | None = None  # "unknown_tool" | "bad_arguments" | "exception" | "timeout" | "episode_over"


# Argument validators by env class and tool name: pydantic builds a schema per function, which costs far more than
# a typical tool call, so it is built once per class (with whether the tool is a staticmethod, left unbound).
_VALIDATED: weakref.WeakKeyDictionary[type, dict[str, tuple[Callable[..., Any], bool]]] = weakref.WeakKeyDictionary()


def bind_tool(env: Any, name: str) -> Callable[..., Any] | None:
    """The env's tool ``name`` wrapped with argument validation, or None if there is no such tool."""
    cls = type(env)
    validated, static = _VALIDATED.setdefault(cls, {}).get(name, (None, False))
    function = getattr(cls, name, None)
    if validated is None or getattr(validated, "__wrapped__", None) is not function:  # new, or the tool replaced
        if name not in tool_names(cls):
            return None
        validated = pydantic.validate_call(function, config=pydantic.ConfigDict(arbitrary_types_allowed=True))
        static = isinstance(inspect.getattr_static(cls, name), staticmethod)
        _VALIDATED[cls][name] = validated, static
    return validated if static else validated.__get__(env, cls)


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
