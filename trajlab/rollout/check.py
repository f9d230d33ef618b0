"""``check_env``: the checks an env author runs in their own tests (Gymnasium's ``check_env``, for tool envs).

Everything is checked the way trajlab will use the env, so an env that passes also collects, trains and evaluates:
tool schemas derive from the methods, ``reset`` works on real tasks of every split, the protocol attributes have
their types, tools take validated arguments, ``close`` works, and the reference policy (if the spec has one) solves
its tasks through the real rollout engine in the tokens of the tiny offline model. Every problem is one sentence
saying what to fix; all of them are raised together in one :class:`EnvCheckError`.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from trajlab.chat.parsers import get_parser
from trajlab.env.base import HOOKS, EnvHandle, Environment, tool_names, tool_schema, tool_schemas
from trajlab.env.registry import EnvSpec, load_env
from trajlab.errors import UserError
from trajlab.rollout.engine import RolloutEngine
from trajlab.rollout.runner import Episode
from trajlab.rollout.types import task_id


class EnvCheckError(UserError):
    """An env failed :func:`check_env`; :attr:`problems` holds one sentence per problem."""

    def __init__(self, env: str, problems: list[str]) -> None:
        self.problems = problems
        listed = "\n".join(f"- {problem}" for problem in problems)
        super().__init__(f"Environment '{env}' failed {len(problems)} check(s):\n{listed}")


@dataclass(frozen=True)
class EnvCheckReport:
    """What :func:`check_env` checked when every check passed."""

    env: str
    tools: list[str]
    tasks: int
    """Tasks reset, checked and closed."""
    oracle_solved: int | None
    """Of those, solved by the reference policy through the engine (all of them); None when the spec has none."""


def check_env(
    env: EnvSpec | type | str,
    *,
    tasks: Sequence[Mapping[str, Any]] | None = None,
    tasks_per_split: int = 2,
    tokenizer: str | Path | PreTrainedTokenizerBase | None = None,
) -> EnvCheckReport:
    """Check an env the way trajlab will run it; meant for the env author's tests.

    Args:
        env: an ``EnvSpec``, an env class, or a registered name or import path (``my_pkg.envs:SPEC``).
        tasks: tasks to check with; default: the first ``tasks_per_split`` tasks (seed 0) of each of the spec's
            splits.
        tasks_per_split: how many tasks of each split to check when ``tasks`` is not given.
        tokenizer: whose tokens the reference policy's episodes are written in (a directory or a tokenizer);
            default: the tiny offline model's (built on first use, see ``trajlab.models.tiny.ensure_default_model``), or
            for an env whose tools return images the tiny vision-language model's (``trajlab.models.tiny_vision``).

    Returns:
        A small report of what was checked.

    Raises:
        EnvCheckError: listing every problem found, one sentence each.
    """
    spec = _as_spec(env)
    cls = spec.env_cls
    schema_problems = _schema_problems(cls)
    problems = schema_problems + _hook_problems(cls)
    chosen, task_problems = _tasks(spec, tasks, tasks_per_split)
    problems += task_problems
    passed = []
    for task in chosen:
        found = _episode_problems(spec, task)
        problems += found
        if not found:
            passed.append(task)
    solved = None
    if spec.oracle is not None and chosen:
        if schema_problems:  # the engine shows the model every tool's schema
            problems.append("The reference policy was not run: the tools need usable schemas first.")
        elif not passed:
            problems.append("The reference policy was not run: no task passed the checks above.")
        else:
            oracle_problems = _oracle_problems(spec, passed, tokenizer)
            problems += oracle_problems
            solved = len(passed) - len(oracle_problems)
    problems = list(dict.fromkeys(problems))  # the same problem on several tasks is said once
    if problems:
        raise EnvCheckError(spec.name, problems)
    return EnvCheckReport(env=spec.name, tools=tool_names(cls), tasks=len(chosen), oracle_solved=solved)


def _as_spec(env: EnvSpec | type | str) -> EnvSpec:
    if isinstance(env, EnvSpec):
        return env
    if isinstance(env, str):
        return load_env(env)
    return EnvSpec(name=env.__name__, env_cls=env)


def _schema_problems(cls: type) -> list[str]:
    """One sentence per tool whose schema cannot be derived (each names the tool and what to add)."""
    names = tool_names(cls)
    if not names:
        return [f"{cls.__name__} has no tools: every public method is a tool; give it at least one, with type hints "
                "and a Google-style docstring."]
    problems = []
    for name in names:
        try:
            tool_schema(cls, name)
        except TypeError as exc:
            problems.append(str(exc))
    if not problems:
        try:
            tool_schemas(cls)  # given schemas (``_tool_schemas``) must match the tools one to one
        except TypeError as exc:
            problems.append(str(exc))
    return problems


def _hook_problems(cls: type) -> list[str]:
    """Hooks that TRL would offer as tools (an env not subclassing Environment), and the hook's old name."""
    problems = []
    if hasattr(cls, "_next_user_message"):  # (an Environment subclass cannot have it: it fails at class creation)
        problems.append(f"{cls.__name__} defines _next_user_message, which is now the public hook "
                        "next_user_message: rename the method.")
    if not issubclass(cls, Environment):
        for name in HOOKS:
            if inspect.isfunction(getattr(cls, name, None)):
                problems.append(f"{cls.__name__}.{name} is a protocol hook, but TRL's GRPOTrainer would offer it to "
                                "the model as a tool: subclass trajlab.Environment, which hides hooks from tool "
                                "discovery.")
    return problems


def _tasks(
    spec: EnvSpec, tasks: Sequence[Mapping[str, Any]] | None, per_split: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """The tasks to check with, and the problems met getting them."""
    if tasks is not None:
        bad = [i for i, task in enumerate(tasks) if not isinstance(task, Mapping)]
        if bad:
            return [], [f"tasks[{bad[0]}] is a {type(tasks[bad[0]]).__name__}; a task is a dict of reset() "
                        "keyword arguments."]
        return [dict(task) for task in tasks], []
    if spec.tasks is None:
        return [], [f"'{spec.name}' has no task generator: pass tasks=[...] to check_env, or give its EnvSpec a "
                    "tasks(split, seed) function."]
    chosen, problems = [], []
    for split in spec.splits:
        try:
            found = list(itertools.islice(spec.iter_tasks(split, 0), per_split))
        except Exception as exc:
            problems.append(f"tasks({split!r}, 0) raised {type(exc).__name__}: {exc}.")
            continue
        if not found:
            problems.append(f"Split '{split}' has no tasks; list only the splits the generator fills in "
                            "EnvSpec.splits.")
        for task in found:
            if isinstance(task, dict):
                chosen.append(task)
            else:
                problems.append(f"tasks({split!r}, 0) yields {type(task).__name__}s; a task must be a dict of "
                                "reset() keyword arguments.")
                break
    return chosen, problems


def _episode_problems(spec: EnvSpec, task: dict[str, Any]) -> list[str]:
    """Make, reset and close one env for ``task`` as the engine would, and check what reset left."""
    cls, label = spec.env_cls.__name__, f"task {task_id(task)!r}"
    try:
        env = EnvHandle(spec.make())
    except Exception as exc:
        return [f"{cls}() raised {type(exc).__name__}: {exc}; an env is made with no arguments, once per episode."]
    problems = []
    reset_failed = False
    try:
        observation = env.reset(task)
    except Exception as exc:
        reset_failed = True
        problems.append(f"reset() raised {type(exc).__name__}: {exc} on {label}.")
    else:
        problems += _reset_problems(env, observation, task, label)
    try:
        env.close()
    except Exception as exc:  # no task in the sentence: the same failure on every task is said once
        after = " after reset() failed" if reset_failed else ""
        problems.append(f"close() raised {type(exc).__name__}: {exc}{after}; the engine closes every env when its "
                        "episode ends, however it ended.")
    return problems


def _reset_problems(env: EnvHandle, observation: Any, task: dict[str, Any], label: str) -> list[str]:
    cls = type(env.env).__name__
    problems = []
    if observation is None and "prompt" not in task:
        problems.append(f"reset() returned None on {label}, which has no 'prompt' field: return the first "
                        "observation (the user's first message).")
    elif observation is not None and not isinstance(observation, str):
        problems.append(f"reset() returned a {type(observation).__name__} on {label}; it must return the first "
                        "observation as a str (or None when the task has a 'prompt').")
    problems += env.attribute_problems()
    for name in HOOKS:
        if inspect.iscoroutinefunction(getattr(env.env, name, None)):
            problems.append(f"{cls}.{name} is async; protocol hooks must be plain methods (the engine runs them in "
                            "a thread).")
    names = tool_names(type(env.env))
    offered = env.episode_tools
    if isinstance(offered, list) and all(isinstance(s, dict) and isinstance(s.get("function"), dict) for s in offered):
        unknown = sorted({schema["function"].get("name") for schema in offered} - set(names), key=str)
        if unknown:
            problems.append(f"{cls}.episode_tools names {unknown} on {label}, which are not tools of the class: "
                            "offer only its public methods.")
    for name in names:
        try:
            env.tool(name)
        except Exception as exc:  # pydantic cannot validate some annotations
            problems.append(f"Tool {cls}.{name} cannot validate its arguments ({type(exc).__name__}: {exc}); use "
                            "JSON-like type hints (str, int, float, bool, list, dict, Literal, pydantic models).")
    return problems


def _oracle_problems(
    spec: EnvSpec, tasks: list[dict[str, Any]], tokenizer: str | Path | PreTrainedTokenizerBase | None
) -> list[str]:
    """Run the reference policy on ``tasks`` through the real engine; one sentence per task it did not solve."""
    from trajlab.inference.policy import oracle_policy  # torch: imported only when needed

    policy = oracle_policy(spec.oracle, tokenizer, spec.shows_images)
    episodes = [Episode(f"check:{index}", task) for index, task in enumerate(tasks)]
    with RolloutEngine(spec, policy.generator, policy.tokenizer, chat_template=policy.chat_template,
                       parser=get_parser("auto", policy.tokenizer), seed=0, processor=policy.processor) as engine:
        # not retried: an episode the env broke is what the check is for
        trajectories = asyncio.run(engine.run(episodes, concurrency=8, retries=0, retry_backoff_s=0.0))
    problems = []
    for trajectory in sorted(trajectories, key=lambda t: int(t.id.split(":")[1])):
        if trajectory.status == "success":
            continue
        why = f": {trajectory.error}" if trajectory.error else ""
        hint = " (raise EnvSpec.limits if its episodes need more)" if trajectory.status == "truncated" else ""
        problems.append(f"The reference policy did not solve task {task_id(trajectory.task)!r} through the engine: "
                        f"it ended {trajectory.status} ({trajectory.stop_reason}){why}{hint}.")
    return problems
