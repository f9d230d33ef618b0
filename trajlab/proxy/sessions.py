"""Which session a call belongs to: the ``/sessions/{id}/v1/...`` path, the ``X-Trajlab-Session`` header, or the
API key, in that order; "default" when none is given.

An API key names a session by its SHA-256 digest, so a black-box agent that only lets you set a key still gets
its own session, and the raw key is never written to disk.
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request

from trajlab.proxy.errors import bad_request
from trajlab.proxy.recording import valid_session_id

SESSION_HEADER = "X-Trajlab-Session"
DEFAULT_SESSION = "default"


def resolve_session(request: Request, path_id: str | None) -> tuple[str, str]:
    """(session id, where it came from: "path", "header", "api_key" or "default").

    Raises:
        APIError: 400 for an id outside ``[A-Za-z0-9._-]{1,128}`` (it names a file, so no path characters).
    """
    if path_id is not None:
        session, source = path_id, "path"
    elif (header := request.headers.get(SESSION_HEADER)) is not None:
        session, source = header, "header"
    elif (key := _bearer_key(request)) is not None:
        session, source = "key-" + hashlib.sha256(key.encode()).hexdigest()[:32], "api_key"
    else:
        session, source = DEFAULT_SESSION, "default"
    if not valid_session_id(session):
        raise bad_request(
            f"invalid session id {session[:200]!r} (from the {source}): use 1-128 characters of A-Z a-z 0-9 . _ -",
            param="session", code="invalid_session_id",
        )
    return session, source


def _bearer_key(request: Request) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return (key.strip() or None) if scheme.lower() == "bearer" else None
