"""Session recordings -> trajectories (``trajlab traces export``): exact tokens, merged by prefix, forked on edits.

A session file holds one record per call (``recording.py``). An agent that keeps appending to its conversation sends
prompts that each start with the previous prompt plus the previous completion, so its calls merge into one
append-only token history: one trajectory. The merge is decided on token ids alone, never on text:

- a call **extends** an open sample when its prompt ids start with the sample's whole history (prompt plus every
  completion and observation so far, stop tokens included). The prompt ids after that prefix are observation
  tokens (tool results, the next user turn, the template's newline after ``<|im_end|>``: loss 0, logprob None);
  the choice's ids are model tokens (loss 1, their recorded logprobs). When several samples match, the longest
  history wins.
- any other call (the history was edited, summarised or cut, a retry from an earlier point, an unrelated
  auxiliary request) **forks**: it opens a new sample from its own prompt. Tokens of two histories never mix.
- images: an image's tokens are the same whatever its pixels, so a call extends a sample only when its prompt's
  images (by id, in order) also start with the sample's. The trajectory keeps them (``images``, image parts in its
  messages) and the trajectory store writes their files beside the output, copied from the session's image folder.

Choices: each call contributes its choice ``choice`` (default 0; a call without that choice contributes nothing).
With ``all_choices`` the other choices of an ``n > 1`` call become forks of their own (a copy of the history so
far plus that choice), so a later call that continued from one of them extends that fork.

Auxiliary calls (a title generator, a summariser) are dropped before merging by ``DropRule`` s: ``KEY=REGEX``
matched with ``re.search`` against a field of the call: ``system`` (the first system/developer message, "" when
none), ``tools`` (the request's tool names joined by ",", "" when none: ``tools=^$`` drops calls without tools),
``model``, ``endpoint``.

The end of a sample: when the template renders the final assistant message as exactly the recorded completion plus
a tail (ChatML's ``\\n`` after ``<|im_end|>``; ``<|im_end|>\\n`` when the completion ran out of tokens), the tail is
appended with loss 0, as the rollout engine does, so ``decode(prompt_ids + completion_ids)`` equals the template's
rendering of ``messages``; ``metrics["template_match"]`` says whether it does. The text of ids is the server's
(:func:`trajlab.chat.utf8.shown_text`): a reply that ended inside a character was returned without it.

Outcome: a recording has no verifier. ``reward`` (a ``module:function`` taking the Trajectory and returning a float,
or ``(float, success)``; a float alone means success when it is > 0) scores each sample. Unscored samples get reward
0 and status ``failure`` (``truncated`` when the last completion ran out of tokens): an unknown outcome is not a
success, so ``trajlab dataset --kind sft`` keeps them only with ``--include-failures``.
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from trajlab.chat.context import TemplateContext
from trajlab.chat.template import ChatTemplate, image_ids, reasoning_field
from trajlab.chat.utf8 import shown_text
from trajlab.data.store import TrajectoryStore, image_dir
from trajlab.proxy.openai_format import to_template_messages, validate_tools
from trajlab.proxy.recording import RECORD_SCHEMA, read_session
from trajlab.rollout.images import decode_png
from trajlab.rollout.types import TokenRecord, Trajectory

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
DROP_KEYS = ("system", "tools", "model", "endpoint")

RewardFn = Callable[[Trajectory], "float | tuple[float, bool]"]


@dataclass(frozen=True)
class DropRule:
    """Drop a call when ``pattern`` is found (``re.search``) in its field ``key`` (one of ``DROP_KEYS``)."""

    key: str
    pattern: re.Pattern[str]

    @classmethod
    def parse(cls, text: str) -> DropRule:
        """``KEY=REGEX``, e.g. ``system=^Summari[sz]e`` or ``tools=^$``.

        Raises:
            ValueError: no ``=``, an unknown key, or an invalid regex.
        """
        key, sep, pattern = text.partition("=")
        if not sep or key not in DROP_KEYS:
            raise ValueError(f"--drop-if takes KEY=REGEX with KEY one of {', '.join(DROP_KEYS)}; got {text!r}.")
        try:
            return cls(key, re.compile(pattern))
        except re.error as exc:
            raise ValueError(f"--drop-if {text!r}: invalid regex: {exc}") from exc

    def matches(self, record: dict[str, Any]) -> bool:
        return self.pattern.search(call_fields(record)[self.key]) is not None


def call_fields(record: dict[str, Any]) -> dict[str, str]:
    """The fields drop rules look at, as strings."""
    request = record.get("request") if isinstance(record.get("request"), dict) else {}
    messages = request.get("messages") or []
    system = next((m.get("content") for m in messages if isinstance(m, dict) and m.get("role") in
                   ("system", "developer")), "")
    tools = [t.get("function", {}).get("name", "") for t in request.get("tools") or [] if isinstance(t, dict)]
    return {"system": system if isinstance(system, str) else str(system), "tools": ",".join(tools),
            "model": str(record.get("model", "")), "endpoint": str(record.get("endpoint", ""))}


@dataclass
class Sample:
    """One append-only token history being rebuilt, and what its last call was."""

    index: int
    tokens: TokenRecord
    record: dict[str, Any]
    choice: dict[str, Any]
    calls: int = 0
    tool_calls: int = 0
    parse_errors: int = 0
    wall_s: float = 0.0
    history: list[int] = field(default_factory=list)
    """``prompt_ids + completion_ids``, kept up to date so matching a call does not rebuild it."""
    images: list[str] = field(default_factory=list)
    """The ids of the images whose tokens ``history`` holds, in order."""
    turns: list[tuple[int, int]] = field(default_factory=list)
    """Where each call's reply lies in ``history`` (start, end): its prompt was ``history[:start]``."""

    def extended_by(self, prompt_ids: list[int], images: list[str]) -> bool:
        """Whether a prompt continues this history: its ids and its images start with the sample's."""
        return prompt_ids[:len(self.history)] == self.history and images[:len(self.images)] == self.images

    def add(self, record: dict[str, Any], prompt_ids: list[int], images: list[str], choice: dict[str, Any]) -> None:
        """Append one call: the new prompt tokens as observation, the choice as model tokens."""
        self.tokens.extend(prompt_ids[len(self.history):], trained=False)
        self.tokens.extend(list(choice["token_ids"]), trained=True, logprobs=list(choice["logprobs"]))
        self.history = prompt_ids + list(choice["token_ids"])
        self.turns.append((len(prompt_ids), len(self.history)))
        self.images = list(images)
        self.record, self.choice = record, choice
        self.calls += 1
        self.tool_calls += len((choice.get("message") or {}).get("tool_calls") or [])
        self.parse_errors += bool(choice.get("parse_errors"))
        self.wall_s += float(record.get("duration_s") or 0.0)


@dataclass
class SessionSamples:
    """The samples rebuilt from one session file, and what was left out."""

    session: str
    samples: list[Sample]
    calls: int = 0
    dropped: int = 0
    skipped: int = 0


def rebuild_session(
    records: Iterable[dict[str, Any]],
    session: str,
    *,
    choice: int = 0,
    all_choices: bool = False,
    drop: Iterable[DropRule] = (),
) -> SessionSamples:
    """Merge a session's calls into append-only samples (see the module docstring for the rules)."""
    drop = list(drop)
    out = SessionSamples(session, [])
    for record in records:
        if record.get("schema") != RECORD_SCHEMA:
            raise ValueError(f"session {session!r}: not a {RECORD_SCHEMA} record: {record.get('schema')!r}")
        if record.get("status") != 200 or not record.get("choices") or record.get("endpoint") not in (CHAT,
                                                                                                       COMPLETIONS):
            out.skipped += 1
            continue
        if any(rule.matches(record) for rule in drop):
            out.dropped += 1
            continue
        out.calls += 1
        for prompt_index, prompt in enumerate(record["prompts"]):
            choices = [c for c in record["choices"] if c.get("prompt_index", 0) == prompt_index]
            if choice >= len(choices):
                continue
            order = [choices[choice]] + ([c for i, c in enumerate(choices) if i != choice] if all_choices else [])
            _add_call(out.samples, record, list(prompt["token_ids"]), list(prompt.get("images") or []), order)
    return out


def _add_call(samples: list[Sample], record: dict[str, Any], prompt_ids: list[int], images: list[str],
              choices: list[dict[str, Any]]) -> None:
    """Extend the sample with the longest matching history with ``choices[0]``; every other choice forks."""
    base: Sample | None = None
    for sample in samples:
        if len(sample.history) <= len(prompt_ids) and sample.extended_by(prompt_ids, images) and (
                base is None or len(sample.history) > len(base.history)):
            base = sample
    before = copy.deepcopy(base) if base is not None and len(choices) > 1 else None
    for i, choice in enumerate(choices):
        if i == 0 and base is not None:
            target = base
        elif before is not None:
            target = copy.deepcopy(before)
            target.index = len(samples)
            samples.append(target)
        else:
            empty = TokenRecord(prompt_ids=prompt_ids, completion_ids=[], loss_mask=[], logprobs=[])
            target = Sample(len(samples), empty, record, choice, history=list(prompt_ids))
            samples.append(target)
        target.add(record, prompt_ids, images, choice)


def to_trajectory(
    sample: Sample,
    session: str,
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    *,
    env: str = "recorded",
    reward: RewardFn | None = None,
    processor: Any = None,
    image_folder: Path | None = None,
) -> Trajectory:
    """The trajectory of one sample: its tokens, the last call's conversation, and its score when ``reward`` is set.

    Args:
        sample: a sample from ``rebuild_session``.
        session: the session id (the trajectory id is ``session:sample``).
        tokenizer: the served model's tokenizer, to render the final conversation and its closing tokens.
        template: the chat template the server rendered with (``resolve_chat_template(tokenizer)``).
        env: the ``env`` field (``recorded`` unless the session ran against a known env).
        reward: scores the trajectory; see the module docstring.
        processor: the served model's processor, needed when the sample holds images.
        image_folder: the session's image folder (``<session>.images``), when the sample holds images.

    Raises:
        FileNotFoundError: an image of the sample is not in ``image_folder``.
        ValueError: the sample holds images but ``processor`` or ``image_folder`` is None.
    """
    record, choice = sample.record, sample.choice
    tools = validate_tools((record.get("request") or {}).get("tools"))  # as the server rendered them
    pngs: dict[str, bytes] = {}
    if sample.images:
        if processor is None or image_folder is None:
            raise ValueError(f"session {session!r} holds images: export it with the served model's processor (its "
                             "vision-language model directory as --tokenizer) and the session's image folder")
        pngs = {image_id: (image_folder / image_id).read_bytes() for image_id in sample.images}
    context = TemplateContext.from_record(record.get("template_context"))  # what the server rendered with
    tokens, branches, messages, match = sample.tokens.model_copy(deep=True), None, [], 0.0
    if record["endpoint"] == CHAT:
        sent = [*record["request"]["messages"], choice["message"]]
        messages = to_template_messages(sent, reasoning_field(template))
        chat = ChatTemplate(tokenizer, tools, template, context=context)
        if sample.calls > 1 and not pngs and not chat.preserves_prefixes:
            tokens, (branches, match) = None, _turn_branches(sample, chat, messages)
        else:
            match = _close(tokens, sample, chat, messages, processor, pngs)
    truncated = choice.get("finish_reason") == "length"
    model_tokens = sum(tokens.loss_mask) if tokens is not None else sum(len(b.loss_mask) for b in branches or [])
    trajectory = Trajectory(
        id=f"{session}:{sample.index}",
        env=env,
        task={"session": session, "sample": sample.index},
        messages=messages,
        tools=tools,
        reward=0.0,
        status="truncated" if truncated else "failure",
        metrics={"turns": float(sample.calls), "tool_calls": float(sample.tool_calls),
                 "parse_errors": float(sample.parse_errors), "model_tokens": float(model_tokens),
                 "wall_s": sample.wall_s, "template_match": match, "scored": 0.0},
        tokens=tokens,
        branches=branches,
        stop_reason="max_new_tokens" if truncated else str(choice.get("finish_reason") or ""),
        policy=str(record.get("model", "")),
        images=sample.images,
        template_context=context.record(),
    )
    trajectory.attach_images(pngs)
    return apply_reward(trajectory, reward) if reward is not None else trajectory


def _close(tokens: TokenRecord, sample: Sample, chat: ChatTemplate, messages: list[dict[str, Any]], processor: Any,
           pngs: dict[str, bytes]) -> float:
    """Append the template's tail after the last reply to ``tokens`` (loss 0); whether they now show exactly the
    template's rendering of ``messages`` (``metrics["template_match"]``)."""
    full = chat.render(messages)
    head = sample.record["prompts"][0]["text"] + shown_text(chat.tokenizer, sample.choice["token_ids"])
    if full.startswith(head):
        tokens.extend(chat.tokenizer.encode(full[len(head):], add_special_tokens=False), trained=False)
    decoded = shown_text(chat.tokenizer, tokens.prompt_ids + tokens.completion_ids)
    if pngs:  # the ids hold each image's tokens where the text holds its placeholder: expand it as they do
        images = [decode_png(pngs[image_id]) for image_id in image_ids(messages)]
        expanded = processor(text=full, images=images, add_special_tokens=False)["input_ids"][0]
        full = chat.tokenizer.decode(expanded, skip_special_tokens=False)
    return float(decoded == full)


def _turn_branches(sample: Sample, chat: ChatTemplate,
                   messages: list[dict[str, Any]]) -> tuple[list[TokenRecord], float]:
    """One token record per call, for a template that rewrites history (gpt-oss drops a call's reasoning once an
    answer follows): the call's prompt as served and its reply, as the rollout engine branches such episodes. The
    float says whether each prompt is the template's rendering of the conversation before that reply."""
    first, ids = len(sample.tokens.prompt_ids), sample.history
    branches = [TokenRecord(prompt_ids=ids[:start], completion_ids=ids[start:end], loss_mask=[1] * (end - start),
                            logprobs=sample.tokens.logprobs[start - first:end - first])
                for start, end in sample.turns]
    replies = [i for i, message in enumerate(messages) if message["role"] == "assistant"][-len(branches):]
    shown = [shown_text(chat.tokenizer, branch.prompt_ids) for branch in branches]
    match = len(replies) == len(branches) and all(
        text == chat.render(messages[:i], add_generation_prompt=True) for text, i in zip(shown, replies, strict=True))
    return branches, float(match)


def apply_reward(trajectory: Trajectory, reward: RewardFn) -> Trajectory:
    """Apply a reward function: reward and status from its result, ``metrics["scored"] = 1``."""
    result = reward(trajectory)
    value, success = (result[0], bool(result[1])) if isinstance(result, tuple) else (result, result > 0)
    status = "success" if success else ("truncated" if trajectory.status == "truncated" else "failure")
    return trajectory.model_copy(update={"reward": float(value), "status": status,
                                         "metrics": {**trajectory.metrics, "scored": 1.0}})


def load_reward(path: str) -> RewardFn:
    """``module:function`` to the function.

    Raises:
        ValueError: not ``module:function``, or it cannot be imported, or it is not callable.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--reward takes an import path 'my_pkg.rewards:score'; got {path!r}.")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load reward function {path!r}: {exc}") from exc
    if not callable(target):
        raise ValueError(f"{path!r} is not callable.")
    return target


def session_files(record_dir: str | Path, sessions: Iterable[str] | None = None) -> list[Path]:
    """The session files to export: the named ones, or every ``*.jsonl`` in ``record_dir`` (sorted).

    Raises:
        FileNotFoundError: ``record_dir`` does not exist (exporting nothing from a mistyped path would look like
            success).
        ValueError: a named session has no file.
    """
    record_dir = Path(record_dir)
    if not record_dir.is_dir():
        raise FileNotFoundError(2, "no such record directory (the --record-dir that trajlab serve wrote)",
                                str(record_dir))
    if not sessions:
        return sorted(record_dir.glob("*.jsonl"))
    paths = [record_dir / f"{s}.jsonl" for s in sessions]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"no recording for session(s): {', '.join(missing)}")
    return paths


def export_sessions(
    paths: Iterable[str | Path],
    out: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    *,
    env: str = "recorded",
    reward: RewardFn | None = None,
    choice: int = 0,
    all_choices: bool = False,
    drop: Iterable[DropRule] = (),
    processor: Any = None,
) -> dict[str, int]:
    """Rebuild every session file in ``paths`` and append its trajectories to ``out``; ids already there are kept.
    ``processor``: the served model's, for sessions whose requests held images (their files go beside ``out``).

    Returns:
        counts: ``sessions``, ``calls`` (merged), ``dropped`` (by a rule), ``skipped`` (refused calls and other
        endpoints), ``samples``, ``written``, ``already`` (ids already in ``out``).
    """
    drop = list(drop)
    summary = dict.fromkeys(("sessions", "calls", "dropped", "skipped", "samples", "written", "already"), 0)
    with TrajectoryStore(out) as store:
        for path in paths:
            session = Path(path).stem
            rebuilt = rebuild_session(read_session(path), session, choice=choice, all_choices=all_choices,
                                      drop=drop)
            summary["sessions"] += 1
            summary["calls"] += rebuilt.calls
            summary["dropped"] += rebuilt.dropped
            summary["skipped"] += rebuilt.skipped
            summary["samples"] += len(rebuilt.samples)
            for sample in rebuilt.samples:
                if f"{session}:{sample.index}" in store.ids:
                    summary["already"] += 1
                    continue
                store.append(to_trajectory(sample, session, tokenizer, template, env=env, reward=reward,
                                           processor=processor, image_folder=image_dir(path)))
                summary["written"] += 1
    return summary
