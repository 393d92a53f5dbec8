"""Which engine bracket a weight sync runs in: decided once, from where the engines live.

:meth:`Bracket.of` is the one place that reads ``engine.colocated``,
``engine.offload_kv_for_weight_sync`` and whether rollouts go on during the sync
(``trainer.strategy=fully_async``); the sync itself (:func:`sync.weights.save_weights_for_sampler`),
the config's check of which control routes a run calls, and the engine servers' sleep mode all
read the answer.
"""

from __future__ import annotations

import enum

__all__ = ["Bracket"]


class Bracket(enum.Enum):
    """The calls around a transfer, in order (the last ones in cleanup brackets)."""

    #: pause -> transfer -> ``/reset_prefix_cache`` -> resume (the engines keep their memory).
    PAUSE = "pause"
    #: wake weights -> transfer -> wake kv_cache (``engine.colocated``: the engines sleep while
    #: the policy trains).
    COLOCATED = "colocated"
    #: sleep -> wake weights -> transfer -> wake kv_cache (``engine.offload_kv_for_weight_sync``).
    OFFLOAD_KV = "offload_kv"
    #: pause -> sleep -> wake weights -> transfer -> wake kv_cache -> resume (the same with
    #: rollouts that go on around the sync: fully-async).
    PAUSE_OFFLOAD_KV = "pause_offload_kv"

    @classmethod
    def of(cls, *, colocated: bool, offload_kv: bool, rollouts_continue: bool) -> Bracket:
        """The bracket of a run: colocated engines sleep whatever else is set."""
        if colocated:
            return cls.COLOCATED
        if offload_kv:
            return cls.PAUSE_OFFLOAD_KV if rollouts_continue else cls.OFFLOAD_KV
        return cls.PAUSE

    @property
    def sleeps(self) -> bool:
        """Whether the engines sleep (``/sleep``, ``/wake_up``; servers need sleep mode)."""
        return self is not Bracket.PAUSE

    @property
    def pauses(self) -> bool:
        """Whether generation is paused and resumed (``/pause``, ``/resume``)."""
        return self in (Bracket.PAUSE, Bracket.PAUSE_OFFLOAD_KV)

    @property
    def resets_prefix_cache(self) -> bool:
        """Whether ``/reset_prefix_cache`` drops the old weights' prefixes (a sleep clears them)."""
        return self is Bracket.PAUSE
