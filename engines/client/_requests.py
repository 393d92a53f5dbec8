"""One HTTP request to an inference server, and every way it can fail, as a typed error.

Shared by both halves of the client (``_control_plane`` and ``_inference``)::

    response = await send(http, url, "POST", "/pause", headers=headers, retry=RetryPolicy())
    body = decode_json(url, "/pause", response)

Errors: a non-2xx answer raises :class:`~trainer.errors.InferenceServerError` with the
status and an excerpt of the body (vLLM's error message when the body is an
``ErrorResponse``); a body that is not JSON raises it from :func:`decode_json`; a transport
failure raises it with ``status=None`` once the retries are spent. No httpx exception escapes.
Only transport errors are retried, with bounded exponential backoff; an HTTP status never is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import attrs
import httpx
import trio

from engines.client._routes import LORA_ROUTES
from engines.types import JSONValue, QueryParams
from trainer.errors import InferenceServerError
from trainer.vocabulary import current_step

__all__ = [
    "BODY_EXCERPT_CHARS",
    "CONNECT_ERRORS",
    "DEFAULT_RETRY",
    "RETRYABLE_ERRORS",
    "STEP_HEADER",
    "RetryPolicy",
    "decode_json",
    "send",
]

#: Characters of a response body carried by an ``InferenceServerError``.
BODY_EXCERPT_CHARS = 500
#: Header carrying the trainer's current step (the server fires injected faults with it).
STEP_HEADER = "X-Trainer-Step"

#: Transport errors after which the request never reached the server (safe to send again).
CONNECT_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
)
#: Transport errors after which a data-plane request may be sent again.
RETRYABLE_ERRORS: tuple[type[Exception], ...] = (
    *CONNECT_ERRORS,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


@attrs.frozen
class RetryPolicy:
    """How often, and how patiently, a request is sent again after a transport error: one
    setting of a client (``InferenceClient(urls, retry=RetryPolicy(max_retries=5))``). Which
    errors are retried is the request's (a control call retries only failed connections,
    :data:`CONNECT_ERRORS`; a generation every transport error, :data:`RETRYABLE_ERRORS`).
    ``ValueError`` for a negative count or wait."""

    #: Retries after the first attempt (``max_retries + 1`` attempts in all).
    max_retries: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    #: Wait before the first retry; doubled before each next one.
    backoff_s: float = attrs.field(default=0.2, validator=attrs.validators.ge(0.0))
    #: Longest wait between two attempts.
    max_backoff_s: float = attrs.field(default=2.0, validator=attrs.validators.ge(0.0))

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0-based)."""
        return min(self.max_backoff_s, self.backoff_s * 2**attempt)


#: The clients' default: 3 retries, 0.2 s doubling up to 2 s (about 1.4 s of waiting in all).
DEFAULT_RETRY = RetryPolicy()


def _step_headers(headers: Mapping[str, str]) -> Mapping[str, str]:
    """``headers`` plus ``X-Trainer-Step`` when a step is current (see ``current_step``)."""
    step = current_step()
    if step is None:
        return headers
    return {**headers, STEP_HEADER: str(step)}


async def send(
    http: httpx.AsyncClient,
    url: str,
    method: str,
    path: str,
    *,
    headers: Mapping[str, str],
    retry: RetryPolicy,
    retry_on: tuple[type[Exception], ...] = RETRYABLE_ERRORS,
    params: QueryParams | None = None,
    json_body: object = None,
) -> httpx.Response:
    """``method url+path`` with the step header; the 2xx response.

    Raises ``InferenceServerError`` for a non-2xx answer (never retried), or for a transport
    error: at once when it is not in ``retry_on``, else once ``retry.max_retries`` retries
    failed too. Cancellation drops the request in flight.
    """
    attempt = 0
    while True:
        try:
            response = await http.request(
                method,
                url + path,
                params=params,
                json=json_body,
                headers=_step_headers(headers),
            )
            break
        except retry_on as exc:
            if attempt >= retry.max_retries:
                raise InferenceServerError(
                    url,
                    path,
                    None,
                    f"transport error after {attempt + 1} attempts: {type(exc).__name__}: {exc}",
                ) from None
            await trio.sleep(retry.backoff(attempt))
            attempt += 1
        except httpx.HTTPError as exc:
            raise InferenceServerError(url, path, None, f"{type(exc).__name__}: {exc}") from None
    if not response.is_success:
        raise InferenceServerError(url, path, response.status_code, _body_excerpt(response))
    return response


def _body_excerpt(response: httpx.Response) -> str:
    """vLLM's error message when the body is an ``ErrorResponse``, else the start of the body."""
    text = response.text
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"][:BODY_EXCERPT_CHARS]
        if isinstance(err, str):
            return err[:BODY_EXCERPT_CHARS]
    except (ValueError, AttributeError):
        pass
    return text[:BODY_EXCERPT_CHARS] or "(empty body)"


def decode_json(url: str, path: str, response: httpx.Response) -> JSONValue:
    """The body as JSON; ``None`` for an empty body; ``InferenceServerError`` when malformed.
    vLLM's LoRA routes answer a sentence: their body is returned as the string it is."""
    if not response.content:
        return None
    if path in LORA_ROUTES:
        return response.text
    try:
        return response.json()
    except ValueError:
        raise InferenceServerError(
            url,
            path,
            response.status_code,
            f"malformed JSON body: {response.text[:BODY_EXCERPT_CHARS]!r}",
        ) from None
