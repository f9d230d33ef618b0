"""From prompt token ids to finished choices: ``n`` generations, stop strings, tool-call parsing.

The ``n`` choices of a request are submitted to the generator as ``n`` separate requests at once, so the ``hf``
generator batches them with each other and with concurrent requests of other sessions, and reads their shared
prompt once.

Stop strings are applied after generation: the generator stops on token ids only, so a choice is generated up to
its token budget or stop token, then cut at the first token whose decoded text completes a stop string. The kept
token ids are exactly those the model produced up to that point (the token that completes the stop string
included, as vLLM does); the text is cut before the stop string.

Text is :func:`trajlab.chat.utf8.shown_text`: a reply that ends inside a multi-byte character (its token limit or
its stop token came after only some of the character's bytes) is returned without that half character rather than
with a U+FFFD; its token ids keep every byte.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from transformers import PreTrainedTokenizerBase

from trajlab.chat.parsers import ToolCallParser
from trajlab.chat.utf8 import shown_text, token_bytes
from trajlab.inference.base import GenerationRequest, GenerationResult, Generator, SamplingParams, request_seed
from trajlab.proxy.openai_format import Choice, new_tool_call_id


class Completer:
    """Generates and interprets choices for one served model.

    Args:
        generator: the backend; one instance serves every request so concurrent requests batch together.
        tokenizer: decodes completions and stop strings.
        parser: reads tool calls out of a completion.
        stop_token_ids: end-of-turn tokens that end a completion.
    """

    def __init__(
        self, generator: Generator, tokenizer: PreTrainedTokenizerBase, parser: ToolCallParser,
        stop_token_ids: list[int],
    ) -> None:
        self.generator = generator
        self.tokenizer = tokenizer
        self.parser = parser
        self.stop_token_ids = tuple(stop_token_ids)

    def sampling(self, max_new_tokens: int, temperature: float, top_p: float) -> SamplingParams:
        greedy = temperature == 0
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=1.0 if greedy else top_p,
                              stop_token_ids=self.stop_token_ids)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int, *, messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None, seed: int | None = None, key: str = "",
        images: list[Any] | None = None,
    ) -> list[GenerationResult]:
        """The ``n`` choices; with a ``seed``, choice i samples from the stream of (seed, key, i). ``images``: the
        PIL images whose placeholder tokens ``prompt_ids`` holds, in order."""
        requests = [GenerationRequest(prompt_ids=list(prompt_ids), params=params, messages=messages or [],
                                      tools=tools or [], seed=None if seed is None else request_seed(seed, key, i),
                                      images=list(images or []))
                    for i in range(n)]
        return list(await asyncio.gather(*(self.generator.generate(r) for r in requests)))

    def choice(
        self, index: int, result: GenerationResult, stop_strings: list[str], *, prompt_ids: list[int],
        parse_tools: bool, tools: list[dict[str, Any]] | None = None,
    ) -> Choice:
        """Cut one result at its stop token or first stop string; parse tool calls when asked (``tools``: the
        request's schemas, which formats that write arguments as text need to type them)."""
        ids = list(result.token_ids)
        # JSON has no infinities: a token the model gave no probability at all is recorded with logprob null.
        logprobs = [lp if lp is None or math.isfinite(lp) else None for lp in result.logprobs]
        ended_by_token = result.finish_reason == "stop" and bool(ids) and ids[-1] in self.stop_token_ids
        body = ids[:-1] if ended_by_token else ids
        cut = self._cut_at_stop_string(body, stop_strings)
        if cut is not None:
            kept, text, matched = cut
            choice = Choice(index, ids[:kept], logprobs[:kept], text, "stop", stop=matched)
        else:
            stop = ids[-1] if ended_by_token else None
            finish = "stop" if result.finish_reason == "stop" else "length"
            choice = Choice(index, ids, logprobs, self._decode(body), finish, stop=stop)
        if parse_tools and choice.finish_reason == "stop":  # never act on a call cut short by the token budget
            raw = self._decode(choice.token_ids) if cut is None else choice.text
            prefix = self._decode(prompt_ids[-64:])
            choice.parsed = self.parser.parse(raw, prefix=prefix, tools=tools)
            if choice.parsed.tool_calls and not choice.parsed.errors:
                choice.finish_reason = "tool_calls"
                choice.tool_call_ids = [call.id or new_tool_call_id() for call in choice.parsed.tool_calls]
        return choice

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded alone: U+FFFD for a token that holds part of a character (see ``token_bytes``)."""
        return [self.tokenizer.decode([token], skip_special_tokens=False) for token in token_ids]

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        return token_bytes(self.tokenizer, token_ids)

    def _decode(self, ids: list[int]) -> str:
        return shown_text(self.tokenizer, ids)

    def _cut_at_stop_string(self, ids: list[int], stops: list[str]) -> tuple[int, str, str] | None:
        """(tokens kept, text before the stop string, the stop string), or None when no stop string occurs."""
        if not stops or not any(s in self._decode(ids) for s in stops):
            return None
        low, high = 1, len(ids)  # the fewest tokens whose text contains a stop string
        while low < high:
            middle = (low + high) // 2
            if any(s in self._decode(ids[:middle]) for s in stops):
                high = middle
            else:
                low = middle + 1
        text = self._decode(ids[:low])
        at, matched = min((text.find(s), s) for s in stops if s in text)
        return low, text[:at], matched
