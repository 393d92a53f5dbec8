"""The interface ``sync_weights`` drives, and what a transport may ask of the workers.

A transport owns both halves of a weight sync: the trainer side here in ``sync`` (what runs
on policy rank 0, through :meth:`Rank0.run_on_rank0`) and the engine side in ``engines``
(the server's weight-transfer routes). The worker group knows no transport: it only runs a
function on rank 0, with rank 0's policy model as the first argument.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import attrs

from engines.types import ControlPlaneClient, EngineClient

__all__ = [
    "WEIGHT_DIR_MODE",
    "Rank0",
    "TransportSettings",
    "WeightTransport",
    "finish_body",
    "make_sync_dir",
    "remove_if_empty",
    "routes_of",
]

#: The mode of the weight folder (``RUN_DIR/weight_sync``) and of each sync's folder in it, where
#: a transport makes them: the run's owner alone (the engines it starts run as the same user).
WEIGHT_DIR_MODE = 0o700

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


def make_sync_dir(target: Path) -> None:
    """Make one sync's folder ``target`` inside the weight folder, both private
    (:data:`WEIGHT_DIR_MODE`), the weight folder only when a transport first writes into it
    (so a run whose transport writes no files leaves none). Existing folders are kept as they
    are (a resumed run's transport counts its syncs from 1 again)."""
    target.parent.mkdir(mode=WEIGHT_DIR_MODE, parents=True, exist_ok=True)
    target.mkdir(mode=WEIGHT_DIR_MODE, exist_ok=True)


def remove_if_empty(directory: Path) -> None:
    """Remove ``directory`` when it is empty (a file transport's close: a run leaves no empty
    ``weight_sync/``). One that holds anything, or is gone, is left as it is."""
    with contextlib.suppress(OSError):  # not empty, or absent
        os.rmdir(directory)
