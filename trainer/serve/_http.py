"""What every route of the service shares: the refusal it raises (:class:`RequestError`),
reading and writing JSON bodies, and the SDK's error shape."""

from __future__ import annotations

import json
from typing import Any

from engines.local.http import Request, Response
from trainer.serve._futures import failed

__all__ = ["API", "RequestError", "error_response", "int_field", "json_body", "json_response"]

#: Where the SDK's routes are.
API = "/api/v1"


class RequestError(Exception):
    """A request this service refuses: its HTTP status and one sentence."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message


def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; ``RequestError`` (400) for anything else."""
    try:
        body = json.loads(request.body or b"{}")
    except ValueError:
        raise RequestError(400, f"{request.path}: the body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"{request.path}: the body is not a JSON object")
    return body


def int_field(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(400, f"{key} must be an integer, not {value!r}")
    return value


def json_response(payload: object, status: int = 200) -> Response:
    return Response(status, json.dumps(payload).encode())


def error_response(status: int, message: str, *, category: str = "user") -> Response:
    """The SDK's error shape (``RequestFailedResponse``) with HTTP ``status``."""
    return json_response(failed(message, category=category), status)
