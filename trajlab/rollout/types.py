"""Trajectory records: plain, serialisable data (one JSON object per line in a trajectory file).

The token record is the training data; ``messages`` is the same episode as a readable OpenAI-style chat. The token
invariant ``len(completion_ids) == len(loss_mask) == len(logprobs)`` is checked whenever a record is built or read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from trajlab.rollout.images import decode_png, is_image_id

Status = Literal["success", "failure", "truncated", "error"]


def task_id(task: dict[str, Any]) -> str:
    """A task's identity within its env: its ``task_id`` field, else a hash of its content.

    The hash is over the task as JSON with sorted keys, so the same task gets the same id in every run and process
    (Python's ``hash`` is salted per process). Across envs, a task is ``(env, task_id(task))``: two envs may both
    have a task ``"0"``.
    """
    if "task_id" in task:
        return str(task["task_id"])
    return "task-" + _content_digest(task)[:12]


TaskKey = tuple[str, str]
"""A task across envs: ``(env, task_id)``."""


def task_key(env: str, task: dict[str, Any]) -> TaskKey:
    """The key of ``task`` run in env ``env``: two envs of a mixture may both have a task ``"0"``."""
    return env, task_id(task)


def task_hash(task: dict[str, Any]) -> str:
    """Eight hex digits of the task's whole content (JSON with sorted keys): a task edited under the same
    ``task_id`` gets another hash, so a collection's episode id (which carries it) makes it a new episode."""
    return _content_digest(task)[:8]


def _content_digest(task: dict[str, Any]) -> str:
    """sha256 of the task as JSON with sorted keys: the same in every run and process."""
    return hashlib.sha256(json.dumps(task, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


class TokenRecord(BaseModel):
    """Exact tokens of an episode.

    ``prompt_ids`` is the first prompt (system + first user turn + generation prompt). ``completion_ids`` holds
    everything after it in order: model tokens (``loss_mask`` 1, ``logprobs`` as sampled) and observation tokens
    (tool results, next prompts; ``loss_mask`` 0, ``logprobs`` None). Logprobs of model tokens are None when the
    policy could not report them (a scripted policy, a text-only server).

    ``trainer_logprobs`` is RL's record only (``rl/rollouts.jsonl``): the trained model's logprob of each model token
    before the step's first optimizer step, beside the sampler's, so a report can show where the two engines differ.
    Left out of the JSON when absent.
    """

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    trainer_logprobs: list[float | None] | None = Field(default=None, exclude_if=lambda value: value is None)

    @model_validator(mode="after")
    def _check_invariant(self) -> TokenRecord:
        n = len(self.completion_ids)
        if not (n == len(self.loss_mask) == len(self.logprobs)):
            raise ValueError(
                f"token invariant broken: {n} completion ids, {len(self.loss_mask)} loss-mask entries, "
                f"{len(self.logprobs)} logprobs"
            )
        if self.trainer_logprobs is not None and len(self.trainer_logprobs) != n:
            raise ValueError(
                f"token invariant broken: {n} completion ids, {len(self.trainer_logprobs)} trainer logprobs"
            )
        if any(bit not in (0, 1) for bit in self.loss_mask):
            raise ValueError("loss_mask entries must be 0 or 1")
        return self

    def extend(self, ids: list[int], *, trained: bool, logprobs: list[float | None] | None = None) -> None:
        """Append model tokens (``trained=True``) or observation tokens, keeping the three lists aligned."""
        if logprobs is None:
            logprobs = [None] * len(ids)
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(logprobs)} logprobs")
        self.completion_ids.extend(ids)
        self.loss_mask.extend([int(trained)] * len(ids))
        self.logprobs.extend(logprobs)


class Trajectory(BaseModel):
    """One episode: the task, the conversation, the tokens, the outcome."""

    model_config = ConfigDict(extra="forbid")

    id: str
    env: str
    task: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    reward: float
    status: Status
    metrics: dict[str, float] = Field(default_factory=dict)
    tokens: TokenRecord | None = None
    turn_rewards: list[float] | None = None
    stop_reason: str = ""
    error: str | None = None
    policy: str = ""
    split: str | None = None
    group: str | None = None
    """Rollouts with the same group are compared with each other for advantages (RL: one task's samples in a
    step); None outside RL."""
    images: list[str] = Field(default_factory=list, exclude_if=lambda value: not value)
    """The images the model saw, in the order of their placeholders in the tokens, by id (``<sha256>.png``, see
    :mod:`trajlab.rollout.images`); image parts of ``messages`` name them the same way. Left out of the JSON when
    there are none. The bytes travel with the trajectory in memory and live beside its file on disk."""
    branches: list[TokenRecord] | None = Field(default=None, exclude_if=lambda value: value is None)
    """For a chat template that rewrites history: one token record per model turn (the template's rendering of the
    conversation before the turn, then the turn's tokens), and ``tokens`` is None. Training reads them through
    :func:`trajlab.rollout.samples.turn_samples`. Left out of the JSON when absent."""
    template_context: dict[str, Any] = Field(default_factory=dict, exclude_if=lambda value: not value)
    """What the chat template rendered with besides the messages (:class:`trajlab.chat.context.TemplateContext`'s
    record: ``kwargs`` such as ``enable_thinking``, the pinned ``date``), so the drift guard renders it the same way
    on any later day. Left out of the JSON when empty."""
    _image_data: dict[str, bytes] = PrivateAttr(default_factory=dict)
    _image_dir: Path | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_branches(self) -> Trajectory:
        if self.branches is not None and self.tokens is not None:
            raise ValueError("a trajectory holds either one token record (tokens) or one per turn (branches)")
        return self

    @model_validator(mode="after")
    def _check_images(self) -> Trajectory:
        if bad := [image for image in self.images if not is_image_id(image)]:
            raise ValueError(f"images must be ids like '<sha256>.png', got {bad[:3]}")
        return self

    def attach_images(self, data: dict[str, bytes] | None = None, directory: str | Path | None = None) -> None:
        """Give the trajectory its images' bytes (``data``, by id) or the folder that holds them."""
        self._image_data.update(data or {})
        if directory is not None:
            self._image_dir = Path(directory)

    def image_png(self, image_id: str) -> bytes:
        """The PNG bytes of one of the trajectory's images."""
        if image_id in self._image_data:
            return self._image_data[image_id]
        if self._image_dir is None or not is_image_id(image_id):
            raise FileNotFoundError(f"trajectory {self.id}: image {image_id} is not in memory, its folder unknown")
        return (self._image_dir / image_id).read_bytes()

    def image(self, image_id: str) -> Any:
        """One of the trajectory's images as an RGB PIL image, decoded from the bytes the sampler decoded."""
        return decode_png(self.image_png(image_id))
