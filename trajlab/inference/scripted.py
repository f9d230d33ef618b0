"""A scripted policy as a Generator: replays a reference policy's messages as the template's own tokens.

Oracles (reference policies) decide in messages; this turns each decision into exactly the tokens the chat
template renders for it, so demonstrations carry real token ids and loss masks like any model rollout. Their
logprobs are unknown (None): nothing was sampled.

A reference that slips on some episodes of a task and not on others (a demonstrator with a habit, not a blind spot)
takes a keyword argument ``rng``: a :class:`random.Random` seeded from the turn's ``GenerationRequest.seed``, so its
draws differ between the episodes of one task yet repeat when the same collection runs again.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from trajlab.chat.context import TemplateContext
from trajlab.chat.template import ChatTemplate
from trajlab.inference.base import GenerationRequest, GenerationResult

Policy = Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any]]


class ScriptedGenerator:
    """Generator backed by a function ``policy(task, messages) -> assistant message``."""

    def __init__(
        self, policy: Policy, tokenizer: PreTrainedTokenizerBase, chat_template: str, name: str = "scripted",
        context: TemplateContext | None = None,
    ) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.name = name
        self._chat = ChatTemplate(tokenizer, [], chat_template, context=context)
        self._draws = draws(policy)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._draws:
            message = self.policy(request.task, request.messages, rng=random.Random(request.seed))
        else:
            message = self.policy(request.task, request.messages)
        chat = self._chat.with_tools(request.tools)
        ids = chat.encode(chat.assistant_text(request.messages, message))
        if len(ids) > request.params.max_new_tokens:
            return GenerationResult(ids[: request.params.max_new_tokens], [None] * request.params.max_new_tokens,
                                    "length")
        return GenerationResult(ids, [None] * len(ids), "stop")


def draws(policy: Callable[..., Any]) -> bool:
    """Whether a reference policy draws per episode: it takes a keyword argument ``rng`` (see the module doc)."""
    return "rng" in inspect.signature(policy).parameters
