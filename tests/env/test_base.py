import inspect

import pytest

from trajlab.env import Environment, load_env, tool_names, tool_schemas
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
        next(spec.iter_tasks("train"))
