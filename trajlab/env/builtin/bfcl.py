"""BFCL v4 multi-turn: conversations of several user turns over stateful backends, scored per turn by BFCL's rules.

The 800 entries of the four multi-turn categories of the Berkeley Function Calling Leaderboard (``base``,
``miss_func``, ``miss_param``, ``long_context``), run on the executable backends shipped in ``bfcl-eval`` (a file
system, messaging, posting, tickets, trading, travel booking, vehicle control, math). Each episode gets fresh backend
instances loaded with the entry's initial state and is offered the functions of its backends only. The user speaks
one turn at a time: the next user message arrives when the model answers (a turn without a tool call). In
``miss_func`` one function is held out until the turn where BFCL adds it; its doc then comes in a user message and it
becomes callable. A user turn may use at most ``max_steps_per_turn`` tool-calling model turns (BFCL's 20); beyond
that the turn is force-advanced and counts as failed.

Scoring follows ``bfcl_eval``'s multi-turn checker, turn by turn: at the end of a user turn its ground-truth calls run
on separate ground-truth instances (kept for the whole episode), then the turn is solved when the model made at least
one call in it, every backend's public state equals the ground truth's (state check), and the ground-truth results
of the turn are all among the model's results so far (response check). A turn whose ground truth is empty (a missing
function or parameter) is solved by making no call (BFCL's irrelevance check). The reward is the fraction of user
turns solved (unreached and force-advanced turns count as failed); success is all turns solved, BFCL's accuracy.
With ``check_irrelevance: false`` in a task, calls in such turns go unchecked, as in the leaderboard's checker.

Episodes are long: up to 8 user turns, so the reference policy (all of a turn's ground-truth calls in one message,
then a short answer) needs up to 15 model turns; with trajlab's tiny tokenizers prompts take 2k to 8k tokens, model
turns up to 3.5k and ``long_context`` episodes up to about 75k (file listings, long histories). The spec's limits
say so (16 model turns, 80,000 tokens per episode, 4,096 per turn); ``collect`` and ``eval`` use them unless told
otherwise.

Needs ``bfcl-eval`` (``pip install --no-deps bfcl-eval==2026.3.23 mpmath filelock``); without it, loading this env
raises :class:`~trajlab.errors.MissingDependency` and every other env works as before.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import random
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import version
from typing import Any

import pydantic

from trajlab.env.base import PROTOCOL_METHODS, Environment, bind_tool
from trajlab.env.builtin import bfcl_data
from trajlab.env.builtin._split import split_of
from trajlab.env.builtin.bfcl_data import (
    CATEGORIES,
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
    MAXIMUM_STEP_LIMIT,
    PROMPT_STYLE_TEMPLATES,
    Call,
    execute,
    ground_truth_calls,
    load_entry,
    response_checker,
    state_checker,
)
from trajlab.env.limits import EpisodeLimits
from trajlab.env.registry import EnvSpec

TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    name: bfcl_data.tool_schema(doc) for name, (_, doc) in bfcl_data.function_docs().items()
}
OWNER: dict[str, str] = {name: owner for name, (owner, _) in bfcl_data.function_docs().items()}


class BFCL(Environment):
    """BFCL v4 multi-turn conversations over stateful backends, scored turn by turn by BFCL's checker rules."""

    max_steps_per_turn: int = MAXIMUM_STEP_LIMIT
    """Tool-calling model turns allowed per user turn; one more force-advances the turn (BFCL force-quits there)."""
    check_irrelevance: bool = True
    """Whether a turn with empty ground truth must make no call; False scores it as solved whatever the model does,
    as ``multi_turn_checker`` alone (the leaderboard) does."""

    _tool_schemas: dict[str, dict[str, Any]] = TOOL_SCHEMAS  # the BFCL docs converted, instead of docstring schemas

    def __init__(self) -> None:
        super().__init__()
        self._callable: set[str] = set()

    def reset(self, **task: Any) -> str:
        """Start entry ``task_id``; optional ``max_steps_per_turn`` and ``check_irrelevance`` override the class's."""
        super().reset()
        self.success = False  # until every user turn is solved
        self._entry = load_entry(task["task_id"])
        if task.get("category", self._entry.category) != self._entry.category:
            raise ValueError(f"{task['task_id']} is in category '{self._entry.category}', not '{task['category']}'.")
        self.max_steps_per_turn = int(task.get("max_steps_per_turn", type(self).max_steps_per_turn))
        self.check_irrelevance = bool(task.get("check_irrelevance", type(self).check_irrelevance))
        self._model = bfcl_data.new_backends(self._entry)  # what the model's calls act on
        self._truth = bfcl_data.new_backends(self._entry)  # what the ground-truth calls act on, turn by turn
        self._held_out = bfcl_data.held_out_functions(self._entry)
        held_out = {name for names in self._held_out.values() for name in names}
        self.episode_tools = [TOOL_SCHEMAS[name] for owner in self._entry.involved_classes
                              for name in bfcl_data.functions_of(owner) if name not in held_out]
        self._callable = {schema["function"]["name"] for schema in self.episode_tools}
        self._turn = 0
        self._steps = 0  # model turns with tool calls in the current user turn (told by the engine)
        self._turn_calls = 0  # calls that reached a backend in the current user turn (also counted under TRL)
        self._results: list[str] = []  # every result of the model's calls, all turns: the response check reads them
        self._solved: list[bool] = []
        self.turn_rewards = []
        self.metrics = {"user_turns": len(self._entry.question), "turns_solved": 0, "turns_ended": 0,
                        "force_advanced": 0, "steps": 0, "tool_calls": 0}
        return self._user_message(0)

    def next_user_message(self, answer: str | None) -> str | None:
        """After an answer, score the turn and give the next one; after a tool-calling turn, enforce the step limit."""
        if self.done:
            return None
        if answer is None:
            self._steps += 1
            self.metrics["steps"] += 1
            if self._steps <= self.max_steps_per_turn:
                return None
            self.metrics["force_advanced"] += 1
            return self._end_turn(forced=True)
        return self._end_turn(forced=False)

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        """Every tool lands here: run the call on this episode's backend and keep its result for the checker."""
        if self.done:
            return "Error: the conversation is over; this call was not executed."
        if name not in self._callable:
            return f"Error: function '{name}' is not available in this conversation."
        result = execute(self._model[OWNER[name]], Call(name, arguments))
        self._results.append(result)
        self._turn_calls += 1
        self.metrics["tool_calls"] += 1
        return result

    def _end_turn(self, forced: bool) -> str | None:
        solved = self._score_turn(forced)
        self._solved.append(solved)
        users = len(self._entry.question)
        self.turn_rewards.append(1.0 / users if solved else 0.0)  # credited to the model turn that ended the turn
        self.metrics["turns_ended"] += 1
        self.metrics["turns_solved"] += int(solved)
        self.reward = sum(self._solved) / users
        self._turn += 1
        self._steps = self._turn_calls = 0
        if self._turn == users:
            self.done = True
            self.success = all(self._solved)
            return None
        return self._user_message(self._turn)

    def _score_turn(self, forced: bool) -> bool:
        """BFCL's per-turn check: the ground truth runs on its own instances (even when the turn failed) first."""
        truth = ground_truth_calls(self._entry.id)[self._turn]
        truth_results = [execute(self._truth[OWNER[call.name]], call) for call in truth]
        if forced:
            return False
        acted = self._steps > 0 or self._turn_calls > 0
        if not truth:
            return not acted or not self.check_irrelevance
        if not acted:  # BFCL: "Model response list is empty for turn N"
            return False
        return (state_checker(self._model, self._truth)["valid"]
                and response_checker(self._results, truth_results, self._turn)["valid"])

    def _user_message(self, turn: int) -> str:
        messages = self._entry.question[turn]
        if messages:
            return "\n".join(message["content"] for message in messages)
        # BFCL's held-out function turn: no user text; the function is added and announced.
        added = [TOOL_SCHEMAS[name] for name in self._held_out.get(turn, [])]
        self.episode_tools = [*self.episode_tools, *added]
        self._callable |= {schema["function"]["name"] for schema in added}
        return f"{json.dumps(added)}\n{DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC}"


def _tool_method(name: str) -> Callable[..., str]:
    """A public method for one BFCL function, with the backend's signature, typed hints and a docstring."""
    properties = TOOL_SCHEMAS[name]["function"]["parameters"]["properties"]
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for parameter in bfcl_data.method_signature(name).parameters.values():
        if parameter.name == "self":
            continue
        hint = bfcl_data.python_annotation(properties[parameter.name], optional=parameter.default is None)
        parameters.append(parameter.replace(annotation=hint))
    signature = inspect.Signature(parameters, return_annotation=str)

    def tool(*args: Any, **kwargs: Any) -> str:
        arguments = dict(signature.bind(*args, **kwargs).arguments)  # the given ones; raises TypeError like a def
        return arguments.pop("self")._call(name, arguments)

    tool.__name__ = name
    tool.__qualname__ = f"BFCL.{name}"
    tool.__doc__ = bfcl_data.tool_docstring(TOOL_SCHEMAS[name])
    tool.__signature__ = signature  # type: ignore[attr-defined]
    tool.__annotations__ = {p.name: p.annotation for p in parameters[1:]} | {"return": str}
    return tool


for _name in TOOL_SCHEMAS:
    if _name in PROTOCOL_METHODS or hasattr(BFCL, _name):
        raise TypeError(f"BFCL function '{_name}' would shadow an attribute of the env.")
    setattr(BFCL, _name, _tool_method(_name))


def split_of_index(index: int) -> str:
    """The split of entry index ``index`` in every category (about 70% train, 10% validation, 20% test).

    Entry i of each category is a variant of the same scenario, so the index, not the id, picks the split.
    """
    if split_of(f"bfcl-{index}") == "test":
        return "test"
    return "validation" if split_of(f"bfcl-validation-{index}", test_fraction=0.125) == "test" else "train"


def tasks(split: str, seed: int) -> Iterator[dict[str, Any]]:
    """The entries of one split, all categories mixed in a seeded order; a task is its id and category."""
    chosen = [(category, entry.index) for category in CATEGORIES for entry in bfcl_data.entries(category)
              if split_of_index(entry.index) == split]
    random.Random(seed).shuffle(chosen)
    for category, index in chosen:
        yield {"task_id": bfcl_data.entry_id(category, index), "category": category}


def task_problems(task: dict[str, Any]) -> list[str]:
    """A given task must name a BFCL entry (and, if it gives one, that entry's category): anything else fails every
    episode at ``reset``."""
    try:
        entry = bfcl_data.load_entry(str(task.get("task_id")))
    except ValueError as exc:
        return [str(exc).rstrip(".")]
    if task.get("category", entry.category) != entry.category:
        return [f"field 'category' is {task['category']!r}, but {entry.id} is in category {entry.category!r}"]
    return []


def replay(task: dict[str, Any], turns: Sequence[Sequence[Sequence[Call]]], env: BFCL | None = None) -> BFCL:
    """Play an episode without a model, as the rollout engine would: ``turns[t]`` holds the steps of user turn t,
    each step the calls of one model turn; every turn ends with an answer (unless the step limit ended it first).
    Returns the env, scored.

    Calls go through the same argument validation as the engine's (an invalid call is not executed).
    """
    env = env or BFCL()
    env.reset(**task)
    for steps in turns:
        if env.done:
            break
        for step in steps:
            for call in step:
                with contextlib.suppress(pydantic.ValidationError):
                    bind_tool(env, call.name)(**call.arguments)
            if env.next_user_message(None) is not None or env.done:
                break  # the step limit ended the turn; its remaining steps are not played
        else:
            env.next_user_message("Done.")
    return env


def ground_truth_steps(task_id: str) -> list[list[list[Call]]]:
    """The ground truth as the reference policy plays it: per user turn, one step with all its calls (or none)."""
    return [[list(calls)] if calls else [] for calls in ground_truth_calls(task_id)]


def oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference policy: per user turn, all its ground-truth calls in one message, then a short answer."""
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    calls = ground_truth_calls(task["task_id"])[len(users) - 1]
    acted = any(message.get("tool_calls") for message in messages[users[-1] + 1:])
    if calls and not acted:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": call.name, "arguments": call.arguments}} for call in calls
        ]}
    if not calls:
        return {"role": "assistant", "content": "I cannot do that with the functions and information I have."}
    return {"role": "assistant", "content": "Done."}


def one_call_oracle(task: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The reference's calls one per message, in the same order, then the same answer: for chat templates that allow
    a single tool call per assistant message (Llama 3.2's raises on more). Each turn is one more model turn."""
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    calls = ground_truth_calls(task["task_id"])[len(users) - 1]
    made = sum(len(message.get("tool_calls") or []) for message in messages[users[-1] + 1:])
    if made < len(calls):
        call = calls[made]
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
    if not calls:
        return {"role": "assistant", "content": "I cannot do that with the functions and information I have."}
    return {"role": "assistant", "content": "Done."}


_STYLE = PROMPT_STYLE_TEMPLATES["classic"]
SYSTEM_PROMPT = f"{_STYLE['persona']} {_STYLE['task']}\n\n{_STYLE['multiturn_behavior']}"

SPEC = EnvSpec(name="bfcl", env_cls=BFCL, tasks=tasks, oracle=oracle, system_prompt=SYSTEM_PROMPT,
               splits=("train", "validation", "test"), metadata={"bfcl_eval": version("bfcl-eval")},
               limits=EpisodeLimits(max_turns=16, max_episode_tokens=80_000, max_new_tokens=4096),
               references={"one_call_at_a_time": one_call_oracle}, check_task=task_problems)
