"""The weight-transfer routes of the reference server, registered in this one place.

vLLM's four-phase protocol (``/init_weight_transfer_engine`` once, then
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) is implemented with
the weight-sync work (``sync/``); until then every method on these paths answers
``501 Not Implemented`` with a vLLM-style error body, so a client can tell "route missing"
(404: the ``vllm serve`` flag is not set) from "not implemented by this server" (501).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines.local.http import Request, Response, error_response

if TYPE_CHECKING:
    from engines.local.server import ServerApp

__all__ = ["WEIGHT_TRANSFER_PATHS", "handle_weight_transfer"]

WEIGHT_TRANSFER_PATHS = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)


async def handle_weight_transfer(app: ServerApp, request: Request) -> Response:
    """Answer one of :data:`WEIGHT_TRANSFER_PATHS` (any method): 501 for now."""
    return error_response(
        501,
        f"{request.path} is not implemented by the reference engine yet "
        "(implemented with weight sync)",
    )
