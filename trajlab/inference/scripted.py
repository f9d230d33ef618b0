"""A scripted policy as a Generator: replays a reference policy's messages as the template's own tokens.

Oracles (reference policies) decide in messages; this turns each decision into exactly the tokens the chat
template renders for it, so demonstrations carry real token ids and loss masks like any model rollout. Their
logprobs are unknown (None): nothing was sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from trajlab.chat.template import ChatTemplate
from trajlab.inference.base import GenerationRequest, GenerationResult

Policy = Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any]]


class ScriptedGenerator:
    """Generator backed by a function ``policy(task, messages) -> assistant message``."""

    def __init__(
        self, policy: Policy, tokenizer: PreTrainedTokenizerBase, chat_template: str, name: str = "scripted"
    ) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.name = name
        self._chat = ChatTemplate(tokenizer, [], chat_template)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        message = self.policy(request.task, request.messages)
        chat = self._chat.with_tools(request.tools)
        ids = chat.encode(chat.assistant_text(request.messages, message))
        if len(ids) > request.params.max_new_tokens:
            return GenerationResult(ids[: request.params.max_new_tokens], [None] * request.params.max_new_tokens,
                                    "length")
        return GenerationResult(ids, [None] * len(ids), "stop")
