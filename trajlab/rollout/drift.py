"""The token-drift guard: before a trajectory is trained on, check that its tokens are what the engine promises.

A rollout's record is built turn by turn (``engine.py``): the prompt is the chat template's rendering of the first
messages; each model turn is the ids the model generated, and its assistant message is what the parser read from
them; each observation is the template's delta for the messages that followed. Training on a record whose ids no
longer match its messages (another tokenizer or template at training time, a template that rewrites history, a
record edited or corrupted on disk) trains on tokens the model will never see at inference: the bug class peers'
issue trackers keep reopening. ``find_drift`` replays that construction and names the first turn that differs;
``check_token_drift`` runs it over a batch and stops the run above a threshold; ``without_drift`` does so under a
tokenizer's training template (SFT's data, RL's replayed demonstrations).

Records exported from the recording server (``metrics["template_match"]`` present) hold the client's messages,
which the server's parser did not write, so for them the whole conversation is compared as text: the decoded ids
must equal the template's rendering of the messages.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from trajlab.chat.context import TemplateContext
from trajlab.chat.parsers import ToolCallParser, get_parser
from trajlab.chat.template import ChatTemplate, resolve_chat_template
from trajlab.chat.utf8 import shown_text
from trajlab.errors import UserError
from trajlab.rollout.engine import assistant_message
from trajlab.rollout.types import Trajectory

logger = logging.getLogger(__name__)

Segment = Literal["prompt", "model", "observation", "conversation"]
EXCERPT = 40


@dataclass(frozen=True)
class Drift:
    """Where a trajectory's tokens first differ from the template's rendering of its messages."""

    trajectory_id: str
    turn: int
    """0 for the prompt, k for the k-th model turn or the observation after it."""
    segment: Segment
    position: int
    """Index of the first differing token in ``prompt_ids + completion_ids``."""
    expected: str
    found: str

    def describe(self) -> str:
        where = "the prompt" if self.turn == 0 else f"turn {self.turn} ({self.segment})"
        return (f"trajectory {self.trajectory_id!r}, {where}, token {self.position}: the template renders "
                f"{self.expected!r}, the record holds {self.found!r}")


class TokenDriftError(UserError):
    """Too many trajectories' tokens differ from their messages as the chat template renders them."""


def check_token_drift(
    trajectories: Iterable[Trajectory],
    tokenizer: PreTrainedTokenizerBase,
    chat_template: str,
    parser: ToolCallParser,
    *,
    max_drift: float,
    processor: Any = None,
) -> tuple[list[Trajectory], list[Drift]]:
    """The trajectories whose tokens match their messages (drifted ones are never to be trained on), and the drifts.
    ``processor``: a vision-language model's, for trajectories whose messages hold images.

    Raises:
        TokenDriftError: the share of drifted trajectories is above ``max_drift`` (0: any drift).
    """
    trajectories = list(trajectories)
    base = ChatTemplate(tokenizer, [], chat_template, processor)
    chats: dict[str, ChatTemplate] = {}
    kept, drifts = [], []
    for trajectory in trajectories:
        key = json.dumps([trajectory.tools, trajectory.template_context], sort_keys=True)
        chat = chats.get(key) or chats.setdefault(key, base.with_tools(trajectory.tools).with_context(
            TemplateContext.from_record(trajectory.template_context)))
        drift = find_drift(trajectory, chat.with_images(trajectory.image) if trajectory.images else chat, parser)
        if drift is None:
            kept.append(trajectory)
        else:
            drifts.append(drift)
    if drifts and len(drifts) > max_drift * len(trajectories):
        raise TokenDriftError(
            f"Token drift in {len(drifts)} of {len(trajectories)} trajectories under the chat template of "
            f"{tokenizer.name_or_path!r} ({_template_origin(tokenizer, chat_template)}): first {drifts[0].describe()}. "
            "Train with the model, tokenizer and chat template the trajectories were rolled out with, or set "
            "max_drift (rl.max_drift / sft.max_drift) to the share of drifted trajectories to drop and go on."
        )
    return kept, drifts


def _template_origin(tokenizer: PreTrainedTokenizerBase, chat_template: str) -> str:
    own = tokenizer.chat_template
    own = own.get("default") if isinstance(own, dict) else own
    return "its own template" if chat_template == own else "a template other than the tokenizer's own"


def find_drift(trajectory: Trajectory, chat: ChatTemplate, parser: ToolCallParser) -> Drift | None:
    """Replay the engine's construction of ``trajectory``'s tokens from its messages; the first difference, or None.

    ``chat`` renders with the trajectory's tools. Trajectories without tokens have nothing to check.
    """
    if trajectory.branches is not None:
        return _branch_drift(trajectory, chat, parser)
    if trajectory.tokens is None:
        return None
    if "template_match" in trajectory.metrics:
        return _conversation_drift(trajectory, chat)
    return _Replay(trajectory, chat, parser).run()


def _branch_drift(trajectory: Trajectory, chat: ChatTemplate, parser: ToolCallParser) -> Drift | None:
    """An episode kept one sample per turn: each turn's prompt must be the template's fresh rendering of the
    conversation before it, and its tokens what the engine made of the turn's assistant message. A recorded session
    (``template_match`` in its metrics) is held to the text the server showed, and its call ids are the server's."""
    branches = trajectory.branches or []
    assistants = [i for i, m in enumerate(trajectory.messages) if m.get("role") == "assistant"]
    if len(branches) != len(assistants):
        return Drift(trajectory.id, min(len(branches), len(assistants)) + 1, "model", 0,
                     f"{len(assistants)} assistant messages", f"{len(branches)} turn samples")
    recorded = "template_match" in trajectory.metrics
    for turn, (branch, index) in enumerate(zip(branches, assistants, strict=True), start=1):
        replay = _Replay(trajectory.model_copy(update={"tokens": branch, "branches": None}), chat, parser)
        prompt = len(branch.prompt_ids)
        if recorded:
            rendered = replay.chat.render(trajectory.messages[:index], add_generation_prompt=True)
            drift = _text_drift(trajectory.id, turn, "prompt", chat.tokenizer, branch.prompt_ids, rendered)
        else:
            drift = replay._compare(turn, "prompt", 0, replay.chat.prompt_ids(trajectory.messages[:index]), prompt)
        if drift or (drift := replay._model_turn(turn, index, prompt, len(replay.ids), server_ids=recorded)):
            return drift
    return None


class _Replay:
    """One trajectory's ids, walked segment by segment against what the engine would have appended."""

    def __init__(self, trajectory: Trajectory, chat: ChatTemplate, parser: ToolCallParser) -> None:
        tokens = trajectory.tokens
        self.trajectory, self.chat, self.parser = trajectory, _PrefixRenders(chat, trajectory.messages), parser
        self.ids = tokens.prompt_ids + tokens.completion_ids
        self.trained = [0] * len(tokens.prompt_ids) + tokens.loss_mask
        self.messages = trajectory.messages
        self.assistants = [i for i, m in enumerate(self.messages) if m.get("role") == "assistant"]

    def run(self) -> Drift | None:
        first = self.assistants[0] if self.assistants else len(self.messages)
        expected = self.chat.prompt_ids(self.messages[:first])
        if drift := self._compare(0, "prompt", 0, expected, len(self.trajectory.tokens.prompt_ids)):
            return drift
        at = len(self.trajectory.tokens.prompt_ids)
        if not self.assistants:
            return self._compare(0, "prompt", at, [], len(self.ids))
        for turn, index in enumerate(self.assistants, start=1):
            end = at
            while end < len(self.ids) and self.trained[end]:
                end += 1
            if drift := self._model_turn(turn, index, at, end):
                return drift
            at = end
            following = self.assistants[turn] if turn < len(self.assistants) else len(self.messages)
            end = at
            while end < len(self.ids) and not self.trained[end]:
                end += 1
            if drift := self._observation(turn, index, following, at, end):
                return drift
            at = end
        return self._compare(len(self.assistants), "observation", at, [], len(self.ids))

    def _model_turn(self, turn: int, index: int, start: int, end: int, server_ids: bool = False) -> Drift | None:
        """The assistant message must be what the engine made of these ids: the parsed reply, the raw text of a
        turn cut by the token limit, or the raw text without its stop token when the reply did not parse.
        ``server_ids``: the calls' ids were given by the recording server, not written by the model: not compared."""
        ids = self.ids[start:end]
        decode = self.chat.tokenizer.decode
        stored = self.messages[index]
        text = decode(ids, skip_special_tokens=False)
        if stored == {"role": "assistant", "content": text} and turn == len(self.assistants):
            return None  # cut by max_new_tokens / max_episode_tokens: kept as text, nothing acted on
        parsed = self.parser.parse(text, prefix=decode(self.ids[max(0, start - 64):start], skip_special_tokens=False),
                                   tools=self.trajectory.tools)
        if parsed.errors:
            expected = {"role": "assistant", "content": decode(ids[:-1], skip_special_tokens=False)}
        else:
            expected = assistant_message(parsed, turn - 1)
        if _normal(expected, server_ids) == _normal(stored, server_ids):
            return None
        shown = self.chat.assistant_text(self.messages[:index], stored)
        return Drift(self.trajectory.id, turn, "model", start, shown[:EXCERPT], text[:EXCERPT])

    def _observation(self, turn: int, index: int, following: int, start: int, end: int) -> Drift | None:
        """What follows the model's turn: the template's closing tokens when nobody spoke next, else the delta of the
        messages up to the next model turn (with the generation prompt when one follows; either way at the end)."""
        history, new = self.messages[: index + 1], self.messages[index + 1 : following]
        if end == start and turn == len(self.assistants) and not any(self.trained[start:]):
            # The record stops right after the model's last turn (an episode that ended in an error there).
            return None
        if not new:
            return self._compare(turn, "observation", start, self.chat.closing_ids(history), end)
        last = following == len(self.messages)  # usually without the generation prompt: the env was done
        drift = self._compare(turn, "observation", start,
                              self.chat.observation_ids(history, new, add_generation_prompt=not last), end)
        if drift is None or not last:
            return drift
        # ... or with it, when the episode's token budget ran out before the next turn.
        prompted = self.chat.observation_ids(history, new, add_generation_prompt=True)
        return self._compare(turn, "observation", start, prompted, end) and drift

    def _compare(self, turn: int, segment: Segment, start: int, expected: list[int], end: int) -> Drift | None:
        found = self.ids[start:end]
        if found == expected:
            return None
        offset = next((i for i, (a, b) in enumerate(zip(expected, found, strict=False)) if a != b),
                      min(len(expected), len(found)))
        decode = self.chat.tokenizer.decode
        return Drift(self.trajectory.id, turn, segment, start + offset,
                     decode(expected[offset : offset + 8], skip_special_tokens=False)[:EXCERPT],
                     decode(found[offset : offset + 8], skip_special_tokens=False)[:EXCERPT])


class _PrefixRenders(ChatTemplate):
    """The chat template over prefixes of one conversation, each rendered once: replaying a turn asks for the same
    prefixes two or three times, and rendering is nearly all of the guard's cost."""

    def __init__(self, chat: ChatTemplate, messages: list[dict[str, Any]]) -> None:
        self.__dict__.update(chat.__dict__)
        self._conversation = messages
        self._renders: dict[tuple[int, bool], str] = {}

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        n = len(messages)
        if n > len(self._conversation) or (n and messages[-1] is not self._conversation[n - 1]):
            return super().render(messages, add_generation_prompt=add_generation_prompt)  # not a prefix
        key = (n, add_generation_prompt)
        if key not in self._renders:
            self._renders[key] = super().render(messages, add_generation_prompt=add_generation_prompt)
        return self._renders[key]


def _normal(message: dict[str, Any], without_ids: bool = False) -> dict[str, Any]:
    """A message as the engine writes it, with empty optional fields dropped (and call ids, when the server chose
    them and the model did not write them), for comparison."""
    normal = {key: value for key, value in message.items() if value not in (None, "", [])} | {
        "content": message.get("content") or ""}
    if without_ids and normal.get("tool_calls"):
        normal["tool_calls"] = [{k: v for k, v in call.items() if k != "id"} for call in normal["tool_calls"]]
    return normal


def _conversation_drift(trajectory: Trajectory, chat: ChatTemplate) -> Drift | None:
    """Recorded sessions: the ids' text must equal the template's rendering of the whole conversation. Their text
    is the recording server's (``shown_text``): a reply that ended inside a character was returned without it."""
    tokens = trajectory.tokens
    rendered = chat.render(trajectory.messages)
    if images := chat.images_of(trajectory.messages):  # the ids hold each image's tokens, the text its placeholder
        rendered = chat.tokenizer.decode(chat.encode(rendered, images), skip_special_tokens=False)
    ids = tokens.prompt_ids + tokens.completion_ids
    drift = _text_drift(trajectory.id, 0, "conversation", chat.tokenizer, ids, rendered)
    if drift is None:
        return None
    trained = [0] * len(tokens.prompt_ids) + tokens.loss_mask  # name the model turn the differing token falls in
    return replace(drift, turn=sum(1 for i in range(1, drift.position + 1) if trained[i] and not trained[i - 1]))


def _text_drift(trajectory_id: str, turn: int, segment: Segment, tokenizer: PreTrainedTokenizerBase,
                ids: list[int], rendered: str) -> Drift | None:
    """Where the text the server showed for ``ids`` (``shown_text``) first differs from ``rendered``; None if never."""
    decoded = shown_text(tokenizer, ids)
    if decoded == rendered:
        return None
    at = next((i for i, (a, b) in enumerate(zip(rendered, decoded, strict=False)) if a != b),
              min(len(rendered), len(decoded)))
    low, high = 0, len(ids)  # the first token whose text reaches past the differing character
    while low < high:
        middle = (low + high) // 2
        if len(shown_text(tokenizer, ids[: middle + 1])) > at:
            high = middle
        else:
            low = middle + 1
    return Drift(trajectory_id, turn, segment, min(low, len(ids) - 1), rendered[at : at + EXCERPT],
                 decoded[at : at + EXCERPT])


def without_drift(
    trajectories: Iterable[Trajectory], tokenizer: Any, *, parser: str, max_drift: float, processor: Any,
) -> list[Trajectory]:
    """The trajectories whose tokens are the chat template's rendering of their messages, turn by turn (see
    ``trajlab.rollout.drift``), under ``tokenizer``'s training template; the others are dropped and counted in the
    log. Trajectories with images need the vision-language model's ``processor`` to render them.

    Raises:
        TokenDriftError: more than ``max_drift`` of them drifted (0: any).
    """
    kept, drifts = check_token_drift(trajectories, tokenizer, resolve_chat_template(tokenizer),
                                     get_parser(parser, tokenizer), max_drift=max_drift, processor=processor)
    if drifts:
        logger.warning("Token drift: %d trajectories dropped, first %s", len(drifts), drifts[0].describe())
    return kept
