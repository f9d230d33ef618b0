"""The replies the server wrote, so that a conversation sending one back continues from the model's own tokens.

A chat client sends the whole conversation with every call, its earlier replies as text. Rendering that text and
tokenizing it again need not give the tokens the model wrote: a byte-level BPE model may spell a word, a CJK
character or an emoji in other tokens than the tokenizer's own (it is free to; an untrained model mostly does),
and a reply that ended inside a character has no text for its last bytes. The next prompt would then differ from
the history the model wrote, the model would read tokens it never wrote, and ``traces export`` would fork the
session. So, as the rollout engine appends tokens, the server continues from the recorded ones: when a request's
messages up to an assistant message are exactly a conversation this session sent, followed by the reply the
server returned for it, the prompt is that call's prompt ids, the reply's ids, and the template's tokens for the
messages after it (``ChatTemplate.observation_ids``).

A reply is remembered only when its ids (with the template's end-of-turn tokens appended when the model did not
write them, a reply cut by ``max_tokens``) show exactly the template's rendering of the returned message
(:func:`trajlab.chat.utf8.shown_text`), so a prompt's ids always show the template's rendering of its messages. A
reply that does not (the model formatted a tool call differently from the template, a stop string cut it) is
rendered again and tokenized, as before.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from typing import Any

# About 32 MB of int32 ids: the least recently used replies are forgotten first (their conversations then fork).
MEMORY_TOKENS = 8 * 1024 * 1024


def _hasher(session: str, tools: list[dict[str, Any]]) -> Any:
    digest = hashlib.sha256()
    digest.update(_canonical([session, tools]))
    return digest


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode() + b"\x00"


def reply_key(session: str, tools: list[dict[str, Any]], messages: list[dict[str, Any]],
              reply: dict[str, Any]) -> str:
    """The key of a reply to ``messages`` (chat-template messages) in a session, with these tools."""
    digest = _hasher(session, tools)
    for message in messages:
        digest.update(_canonical(message))
    digest.update(b"reply\x00" + _canonical(reply))
    return digest.hexdigest()


def candidate_keys(session: str, tools: list[dict[str, Any]],
                   messages: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """``(j, reply_key(session, tools, messages[:j], messages[j]))`` for each assistant message j, last first."""
    digest, keys = _hasher(session, tools), []
    for j, message in enumerate(messages):
        if message.get("role") == "assistant":
            reply = digest.copy()
            reply.update(b"reply\x00" + _canonical(message))
            keys.append((j, reply.hexdigest()))
        digest.update(_canonical(message))
    return keys[::-1]


class ReplyMemory:
    """Each remembered reply's whole history: its call's prompt ids and its own ids, up to its end of turn.

    Bounded by ``max_tokens`` in all, least recently used forgotten first.
    """

    def __init__(self, max_tokens: int = MEMORY_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._histories: OrderedDict[str, array] = OrderedDict()
        self._tokens = 0

    def remember(self, key: str, ids: list[int]) -> None:
        if len(ids) > self.max_tokens:
            return
        if key in self._histories:
            self._tokens -= len(self._histories.pop(key))
        self._histories[key] = array("i", ids)
        self._tokens += len(ids)
        while self._tokens > self.max_tokens:
            self._tokens -= len(self._histories.popitem(last=False)[1])

    def recall(self, key: str) -> list[int] | None:
        history = self._histories.get(key)
        if history is None:
            return None
        self._histories.move_to_end(key)
        return history.tolist()
