"""check_env on every built-in env, and on broken user envs written outside the repository and imported by path."""

import importlib
import sys
import textwrap

import pytest

import trajlab
from trajlab import EnvCheckError, check_env
from trajlab.env import load_env
from trajlab.env.registry import EnvSpec, registered_names
from trajlab.errors import UserError


@pytest.mark.parametrize("name", sorted(registered_names()))
def test_every_builtin_env_passes(name, tiny_model_dir, tiny_vision_dir):
    spec = load_env(name)
    report = check_env(name, tokenizer=tiny_vision_dir if spec.shows_images else tiny_model_dir)
    assert report.env == name and report.tasks == 2 * len(spec.splits)
    assert report.oracle_solved == report.tasks and report.tools == [t["function"]["name"] for t in spec.tools]


BROKEN = '''
from trajlab import Environment, EnvSpec


class Broken(Environment):
    """Breaks in every way check_env looks for."""

    def reset(self, **task):
        super().reset()
        if task.get("explode"):
            raise RuntimeError("no such level")
        self.reward = "zero"
        return "Go."

    def poke(self, target):
        """Poke something."""
        return "ok"

    def close(self):
        raise OSError("socket already closed")


class Parrot(Environment):
    """Say the word back."""

    def reset(self, **task):
        super().reset()
        self.word = task["word"]
        return f"Say {self.word}."

    def say(self, word: str) -> str:
        """Say a word.

        Args:
            word: the word to say
        """
        self.done, self.reward = True, float(word == self.word)
        return "Said."


def tasks(split, seed):
    yield {"task_id": f"{split}-0", "word": "hi"}
    yield {"task_id": f"{split}-1", "word": "ho", "explode": split == "test"}


def gives_up(task, messages):
    return {"role": "assistant", "content": "No idea."}


def says_bye(task, messages):
    if messages[-1]["role"] == "user":
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "say", "arguments": {"word": "bye"}}}]}
    return {"role": "assistant", "content": "Done."}


BROKEN = EnvSpec(name="broken", env_cls=Broken, tasks=tasks, oracle=gives_up)
PARROT = EnvSpec(name="parrot", env_cls=Parrot, tasks=tasks, oracle=says_bye)
'''


@pytest.fixture
def user_envs(tmp_path, monkeypatch):
    """A user's module of envs, in a directory outside the repository, imported by its path."""
    (tmp_path / "user_envs_for_check.py").write_text(textwrap.dedent(BROKEN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("user_envs_for_check")
    sys.modules.pop("user_envs_for_check", None)


def test_a_broken_env_gets_one_sentence_per_problem(user_envs, tiny_model_dir):
    with pytest.raises(EnvCheckError) as info:
        check_env("user_envs_for_check:BROKEN", tokenizer=tiny_model_dir)
    error = info.value
    assert isinstance(error, UserError)
    assert error.problems == [
        "Tool Broken.poke has no usable schema: Argument target is missing a type hint in function poke. Every "
        "public method is a tool and needs type hints on its arguments and a Google-style docstring with an 'Args:' "
        "entry per argument (prefix the name with '_' if it is not meant to be a tool).",
        "Broken.reward is 'zero' (str) after reset(); it must be a number.",
        "close() raised OSError: socket already closed; the engine closes every env when its episode ends, however "
        "it ended.",
        "reset() raised RuntimeError: no such level on task 'test-1'.",
        "close() raised OSError: socket already closed after reset() failed; the engine closes every env when its "
        "episode ends, however it ended.",
        "The reference policy was not run: the tools need usable schemas first.",
    ]
    assert str(error).startswith("Environment 'broken' failed 6 check(s):\n- Tool Broken.poke")


def test_a_reference_policy_that_fails_is_named_per_task(user_envs, tiny_model_dir):
    with pytest.raises(EnvCheckError) as info:
        check_env(user_envs.PARROT, tokenizer=tiny_model_dir)
    assert info.value.problems == [
        f"The reference policy did not solve task '{task}' through the engine: it ended failure (env_done)."
        for task in ("train-0", "train-1", "test-0", "test-1")
    ]
    report = check_env(user_envs.PARROT, tasks=[{"task_id": "a", "word": "bye"}], tokenizer=tiny_model_dir)
    assert (report.tasks, report.oracle_solved, report.tools) == (1, 1, ["say"])


class Duck:
    """Not an Environment: its close() would be a tool under TRL."""

    def reset(self, **task):
        return None

    def look(self, at: str) -> str:
        """Look.

        Args:
            at: where
        """
        return at

    def close(self) -> None:
        pass


def test_a_class_without_tasks_or_oracle_and_with_visible_hooks(tiny_model_dir):
    with pytest.raises(EnvCheckError) as info:
        check_env(Duck)
    assert info.value.problems == [
        "Duck.close is a protocol hook, but TRL's GRPOTrainer would offer it to the model as a tool: subclass "
        "trajlab.Environment, which hides hooks from tool discovery.",
        "'Duck' has no task generator: pass tasks=[...] to check_env, or give its EnvSpec a tasks(split, seed) "
        "function.",
    ]
    with pytest.raises(EnvCheckError) as info:
        check_env(EnvSpec(name="duck", env_cls=Duck), tasks=[{"task_id": "t"}, "not a task"])
    assert info.value.problems[1] == "tasks[1] is a str; a task is a dict of reset() keyword arguments."
    with pytest.raises(EnvCheckError) as info:
        check_env(EnvSpec(name="duck", env_cls=Duck), tasks=[{"task_id": "t"}])
    assert info.value.problems[1:] == [
        "reset() returned None on task 't', which has no 'prompt' field: return the first observation (the user's "
        "first message).",
        "Duck has no 'reward' attribute after reset(); set it there (it must be a number).",
        "Duck has no 'done' attribute after reset(); set it there (it must be a bool).",
    ]
    assert trajlab.check_env is check_env
