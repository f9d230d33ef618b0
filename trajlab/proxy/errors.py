"""Errors in OpenAI's wire format: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause is an ``APIError`` raised where it is found; the app turns it (and framework errors
such as an unknown route) into this body, so a client library reports the message instead of a parse failure.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """A request the server refuses; ``status`` is the HTTP status, the rest goes into the error body."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_response(status: int, message: str, *, type: str | None = None, code: str | None = None) -> JSONResponse:
    kind = type or ("server_error" if status >= 500 else "invalid_request_error")
    return APIError(status, message, type=kind, code=code).response()
