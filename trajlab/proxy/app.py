"""The FastAPI app every backend shares (the model served here, :mod:`trajlab.proxy.local`, or an upstream server,
:mod:`trajlab.proxy.upstream`): ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``, each also under
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
from starlette.requests import ClientDisconnect

from trajlab.config import ServeSettings
from trajlab.models.devices import release_freed_memory
from trajlab.proxy.errors import APIError, bad_request, error_response
from trajlab.proxy.recording import RECORD_SCHEMA, SessionRecorder
from trajlab.proxy.sessions import resolve_session
from trajlab.proxy.streaming import sse

logger = logging.getLogger(__name__)

RELEASE_EVERY_S = 1.0
"""Least seconds between two hand-backs of freed heap pages (``_CallHandler``); each costs 2-15 ms off the loop."""

LARGE_BODY_BYTES = 1 << 20
"""Bodies larger than this are prepared one at a time (``CallContext.hold_gate``): one body of 100,000 small messages
parses, validates and renders into about 120 MB of objects, and four such calls at once took four times that."""


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
    gate: asyncio.Semaphore | None = None
    """The server's gate for large bodies; held from the body's arrival until ``release_gate``."""
    holds_gate: bool = False

    async def hold_gate(self) -> None:
        """Wait until no other large body is being prepared. Preparing is synchronous work on the event loop, so
        calls gain nothing by overlapping there; what they overlap is a refused call's recording (a thread) with the
        next call's parsing, each holding its body's objects."""
        if self.gate is not None and not self.holds_gate:
            await self.gate.acquire()
            self.holds_gate = True

    def release_gate(self) -> None:
        """Let the next large body in: called once the prompt is made (the backend, before generating) or when the
        call ends, whichever comes first."""
        if self.holds_gate:
            self.holds_gate = False
            self.gate.release()

    def record(self, model: str, **fields: Any) -> dict[str, Any]:
        return {"schema": RECORD_SCHEMA, "session_id": self.session, "session_source": self.source,
                "request_id": self.request_id, "endpoint": self.endpoint, "timestamp": self.started,
                "duration_s": round(time.time() - self.started, 6), "model": model, "request": self.body, **fields}


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
    handle = _CallHandler(recorder, model_name)

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

    _add_error_handlers(app)
    return app


class _CallHandler:
    """Answers one call: resolves its session, runs the endpoint's work, records the outcome (success or error) in
    the session's file before the response is sent."""

    def __init__(self, recorder: SessionRecorder, model_name: str) -> None:
        self.recorder, self.model_name = recorder, model_name
        self._released, self._release_pending = 0.0, False
        self._large_bodies = asyncio.Semaphore(1)

    async def __call__(self, request: Request, session_path: str | None, endpoint: str, work: Work) -> Response:
        session, source = resolve_session(request, session_path)
        prefix = "chatcmpl" if endpoint.endswith("chat/completions") else "cmpl"
        call = CallContext(session, source, f"{prefix}-{uuid.uuid4().hex}", endpoint, time.time(),
                           gate=self._large_bodies)
        try:
            return await self._answer(request, call, work)
        finally:
            call.release_gate()
            self._release_memory_soon()

    def _release_memory_soon(self) -> None:
        """Hand freed heap pages back to the system once the call is done, at most every ``RELEASE_EVERY_S`` and
        always after the last call of a burst. A call frees what its body, prompt and record took (a 4 MiB body
        parses into hundreds of MB of objects); glibc keeps such memory resident, in the heap of whichever thread
        freed it, so without this the server kept most of what its largest calls ever took."""
        if self._release_pending:
            return
        self._release_pending = True
        loop = asyncio.get_running_loop()
        loop.call_later(max(0.0, self._released + RELEASE_EVERY_S - time.monotonic()), self._release, loop)

    def _release(self, loop: asyncio.AbstractEventLoop) -> None:
        self._release_pending, self._released = False, time.monotonic()
        loop.run_in_executor(None, release_freed_memory)

    async def _answer(self, request: Request, call: CallContext, work: Work) -> Response:
        try:
            response, fields, stream = await _unless_disconnected(request, call, work(request, call))
        except ClientGone as exc:
            reason = str(exc) or "the client disconnected before the response; its generation was cancelled"
            logger.info("request %s: client closed request (499): %s", call.request_id, reason)
            gone = APIError(499, reason, type="client_closed_request")
            await self._record(call, status=499, error=gone.body()["error"])
            return Response(status_code=499)  # nobody reads it
        except APIError as exc:
            # The client's error needs no traceback, and its frames (and its cause's) hold the call's parsed body,
            # request and prompt until the error's response is sent, long after the next call's began.
            exc.__traceback__ = exc.__cause__ = exc.__context__ = None
            await self._record(call, status=exc.status, error=exc.body()["error"])
            raise exc
        except Exception as exc:
            logger.exception("request %s failed", call.request_id)
            error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
            await self._record(call, status=500, error=error.body()["error"])
            raise error from exc
        await self._record(call, status=200, **fields, error=None)
        if stream is not None:
            return StreamingResponse(sse(stream), media_type="text/event-stream")
        return JSONResponse(response)

    async def _record(self, call: CallContext, **fields: Any) -> None:
        record = call.record(call.model or self.model_name, **fields)
        await asyncio.to_thread(self.recorder.append, call.session, record, call.images)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's JSON error body: ours, Starlette's (unknown routes), FastAPI's validation."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, str(exc.errors()[:1]))


class ClientGone(Exception):
    """The client closed its connection while its call was being answered (the message: while it sent its body)."""


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
    except ClientDisconnect as exc:  # the client's doing, not a server error: no traceback in the server's log
        raise ClientGone(f"the client disconnected while sending its body ({len(body)} bytes received)") from exc
    call.body_read.set()
    if len(body) > LARGE_BODY_BYTES:
        await call.hold_gate()
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


