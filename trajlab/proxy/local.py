"""The recording server over a model served in this process: each chat or completion call rendered with the chat
template, tokenized, generated and recorded token for token (:func:`create_app`). ``proxy.upstream`` forwards to
another server instead; both share the routes, sessions and recording of :func:`trajlab.proxy.app.openai_app`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from transformers import PreTrainedTokenizerBase

from trajlab.chat.context import TemplateContext
from trajlab.chat.parsers import ToolCallParser
from trajlab.chat.template import (
    ChatTemplate,
    TemplateNotPrefixPreservingError,
    image_ids,
    reasoning_field,
    stop_token_ids,
)
from trajlab.chat.utf8 import shown_text
from trajlab.config import ServeSettings
from trajlab.inference.base import Generator
from trajlab.proxy.app import CallContext, WorkResult, openai_app, read_body
from trajlab.proxy.completion import Completer
from trajlab.proxy.errors import APIError, bad_request
from trajlab.proxy.images import has_image_parts, inline_images, without_image_data
from trajlab.proxy.limits import TokenFloor
from trajlab.proxy.openai_format import (
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    parse_request,
    parse_tool_choice,
    to_template_messages,
    validate_tools,
)
from trajlab.proxy.recording import SessionRecorder
from trajlab.proxy.replies import ReplyMemory, candidate_keys, reply_key
from trajlab.proxy.streaming import chat_chunks, completion_chunks
from trajlab.rollout.images import decode_png


def create_app(
    generator: Generator,
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    parser: ToolCallParser,
    model_name: str,
    recorder: SessionRecorder,
    serve: ServeSettings,
    model_context: int,
    processor: Any = None,
    context: TemplateContext | None = None,
) -> FastAPI:
    """Build the server around already-built collaborators.

    The app takes the model's context length beside the settings rather than settings whose ``max_context`` a
    caller has filled in: it resolves ``serve.max_context`` against the model itself, so a ``max_context`` that
    the model cannot hold is refused here whoever builds the app.

    Args:
        generator: one backend for every request (the ``hf`` generator batches concurrent requests).
        tokenizer: the model's tokenizer.
        template: a prefix-preserving chat template (``resolve_chat_template``), so a session's prompts only grow.
        parser: reads tool calls out of completions.
        model_name: the only name ``model`` may take; listed by ``/v1/models``.
        recorder: where each session's calls are written.
        serve: the request limits: ``max_body_bytes``, ``body_timeout_s``, ``default_max_tokens`` and
            ``max_context`` (None: ``model_context``); the rest of its fields are ``build_app``'s.
        model_context: the model's own context length in tokens (its config's ``max_position_embeddings``).
        processor: a vision-language model's processor, which turns the images of chat requests into the model's
            image tokens (``generator`` must pass ``GenerationRequest.images`` to the model); None: text only.
        context: the template's variables and pinned date (``model.chat_template_kwargs``); recorded with each
            chat call, so an export renders the session as it was served.

    Raises:
        ValueError: ``serve.max_context`` is longer than ``model_context``.
    """
    backend = LocalBackend(generator, tokenizer, template, parser, model_name, serve,
                           _context_length(serve.max_context, model_context), processor, context)
    return openai_app(backend.chat, backend.completion, backend.list_models, recorder, model_name)


class LocalBackend:
    """Answers the calls of :func:`create_app` with the model in this process; ``context`` is the tokens a request
    may use (prompt plus completion)."""

    def __init__(self, generator: Generator, tokenizer: PreTrainedTokenizerBase, template: str,
                 parser: ToolCallParser, model_name: str, serve: ServeSettings, context: int, processor: Any,
                 template_context: TemplateContext | None = None) -> None:
        self.tokenizer, self.model_name, self.serve, self.context = tokenizer, model_name, serve, context
        self.processor = processor
        self.completer = Completer(generator, tokenizer, parser, stop_token_ids(tokenizer))
        self.chat_template = ChatTemplate(tokenizer, [], template, processor, context=template_context)
        self.replies = ReplyMemory()
        self.token_floor = TokenFloor(tokenizer)
        self.reasoning_field = reasoning_field(template)
        # Where the model puts image features. Only the processor may write these ids: text holding one would leave
        # the model more image tokens than image features, failing every request batched with it.
        self.image_tokens = {token for token in getattr(processor, "image_token_ids", None) or []
                             if token is not None}

    async def chat(self, request: Request, call: CallContext) -> WorkResult:
        """``/v1/chat/completions``: the conversation rendered as the rollout engine renders it, tools parsed."""
        body = await read_body(request, call, self.serve)
        self._refuse_more_messages_than_context(body)
        req = parse_request(ChatCompletionRequest, body)
        if has_image_parts(req.messages):  # refused before decoding, or decoded one call at a time
            self._refuse_images_unless_read(call)
            await call.hold_gate()
        raw_messages, call.images = inline_images(req.messages)
        if call.images:
            call.body = {**call.body, "messages": raw_messages}  # recorded with image ids; the bytes go beside it
        self._check_model(req.model)
        tools = validate_tools(req.tools)
        parse_tools = parse_tool_choice(req.tool_choice, bool(tools))
        if req.top_logprobs:
            raise bad_request("top_logprobs is not supported: only the sampled tokens' logprobs are known",
                              param="top_logprobs")
        self._refuse_too_many_choices(1, req.n)
        stops, completer = req.stop_strings(), self.completer
        messages = to_template_messages(raw_messages, self.reasoning_field)
        prompt_text, prompt_ids, images = self._prompt(call.session, messages, tools, call.images)
        params = completer.sampling(self._budget(req.token_budget(), len(prompt_ids), self.serve.default_max_tokens),
                                    req.temperature, req.top_p)
        call.release_gate()  # prepared: generating overlaps other calls, as batching needs
        results = await completer.generate(prompt_ids, params, req.n, messages=messages, tools=tools, seed=req.seed,
                                           images=images)
        choices = [completer.choice(i, r, stops, prompt_ids=prompt_ids, parse_tools=parse_tools, tools=tools)
                   for i, r in enumerate(results)]
        self._remember(call.session, messages, tools, prompt_ids, choices)
        response = {
            "id": call.request_id, "object": "chat.completion", "created": int(call.started),
            "model": self.model_name,
            "choices": [_chat_choice(c, completer, req.logprobs, req.return_token_ids) for c in choices],
            "usage": _usage(len(prompt_ids), choices),
        }
        if req.return_token_ids:
            response["prompt_token_ids"] = prompt_ids
        fields = _record_fields([(prompt_text, prompt_ids)], [(0, c) for c in choices], params, stops, req.n,
                                response["usage"], completer)
        if images:
            fields["prompts"][0]["images"] = image_ids(messages)
        if recorded := self.chat_template.context.record():
            fields["template_context"] = recorded
        return response, fields, chat_chunks(response, req.include_usage()) if req.stream else None

    async def completion(self, request: Request, call: CallContext) -> WorkResult:
        """``/v1/completions``: text or token prompts continued as they are."""
        req = parse_request(CompletionRequest, await read_body(request, call, self.serve))
        self._check_model(req.model)
        if req.echo or req.suffix is not None or (req.best_of is not None and req.best_of != req.n):
            raise bad_request("echo, suffix and best_of are not supported", param="echo")
        if req.logprobs:
            raise bad_request("only logprobs=0 is supported: top alternatives are not known", param="logprobs")
        stops, completer = req.stop_strings(), self.completer
        self._refuse_too_many_choices(_prompt_count(req.prompt), req.n)
        prompts = _completion_prompts(req.prompt, self.tokenizer, self._refuse_past_context)
        for _, ids in prompts:
            self._refuse_image_tokens(ids, "prompt")
        longest = max(len(ids) for _, ids in prompts)
        params = completer.sampling(self._budget(req.token_budget(), longest, 16), req.temperature, req.top_p)
        call.release_gate()
        per_prompt = await asyncio.gather(*(completer.generate(ids, params, req.n, seed=req.seed, key=f"prompt{p}")
                                            for p, (_, ids) in enumerate(prompts)))
        pairs = [(p, completer.choice(p * req.n + j, r, stops, prompt_ids=prompts[p][1], parse_tools=False))
                 for p, results in enumerate(per_prompt) for j, r in enumerate(results)]
        choices = []
        for p, c in pairs:
            out = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                   "logprobs": completion_logprobs(c, completer.token_texts(c.token_ids))
                   if req.logprobs is not None else None}
            if req.return_token_ids:
                out.update(prompt_token_ids=prompts[p][1], token_ids=c.token_ids)
            choices.append(out)
        usage = _usage(sum(len(ids) for _, ids in prompts), [c for _, c in pairs])
        response = {"id": call.request_id, "object": "text_completion", "created": int(call.started),
                    "model": self.model_name, "choices": choices, "usage": usage}
        fields = _record_fields(prompts, pairs, params, stops, req.n, usage, completer)
        return response, fields, completion_chunks(response, req.include_usage()) if req.stream else None

    async def list_models(self) -> dict[str, Any]:
        """``/v1/models``: the one model served, with its context length."""
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "trajlab",
                "max_model_len": self.context}
        return {"object": "list", "data": [card]}

    def _prompt(self, session: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                pngs: dict[str, bytes]) -> tuple[str, list[int], list[Any]]:
        """The rendered prompt, its token ids and its images, as the rollout engine makes them: the processor turns
        each image's placeholder into the image's tokens, and the model gets the images decoded from their PNG
        bytes, the very pixels the recording keeps. Messages that send back a reply of this session's continue
        from the model's own tokens (``proxy.replies``)."""
        turn = self.chat_template.with_tools(tools).with_images(lambda image_id: decode_png(pngs[image_id]))
        try:
            text = turn.render(messages, add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (role order, missing fields) are the client's error
            raise bad_request(f"the chat template cannot render these messages: {exc}", param="messages") from exc
        self._refuse_past_context(text, "messages")
        images = turn.images_of(messages)
        try:
            ids = self._continued(session, turn, messages, tools)
            if ids is None:
                ids = turn.encode(text, images)
        except ValueError as exc:  # the processor's: the text holds image placeholders of its own
            raise bad_request(f"the processor cannot place these images: {exc}", param="messages") from exc
        if self.image_tokens:  # the text's own tokens: the prompt without its images' parts
            self._refuse_image_tokens(turn.encode(turn.render(_text_only(messages), add_generation_prompt=True))
                                      if images else ids, "messages")
        return text, ids, images

    def _continued(self, session: str, turn: ChatTemplate, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]]) -> list[int] | None:
        """The prompt ids that continue the history of the last reply of this session's the messages send back: that
        call's prompt, the reply's ids, the template's tokens for the messages after it; None when none is known."""
        for j, key in candidate_keys(session, tools, messages):
            history = self.replies.recall(key)
            if history is not None:
                try:
                    return history + turn.observation_ids(messages[:j + 1], messages[j + 1:])
                except TemplateNotPrefixPreservingError:  # the messages after it rewrote it: render them whole
                    return None
        return None

    def _remember(self, session: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                  prompt_ids: list[int], choices: list[Choice]) -> None:
        """Remember each reply whose ids, closed by the template's end of turn when the model did not close it,
        show the template's rendering of the message returned (``proxy.replies``)."""
        turn = self.chat_template.with_tools(tools)
        for choice in choices:
            reply = to_template_messages([choice.message()], self.reasoning_field)[0]
            try:
                rendered = turn.assistant_text(messages, reply)
            except Exception:  # noqa: BLE001 - a template that cannot render the reply: it is rendered again if sent
                continue
            ids, shown = list(choice.token_ids), shown_text(self.tokenizer, choice.token_ids)
            if rendered.startswith(shown) and rendered != shown:
                ids += turn.encode(rendered[len(shown):])
            if shown_text(self.tokenizer, ids) == rendered:
                self.replies.remember(reply_key(session, tools, messages, reply), prompt_ids + ids)

    def _refuse_past_context(self, text: str, param: str) -> None:
        """A text that takes more tokens than the context, whatever they are, is refused before it is tokenized."""
        least = self.token_floor(text)
        if least > self.context:
            raise bad_request(f"the prompt is at least {least} tokens ({len(text)} characters); this model's context "
                              f"is {self.context} tokens", param=param, code="context_length_exceeded")

    def _refuse_more_messages_than_context(self, body: Any) -> None:
        """Every message takes at least one token (its role's marker, in every chat template), so a request with more
        messages than the context has tokens is refused before it is validated and rendered: 100,000 messages, in
        under 4 MiB, took 100 MB of objects and 3 s of the event loop to be refused afterwards."""
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list) and len(messages) > self.context:
            raise bad_request(f"the request has {len(messages)} messages, each at least one token; this model's "
                              f"context is {self.context} tokens", param="messages", code="context_length_exceeded")

    def _refuse_images_unless_read(self, call: CallContext) -> None:
        """Images for a text model are refused before they are decoded (a 25-megapixel image took 200 MB to decode
        and encode again), and recorded without their bytes."""
        if self.processor is None:
            call.body = {**call.body, "messages": without_image_data(call.body["messages"])}
            raise bad_request(f"the model {self.model_name!r} reads text only (it has no image processor): image "
                              "parts need a vision-language model served with the hf backend", param="messages",
                              code="images_not_supported")

    def _refuse_too_many_choices(self, prompts: int, n: int) -> None:
        """Each choice is a generation and a record: their number per request is bounded before any is made."""
        if prompts * n > self.serve.max_choices:
            raise bad_request(f"{prompts} prompt(s) with n={n} ask for {prompts * n} choices; this server gives at "
                              f"most {self.serve.max_choices} a request (serve.max_choices): split them across "
                              "requests", param="n" if prompts == 1 else "prompt", code="too_many_choices")

    def _refuse_image_tokens(self, ids: list[int], param: str) -> None:
        if self.image_tokens.intersection(ids):
            names = self.tokenizer.convert_ids_to_tokens(sorted(self.image_tokens))
            raise bad_request(f"the text holds the model's image token ({', '.join(names)}), which only an image may "
                              "bring: send images as image_url parts", param=param)

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {self.model_name!r}.",
                           param="model", code="model_not_found")

    def _budget(self, requested: int | None, prompt_tokens: int, default: int) -> int:
        """The completion's token budget: what was asked for, else ``default``, never past the context."""
        room = self.context - prompt_tokens
        if room <= 0:
            raise bad_request(f"the prompt is {prompt_tokens} tokens; this model's context is {self.context} tokens",
                              param="messages", code="context_length_exceeded")
        if requested is not None and requested > room:
            raise bad_request(
                f"max_tokens={requested} plus the {prompt_tokens}-token prompt exceeds this model's context of "
                f"{self.context} tokens", param="max_tokens", code="context_length_exceeded")
        return requested if requested is not None else min(default, room)


def _context_length(max_context: int | None, model_context: int) -> int:
    """The tokens a request may use: ``max_context`` when set, never more than the model holds."""
    if max_context is not None and max_context > model_context:
        raise ValueError(f"serve.max_context {max_context} is longer than the model's context of {model_context} "
                         "tokens: give at most that, or leave it unset")
    return max_context or model_context



def _prompt_count(prompt: str | list[str] | list[int]) -> int:
    """How many prompts a completions request holds: a list of token ids is one."""
    return len(prompt) if isinstance(prompt, list) and not all(isinstance(p, int) for p in prompt) else 1


def _completion_prompts(prompt: str | list[str] | list[int], tokenizer: PreTrainedTokenizerBase,
                        refuse_past_context: Callable[[str, str], None]):
    """(text, token ids) per prompt; text prompts are tokenized with the tokenizer's special tokens (BOS), once
    ``refuse_past_context`` has let each through."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        if any(not 0 <= p < len(tokenizer) for p in prompt):
            raise bad_request(f"prompt token ids must be in [0, {len(tokenizer)})", param="prompt")
        return [(tokenizer.decode(prompt, skip_special_tokens=False), list(prompt))]
    for text in prompt:
        refuse_past_context(text, "prompt")
    return [(text, tokenizer.encode(text)) for text in prompt]



def _text_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages without their image parts."""
    return [{**m, "content": [p for p in m["content"] if p["type"] != "image"]} if isinstance(m["content"], list)
            else m for m in messages]



def _chat_choice(choice: Choice, completer: Completer, logprobs: bool, token_ids: bool) -> dict[str, Any]:
    out = {"index": choice.index, "message": choice.message(), "finish_reason": choice.finish_reason,
           "logprobs": chat_logprobs(choice, completer.token_texts(choice.token_ids),
                                       completer.token_bytes(choice.token_ids)) if logprobs else None}
    if token_ids:
        out["token_ids"] = choice.token_ids
    return out



def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}



def _record_fields(prompts, pairs, params, stops, n, usage, completer: Completer) -> dict[str, Any]:
    """The token-level part of a call record: exact prompt ids, and per choice its ids, logprobs and meaning."""
    return {
        "prompts": [{"text": text, "token_ids": ids} for text, ids in prompts],
        "sampling": {"n": n, "max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                     "top_p": params.top_p, "stop": stops, "stop_token_ids": list(params.stop_token_ids)},
        "choices": [
            {"index": c.index, "prompt_index": p, "token_ids": c.token_ids, "logprobs": c.logprobs, "text": c.text,
             "finish_reason": c.finish_reason, "stop": c.stop, "message": c.message(),
             "parse_errors": c.parsed.errors if c.parsed is not None else []}
            for p, c in pairs
        ],
        "usage": usage,
    }
