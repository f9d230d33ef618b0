"""Run a trajlab env inside TRL's GRPOTrainer: its tasks as dataset rows, its reward as a reward function.

A text env's class already follows the ``environment_factory`` contract; what TRL needs around it is a dataset whose
rows are ``reset`` keyword arguments plus a ``prompt``, and a reward function that reads each episode's env. A
mixture of envs maps onto TRL's dict ``environment_factory`` and its ``environment`` column.

Images need one adapter: TRL shows a vision-language model a tool's image only when the tool returns a list of
content blocks (``[{"type": "image", "image": <PIL image>}, ...]``) and ``str()``-s anything else, while a trajlab
tool may return a bare PIL image, encoded bytes or an array (:mod:`trajlab.env.content`). The classes
:func:`trl_environment_factory` gives normalise every tool result (and the first observation) the way trajlab's
engine does, so TRL gets what trajlab's model gets; the env's own class is left as it is. And TRL 1.16 passes all
that a vision-language model's image processor returns to the model, which Gemma 3's ``num_crops`` makes fail:
:func:`trl_processing_class` is the processor to give it. With both, a step trains on a first observation's image
and on a tool's (tests/env/test_trl_images.py, the tiny Gemma 3).
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
from collections.abc import Callable
from typing import Any

from datasets import Dataset

from trajlab.env.base import EnvHandle, tool_names
from trajlab.env.content import tool_content
from trajlab.env.mixture import EnvMixture
from trajlab.env.registry import EnvSpec
from trajlab.models.loading import forward_inputs


def trl_dataset(env: EnvSpec | EnvMixture, split: str, size: int, seed: int) -> Dataset:
    """``size`` tasks of a split as rows TRL passes to ``reset(**row)``.

    TRL appends ``reset``'s observation to the last prompt message, so the prompt is the env's system prompt and an
    empty user turn that the observation fills in. Rows of a mixture also carry TRL's ``environment`` column, which
    routes each row to its env in :func:`trl_environment_factory`'s dict.
    """
    rows = []
    for task in itertools.islice(env.iter_tasks(split, seed), size):
        spec = env.spec_for(task) if isinstance(env, EnvMixture) else env
        prompt = [{"role": "system", "content": spec.system_prompt or ""}, {"role": "user", "content": ""}]
        routing = {"environment": spec.name} if isinstance(env, EnvMixture) else {}
        rows.append({**task, **routing, "prompt": prompt})
    if not rows:
        raise ValueError(f"Environment '{env.name}' has no tasks in split '{split}'.")
    # Envs of a mixture have different task fields: every row gets every column (None where its env has none).
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return Dataset.from_dict({key: [row.get(key) for row in rows] for key in columns})


def trl_environment_factory(env: EnvSpec | EnvMixture | type) -> type | dict[str, type]:
    """GRPOTrainer's ``environment_factory``: the env's class as TRL's model should see it (see the module doc), or
    for a mixture a dict of such classes by env name.

    Each is a subclass of the env class with the same name, tools, signatures and docstrings (so the same tool
    schemas), whose tools and ``reset`` return content as :func:`~trajlab.env.content.tool_content` makes it: text as
    before, images as TRL's content blocks. A class is made once per env class.
    """
    if isinstance(env, EnvMixture):
        return {name: _trl_class(spec.env_cls) for name, spec in env.specs.items()}
    return _trl_class(env.env_cls if isinstance(env, EnvSpec) else env)


@functools.cache
def _trl_class(env_cls: type) -> type:
    members: dict[str, Any] = {name: _as_content(env_cls, name) for name in ["reset", *tool_names(env_cls)]}
    members |= {"__doc__": env_cls.__doc__, "__module__": env_cls.__module__, "__qualname__": env_cls.__qualname__}
    return type(env_cls.__name__, (env_cls,), members)


def _as_content(env_cls: type, name: str) -> Any:
    """The method ``name`` of ``env_cls`` returning message content; a staticmethod stays one, a coroutine one.

    The method is looked up on each call, so a patched or replaced method of the env class is the one that runs.
    """
    function: Callable[..., Any] = getattr(env_cls, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        return _content(getattr(env_cls, name)(*args, **kwargs))

    async def call_async(*args: Any, **kwargs: Any) -> Any:
        return _content(await getattr(env_cls, name)(*args, **kwargs))

    wrapper = functools.wraps(function)(call_async if inspect.iscoroutinefunction(function) else call)
    return staticmethod(wrapper) if isinstance(inspect.getattr_static(env_cls, name), staticmethod) else wrapper


def _content(value: Any) -> Any:
    """``reset`` may return None (no observation), which stays None."""
    return None if value is None else tool_content(value)


def trl_processing_class(processor: Any, model: Any) -> Any:
    """GRPOTrainer's ``processing_class`` for a vision-language model: ``processor``, except that its image processor,
    when TRL calls it directly (it does for a tool's images, TRL 1.16), gives only what ``model`` takes as input.

    Why: TRL passes everything the image processor returns to ``generate`` and to the training forward pass, and
    Gemma 3's also returns ``num_crops`` (for its own text expansion), which ``generate`` refuses. The processor's own
    ``__call__`` still gets the whole output.
    """
    adapted = copy.copy(processor)
    adapted.__class__ = _whole_output_inside(type(processor))
    adapted.image_processor = _ModelInputsOnly(processor.image_processor, forward_inputs(model))
    return adapted


class _ModelInputsOnly:
    """An image processor whose outputs are only those a model's forward accepts; anything else it delegates."""

    def __init__(self, inner: Any, accepted: frozenset[str]) -> None:
        self.inner, self.accepted = inner, accepted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.inner(*args, **kwargs)
        for name in [name for name in output if name not in self.accepted]:
            del output[name]
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@functools.cache
def _whole_output_inside(processor_cls: type) -> type:
    """``processor_cls`` whose ``__call__`` runs with the unfiltered image processor (it reads e.g. ``num_crops``)."""

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        filtered = self.image_processor
        self.image_processor = filtered.inner
        try:
            return processor_cls.__call__(self, *args, **kwargs)
        finally:
            self.image_processor = filtered

    return type(processor_cls.__name__, (processor_cls,), {"__call__": __call__, "__module__": __name__})


def env_reward(environments: list[Any], completions: list[Any] | None = None, **_: Any) -> list[float]:
    """TRL reward function: the reward each episode's env holds when the episode ends.

    An env of several user turns (``next_user_message``, e.g. BFCL) scores a turn when the model answers it; TRL runs
    only the first turn and never says it ended, so a final answer (a last assistant message without tool calls) is
    handed to the env first, as trajlab's engine would.
    """
    rewards = []
    for index, instance in enumerate(environments):
        env = EnvHandle(instance)
        answer = _final_answer(completions[index]) if completions is not None else None
        if answer is not None and not env.done:
            env.next_user_message(answer)
        rewards.append(env.reward)
    return rewards


def _final_answer(completion: Any) -> str | None:
    """The text of a conversational completion's last message, if it is an assistant answer (no tool call)."""
    if isinstance(completion, str):
        return completion
    last = completion[-1] if completion else None
    if not isinstance(last, dict) or last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    content = last.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content or "")
