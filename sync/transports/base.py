"""The interface ``sync_weights`` drives, and what a transport may ask of the workers.

A transport owns both halves of a weight sync: the trainer side here in ``sync`` (what runs
on policy rank 0, through :meth:`Rank0.run_on_rank0`) and the engine side in ``engines``
(the server's weight-transfer routes). The worker group knows no transport: it only runs a
function on rank 0, with rank 0's policy model as the first argument.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import attrs

from engines.types import ControlPlaneClient, EngineClient

__all__ = ["Rank0", "TransportSettings", "WeightTransport", "finish_body", "routes_of"]

T = TypeVar("T")


@attrs.frozen
class TransportSettings:
    """What a run gives its transport (``sync.*`` and the workers' collective bound)."""

    name: str
    bucket_bytes: int
    #: Where ``disk`` writes its buckets (``RUN_DIR/weight_sync``).
    directory: Path
    group_init_timeout_s: float
    timeout_s: float
    master_address: str | None = None
    packed: bool = True


class Rank0(Protocol):
    """The one thing a transport needs of the worker group (``trainer.workers.WorkerGroup``)."""

    async def run_on_rank0(
        self,
        fn: Callable[..., T],
        *args: object,
        abandon_on_cancel: bool = False,
    ) -> T:
        """``fn(policy_model, *args)`` where policy rank 0 runs (a thread here, or its actor).

        ``fn`` must be a module-level function (it may travel to another process). Not
        abandoned by default: a cancellation waits for it (DESIGN 3 rule 6);
        ``abandon_on_cancel=True`` lets the caller give up on it (a bounded init).
        """
        ...


class WeightTransport(Protocol):
    """Moves the policy's current weights into every engine.

    ``init`` runs once (engines up, workers created); ``transfer`` runs inside
    ``operation("broadcast_to_inference_engines")`` with generation paused and returns once
    every engine serves the new weights (applied atomically with respect to requests, by
    the engine), labelled ``weight_version`` where it is given (the trainer's count of syncs:
    a route-based transport sends :func:`finish_body`); ``close`` releases what ``init`` built
    (bounded; safe after a failure).

    A transport may also have ``resend_refusal``: why it cannot run ``transfer`` again after
    one failed midway (None, or no such attribute: it can). ``sync.transfer`` sends the
    weights once more after a transfer that reached the engines broke off.
    """

    async def init(self, engine: EngineClient, workers: Rank0) -> None: ...

    async def transfer(
        self, engine: EngineClient, workers: Rank0, *, weight_version: int | None = None
    ) -> None: ...

    async def close(self, workers: Rank0) -> None: ...


def finish_body(weight_version: int | None) -> dict[str, str]:
    """``/finish_weight_update``'s body: the trainer's weight version as vLLM's label.

    vLLM (0.32 and 0.33) takes ``{"weight_version": str | null}`` there and, once the update
    is finished, labels the weights with it (``GET /weight_info``; the tokens of later
    completions); an integer is a 422. The reference engine adopts the number as its own
    ``weight_version``. None: ``{}``, as before (vLLM keeps its label; the reference counts
    one more).
    """
    return {} if weight_version is None else {"weight_version": str(weight_version)}


def routes_of(engine: EngineClient) -> ControlPlaneClient:
    """``engine`` as the route-based transports drive it; ``TypeError`` when it takes no control
    routes (a transport paired with an engine it cannot reach: ``validate_cfg`` refuses the
    configurations that would)."""
    if not isinstance(engine, ControlPlaneClient):
        raise TypeError(
            f"{type(engine).__name__} takes no control routes (/start_weight_update, ...): "
            "use sync.transport=inprocess with it"
        )
    return engine
