import inspect

import pydantic
import pytest

from trajlab.env import EnvHandle, Environment, load_env, tool_names, tool_schemas
from trajlab.env.base import bind_tool
from trajlab.env.registry import EnvSpec


class Toy(Environment):
    """A toy env."""

    def reset(self, **task):
        super().reset()
        return "hi"

    def look(self, target: str, times: int = 1) -> str:
        """Look at something.

        Args:
            target: what to look at
            times: how many times
        """
        return target * times

    def _helper(self) -> None:
        pass

    @classmethod
    def factory(cls) -> "Toy":
        return cls()


def test_tools_follow_trl_discovery_rule():
    # TRL's GRPOTrainer: inspect.getmembers(type(env), isfunction), minus reset/get_reward and private names.
    trl_rule = [
        name
        for name, _ in inspect.getmembers(Toy, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]
    assert tool_names(Toy) == trl_rule == ["look"]


def test_schema_comes_from_hints_and_docstring():
    (schema,) = tool_schemas(Toy)
    params = schema["function"]["parameters"]
    assert schema["function"]["name"] == "look"
    assert params["properties"]["target"] == {"type": "string", "description": "what to look at"}
    assert params["required"] == ["target"]


def test_tool_without_hints_gets_a_clear_error():
    class Bad(Environment):
        def poke(self, x):
            """Poke."""

    with pytest.raises(TypeError, match=r"Bad\.poke.*type hints"):
        tool_schemas(Bad)


def test_unknown_env_suggests_closest():
    with pytest.raises(ValueError, match="Did you mean 'arithmetic'") as info:
        load_env("arithmetc")
    assert "guess" in str(info.value)


def test_env_by_import_path():
    spec = load_env(f"{__name__}:Toy")
    assert isinstance(spec, EnvSpec) and spec.env_cls is Toy and spec.description == "A toy env."
    with pytest.raises(ValueError, match="Cannot load environment"):
        load_env("no_such_module_xyz:Env")
    with pytest.raises(ValueError, match="no task generator"):
        next(spec.iter_tasks("train", seed=0))


class Hooked(Toy):
    """A toy env overriding both hooks."""

    def next_user_message(self, answer):
        return None if answer is None else "again"

    def close(self):
        self.closed = True
        super().close()


def trl_discovery(env_cls):
    """TRL GRPOTrainer's exact expression for an environment's tools (grpo_trainer.py, per batch)."""
    return [
        member_name
        for member_name, _ in inspect.getmembers(env_cls, predicate=inspect.isfunction)
        if member_name not in ("reset", "get_reward") and not member_name.startswith("_")
    ]


def test_protocol_hooks_are_public_methods_that_no_tool_discovery_lists():
    assert trl_discovery(Environment) == [] and tool_names(Environment) == []
    assert trl_discovery(Hooked) == tool_names(Hooked) == ["look"]
    env = Hooked()
    assert env.next_user_message("done") == "again" and env.next_user_message(None) is None
    env.close()
    assert env.closed
    assert Environment.next_user_message(env, "x") is None  # called through the class with the instance, too
    assert "Release what the episode holds" in Environment.close.__doc__


def test_a_subclass_with_the_old_private_hook_name_is_refused():
    with pytest.raises(TypeError, match=r"_next_user_message is now the public hook next_user_message"):
        class Old(Environment):
            def _next_user_message(self, answer):
                return None


class Duck:
    """An env that does not subclass Environment: no attributes until a tool sets them, its own hooks."""

    def reset(self, **task):
        return "go"

    def poke(self, times: int) -> str:
        """Poke.

        Args:
            times: how often
        """
        self.reward = float(times)
        return "ok"

    def close(self) -> None:
        self.closed = True


def test_env_handle_reads_a_duck_typed_env_with_the_protocols_defaults():
    duck = Duck()
    env = EnvHandle(duck)
    assert tool_names(Duck) == ["poke"], "a duck-typed env's hooks are not trajlab tools"
    assert (env.reward, env.done, env.success, env.turn_rewards, env.metrics, env.episode_tools) == (
        0.0, False, False, None, {}, None)
    assert env.next_user_message("hi") is None
    env.close()
    assert duck.closed
    env.tool("poke")(times="2")
    assert env.reward == 2.0 and env.success
    assert env.attribute_problems() == ["Duck has no 'done' attribute after reset(); set it there (it must be a bool)."]


def test_tool_validators_are_built_once_per_class_and_bound_per_instance():
    first, second = bind_tool(Toy(), "look"), bind_tool(Toy(), "look")
    assert first.__func__ is second.__func__ and first.__self__ is not second.__self__
    assert second(target="a", times="2") == "aa"
    with pytest.raises(pydantic.ValidationError):
        second(target="a", times="many")
    assert bind_tool(Toy(), "close") is None and bind_tool(Toy(), "nope") is None

    class Replaced(Toy):
        pass

    before = bind_tool(Replaced(), "look")
    Replaced.look = lambda self, target: target.upper()  # a tool replaced after first use gets a new validator
    assert bind_tool(Replaced(), "look")(target="b") == "B" and before(target="b") == "b"
