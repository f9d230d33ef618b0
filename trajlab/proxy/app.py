"""The FastAPI app: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``, each also under
``/sessions/{id}/``, every call recorded in its session's file before the response is sent.

Bodies are read and decoded here rather than by FastAPI, so an oversized body is refused before it is parsed and
malformed JSON gets an OpenAI-format 400 like every other bad input.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from trajlab.chat.parsers import ToolCallParser
from trajlab.chat.template import ChatTemplate, image_ids, stop_token_ids
from trajlab.config import ServeSettings
from trajlab.inference.base import Generator
from trajlab.proxy.completion import Completer
from trajlab.proxy.errors import APIError, bad_request, error_response
from trajlab.proxy.images import inline_images
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
from trajlab.proxy.recording import RECORD_SCHEMA, SessionRecorder
from trajlab.proxy.sessions import resolve_session
from trajlab.proxy.streaming import chat_chunks, completion_chunks, sse
from trajlab.rollout.images import decode_png

logger = logging.getLogger(__name__)


@dataclass
class CallContext:
    """What is known about one call so far; becomes its record."""

    session: str
    source: str
    request_id: str
    endpoint: str
    started: float
    body: Any = None
    model: str = ""
    body_read: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the whole body is in: from then on a message from the client can only be its disconnect."""
    images: dict[str, bytes] = field(default_factory=dict)
    """The PNG bytes of the request's images by id (the body names them by id): stored beside the record."""

    def record(self, model: str, **fields: Any) -> dict[str, Any]:
        return {"schema": RECORD_SCHEMA, "session_id": self.session, "session_source": self.source,
                "request_id": self.request_id, "endpoint": self.endpoint, "timestamp": self.started,
                "duration_s": round(time.time() - self.started, 6), "model": model, "request": self.body, **fields}


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

    Raises:
        ValueError: ``serve.max_context`` is longer than ``model_context``.
    """
    context = _context_length(serve.max_context, model_context)
    completer = Completer(generator, tokenizer, parser, stop_token_ids(tokenizer))
    chat = ChatTemplate(tokenizer, [], template, processor)
    # Where the model puts image features. Only the processor may write these ids: text holding one would leave the
    # model more image tokens than image features, failing every request batched with it.
    image_tokens = {token for token in getattr(processor, "image_token_ids", None) or [] if token is not None}

    def refuse_image_tokens(ids: list[int], param: str) -> None:
        if image_tokens.intersection(ids):
            names = tokenizer.convert_ids_to_tokens(sorted(image_tokens))
            raise bad_request(f"the text holds the model's image token ({', '.join(names)}), which only an image may "
                              "bring: send images as image_url parts", param=param)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {model_name!r}.",
                           param="model", code="model_not_found")

    def budget(requested: int | None, prompt_tokens: int, default: int) -> int:
        room = context - prompt_tokens
        if room <= 0:
            raise bad_request(
                f"the prompt is {prompt_tokens} tokens; this model's context is {context} tokens",
                param="messages", code="context_length_exceeded")
        if requested is not None and requested > room:
            raise bad_request(
                f"max_tokens={requested} plus the {prompt_tokens}-token prompt exceeds this model's context of "
                f"{context} tokens", param="max_tokens", code="context_length_exceeded")
        return requested if requested is not None else min(default, room)

    def prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
               pngs: dict[str, bytes]) -> tuple[str, list[int], list[Any]]:
        """The rendered prompt, its token ids and its images, as the rollout engine makes them: the processor turns
        each image's placeholder into the image's tokens, and the model gets the images decoded from their PNG
        bytes, the very pixels the recording keeps."""
        if image_ids(messages) and processor is None:
            raise bad_request(f"the model {model_name!r} reads text only (it has no image processor): image parts "
                              "need a vision-language model served with the hf backend", param="messages",
                              code="images_not_supported")
        turn = chat.with_tools(tools).with_images(lambda image_id: decode_png(pngs[image_id]))
        try:
            text = turn.render(messages, add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (role order, missing fields) are the client's error
            raise bad_request(f"the chat template cannot render these messages: {exc}", param="messages") from exc
        images = turn.images_of(messages)
        try:
            ids = turn.encode(text, images)
        except ValueError as exc:  # the processor's: the text holds image placeholders of its own
            raise bad_request(f"the processor cannot place these images: {exc}", param="messages") from exc
        if image_tokens:  # the text's own tokens: the prompt without its images' parts
            refuse_image_tokens(turn.encode(turn.render(_text_only(messages), add_generation_prompt=True))
                                if images else ids, "messages")
        return text, ids, images

    async def chat_work(request: Request, call: CallContext):
        req = parse_request(ChatCompletionRequest, await read_body(request, call, serve))
        raw_messages, call.images = inline_images(req.messages)
        if call.images:
            call.body = {**call.body, "messages": raw_messages}  # recorded with image ids; the bytes go beside it
        check_model(req.model)
        tools = validate_tools(req.tools)
        parse_tools = parse_tool_choice(req.tool_choice, bool(tools))
        if req.top_logprobs:
            raise bad_request("top_logprobs is not supported: only the sampled tokens' logprobs are known",
                              param="top_logprobs")
        stops = req.stop_strings()
        messages = to_template_messages(raw_messages)
        prompt_text, prompt_ids, images = prompt(messages, tools, call.images)
        params = completer.sampling(budget(req.token_budget(), len(prompt_ids), serve.default_max_tokens),
                                    req.temperature, req.top_p)
        results = await completer.generate(prompt_ids, params, req.n, messages=messages, tools=tools, seed=req.seed,
                                           images=images)
        choices = [completer.choice(i, r, stops, prompt_ids=prompt_ids, parse_tools=parse_tools)
                   for i, r in enumerate(results)]
        response = {
            "id": call.request_id, "object": "chat.completion", "created": int(call.started), "model": model_name,
            "choices": [_chat_choice(c, completer, req.logprobs, req.return_token_ids) for c in choices],
            "usage": _usage(len(prompt_ids), choices),
        }
        if req.return_token_ids:
            response["prompt_token_ids"] = prompt_ids
        fields = _record_fields([(prompt_text, prompt_ids)], [(0, c) for c in choices], params, stops, req.n,
                                response["usage"], completer)
        if images:
            fields["prompts"][0]["images"] = image_ids(messages)
        stream = chat_chunks(response, req.include_usage()) if req.stream else None
        return response, fields, stream

    async def completion_work(request: Request, call: CallContext):
        req = parse_request(CompletionRequest, await read_body(request, call, serve))
        check_model(req.model)
        if req.echo or req.suffix is not None or (req.best_of is not None and req.best_of != req.n):
            raise bad_request("echo, suffix and best_of are not supported", param="echo")
        if req.logprobs:
            raise bad_request("only logprobs=0 is supported: top alternatives are not known", param="logprobs")
        stops = req.stop_strings()
        prompts = _completion_prompts(req.prompt, tokenizer)
        for _, ids in prompts:
            refuse_image_tokens(ids, "prompt")
        longest = max(len(ids) for _, ids in prompts)
        params = completer.sampling(budget(req.token_budget(), longest, 16), req.temperature, req.top_p)
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
                    "model": model_name, "choices": choices, "usage": usage}
        fields = _record_fields(prompts, pairs, params, stops, req.n, usage, completer)
        stream = completion_chunks(response, req.include_usage()) if req.stream else None
        return response, fields, stream

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "trajlab",
                "max_model_len": context}

    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    return openai_app(chat_work, completion_work, list_models, recorder, model_name)


WorkResult = tuple[dict[str, Any], dict[str, Any], Iterator[dict[str, Any]] | None]
Work = Callable[[Request, "CallContext"], Awaitable[WorkResult]]
"""Answers one call: (the response, the record's token-level fields, the stream's chunks or None)."""


def openai_app(
    chat_work: Work, completion_work: Work, list_models: Callable[[], Awaitable[dict[str, Any]]],
    recorder: SessionRecorder, model_name: str, on_shutdown: Callable[[], Awaitable[None]] | None = None,
) -> FastAPI:
    """The routes, session resolution, recording and error handling shared by every backend.

    Args:
        chat_work: answers ``/v1/chat/completions``.
        completion_work: answers ``/v1/completions``.
        list_models: the body of ``/v1/models``.
        recorder: where each session's calls are written.
        model_name: the record's ``model`` when ``work`` sets none on the call.
        on_shutdown: awaited when the server stops (closes the upstream backend's connections).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="trajlab serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    async def handle(request: Request, session_path: str | None, endpoint: str, work) -> Response:
        """Resolve the session, run ``work``, record the outcome (success or error) in the session's file."""
        session, source = resolve_session(request, session_path)
        prefix = "chatcmpl" if endpoint.endswith("chat/completions") else "cmpl"
        call = CallContext(session, source, f"{prefix}-{uuid.uuid4().hex}", endpoint, time.time())
        try:
            response, fields, stream = await _unless_disconnected(request, call, work(request, call))
        except ClientGone:
            gone = APIError(499, "the client disconnected before the response; its generation was cancelled",
                            type="client_closed_request")
            await _record(call, status=499, error=gone.body()["error"])
            return Response(status_code=499)  # nobody reads it
        except APIError as exc:
            await _record(call, status=exc.status, error=exc.body()["error"])
            raise
        except Exception as exc:
            logger.exception("request %s failed", call.request_id)
            error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
            await _record(call, status=500, error=error.body()["error"])
            raise error from exc
        await _record(call, status=200, **fields, error=None)
        if stream is not None:
            return StreamingResponse(sse(stream), media_type="text/event-stream")
        return JSONResponse(response)

    async def _record(call: CallContext, **fields: Any) -> None:
        record = call.record(call.model or model_name, **fields)
        await asyncio.to_thread(recorder.append, call.session, record, call.images)

    # ------------------------------------------------------------------------------------------------------ routes

    def routes(endpoint: str, work: Work) -> None:
        """``endpoint`` and its ``/sessions/{id}`` twin, both answered by ``work``."""

        async def plain(request: Request) -> Response:
            return await handle(request, None, endpoint, work)

        async def in_session(request: Request, session_id: str) -> Response:
            return await handle(request, session_id, endpoint, work)

        app.add_api_route(endpoint, plain, methods=["POST"])
        app.add_api_route("/sessions/{session_id:path}" + endpoint, in_session, methods=["POST"])

    routes("/v1/chat/completions", chat_work)
    routes("/v1/completions", completion_work)

    @app.get("/v1/models")
    @app.get("/sessions/{session_id:path}/v1/models")
    async def models() -> dict[str, Any]:
        return await list_models()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # ------------------------------------------------------------------------------------------------------ errors

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, str(exc.errors()[:1]))

    return app


class ClientGone(Exception):
    """The client closed its connection while its call was being answered."""


async def _unless_disconnected(request: Request, call: CallContext, work: Awaitable[Any]) -> Any:
    """``work``'s result, or :class:`ClientGone` as soon as the client disconnects, with ``work`` cancelled (the
    generator stops its rows). Listening starts once the body is read, since both take the request's messages."""
    answer = asyncio.ensure_future(work)

    async def gone() -> None:
        await call.body_read.wait()
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({answer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not answer.done():
        answer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answer
        raise ClientGone
    return answer.result()


async def read_body(request: Request, call: CallContext, serve: ServeSettings) -> Any:
    """The decoded JSON body, kept on ``call`` for its record; 413 past ``serve.max_body_bytes``, 408 when it does not
    arrive within ``serve.body_timeout_s``, 400 when malformed."""
    max_bytes = serve.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    body = bytearray()
    try:
        async with asyncio.timeout(serve.body_timeout_s):
            async for piece in request.stream():
                body += piece
                if len(body) > max_bytes:
                    raise _too_large(len(body), max_bytes)
    except TimeoutError as exc:
        raise APIError(408, f"the request body did not arrive within {serve.body_timeout_s:g} s ({len(body)} bytes "
                       "received)", code="request_timeout") from exc
    call.body_read.set()
    try:
        parsed = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise bad_request("malformed JSON body: nested too deeply", code="invalid_json") from exc
    if surrogate := _lone_surrogate(parsed):
        raise bad_request(f"malformed JSON body: a string holds a lone UTF-16 surrogate ({surrogate!r}), which is no "
                          "character", code="invalid_json")
    call.body = parsed
    return call.body


def _context_length(max_context: int | None, model_context: int) -> int:
    """The tokens a request may use: ``max_context`` when set, never more than the model holds."""
    if max_context is not None and max_context > model_context:
        raise ValueError(f"serve.max_context {max_context} is longer than the model's context of {model_context} "
                         "tokens: give at most that, or leave it unset")
    return max_context or model_context


def _finite_float(text: str) -> float:
    """A JSON number as a float; one beyond float range (1e400) is refused, not turned into infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range")
    return value


def _lone_surrogate(value: Any) -> str | None:
    """The first string (key or value) holding a lone surrogate (from an escape like \\ud800), which no encoder
    can write: the record, the tokenizer and the response would all fail on it."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item.encode("utf-8", "backslashreplace").decode("ascii")[:40]
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes (--max-body-bytes, "
                    "serve.max_body_bytes)", code="request_too_large")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _completion_prompts(prompt: str | list[str] | list[int], tokenizer: PreTrainedTokenizerBase):
    """(text, token ids) per prompt; text prompts are tokenized with the tokenizer's special tokens (BOS)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        if any(not 0 <= p < len(tokenizer) for p in prompt):
            raise bad_request(f"prompt token ids must be in [0, {len(tokenizer)})", param="prompt")
        return [(tokenizer.decode(prompt, skip_special_tokens=False), list(prompt))]
    return [(text, tokenizer.encode(text)) for text in prompt]


def _text_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages without their image parts."""
    return [{**m, "content": [p for p in m["content"] if p["type"] != "image"]} if isinstance(m["content"], list)
            else m for m in messages]


def _chat_choice(choice: Choice, completer: Completer, logprobs: bool, token_ids: bool) -> dict[str, Any]:
    out = {"index": choice.index, "message": choice.message(), "finish_reason": choice.finish_reason,
           "logprobs": chat_logprobs(choice, completer.token_texts(choice.token_ids)) if logprobs else None}
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
