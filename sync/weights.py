"""The weight sync: the policy's weights pushed to the inference engines (stage ``sync_weights``).

:func:`sync_weights` is the weight sync whole: an engine *bracket*
(:mod:`sync.bracket`: pause/resume, sleep/wake, or both, around the transfer; its cleanups run
with what is left of the step's budget) around a *transfer* (:mod:`sync.transfer`: shielded,
bounded by the step's deadline plus ``sync.transfer_grace_s``, sent again once when it broke off
after reaching the engines). The bracket is a run's :attr:`~trainer.config.RunPlan.bracket`,
decided by :meth:`sync.bracket.Bracket.of`.

A transfer abandoned at its bound, or one that left the engines with partial weights, skips the
bracket's cleanups: the engines stay paused (asleep, when the bracket put them to sleep), and
the run ends; its teardown stops the engines and the workers.

``sync/last_weight_sync_seconds`` is the transfer alone (the bracket is ``timing/sync_weights``).
"""

from __future__ import annotations

from engines.types import EngineClient, PauseMode
from sync.bracket import Bracket, open_bracket
from sync.transfer import TRANSFER_GRACE_S as TRANSFER_GRACE_S
from sync.transfer import abandoned_detail as abandoned_detail
from sync.transfer import run_transfer as run_transfer
from sync.transfer import transfer_weights
from sync.transports.base import Rank0, WeightTransport

__all__ = [
    "TRANSFER_GRACE_S",
    "abandoned_detail",
    "run_transfer",
    "save_weights_for_sampler",
    "sync_weights",
]


async def sync_weights(
    engine: EngineClient,
    workers: Rank0,
    transport: WeightTransport,
    *,
    bracket: Bracket = Bracket.PAUSE,
    pause_mode: PauseMode = "keep",
    grace_s: float = TRANSFER_GRACE_S,
    weight_version: int | None = None,
) -> dict[str, float]:
    """Transfer the policy's weights inside the engine bracket; return the sync's metrics.

    ``weight_version``: the version the engines serve afterwards, the trainer's count of syncs
    (``/finish_weight_update`` carries it: :func:`sync.transports.base.finish_body`); None: the
    engines count for themselves. ``sync/last_weight_sync_seconds`` is the transfer alone. Raises the transfer's error,
    or the step deadline's typed error chained to it; cleanups never replace it. A transfer
    abandoned at the deadline plus ``grace_s`` leaves the engines as the transfer found
    them (paused or asleep): no cleanup runs.
    """
    async with open_bracket(bracket, engine, pause_mode) as cleanups:
        metrics = await transfer_weights(
            engine, workers, transport, cleanups, grace_s=grace_s, weight_version=weight_version
        )
    return metrics


#: Tinker's name for :func:`sync_weights` (a public name kept working; docs/architecture.md's
#: "Words" table gives the weight sync's one vocabulary).
save_weights_for_sampler = sync_weights
