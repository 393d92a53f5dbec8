"""``WeightVersions``: what the engines serve, counted once for both strategies.

``current`` counts the weight syncs (``sync/weight_version``, restored on resume);
``policy_step`` is the trained step whose weights those are (0: the initial policy), which
fully-async admission bounds staleness against (:mod:`trainer.loop._staleness`); ``syncing``
says a sync is under way, which the fully-async engine labels tokens by
(:mod:`trainer.loop._rollout_versions`). Only :func:`trainer.loop._steps.sync_weights` moves
them, and :func:`trainer.run.train` once, when it resumes (:meth:`WeightVersions.resumed`).
"""

from __future__ import annotations

import attrs
import trio

from engines.types import PauseMode

__all__ = ["WeightVersions"]


@attrs.define(eq=False)
class WeightVersions:
    """The weight version the engines serve, the trained step it is, and whether a sync runs."""

    current: int = 0
    policy_step: int = 0
    #: True from just before a sync's ``/pause`` until its new version is counted.
    syncing: bool = False
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)

    def resumed(self, syncs: int) -> None:
        """A resumed run's engines count on from the checkpoint's ``syncs`` (its
        ``weight_version``), before the first step."""
        self.current = syncs

    @property
    def upcoming(self) -> int:
        """The version the sync under way makes, once :meth:`synced` counts it; the sync names
        it to the engines (``/finish_weight_update``), which take it as theirs."""
        return self.current + 1

    def synced(self, policy_step: int | None) -> None:
        """One more sync is done; the engines serve trained step ``policy_step``'s weights
        (None: the same policy again, as a restarted engine's sync sends)."""
        self.current += 1
        if policy_step is not None:
            self.policy_step = policy_step
        self.notify()

    def notify(self) -> None:
        """Wake every :meth:`wait_changed`."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Until the next :meth:`synced` or :meth:`notify`."""
        await self._changed.wait()

    def label(
        self, finish_reason: str, pause_mode: PauseMode, sent_at: int, sent_syncing: bool
    ) -> int:
        """The version of the tokens of one request (see :mod:`trainer.loop._rollout_versions`)."""
        if pause_mode == "abort" and sent_syncing and finish_reason != "abort":
            return sent_at + 1
        return sent_at
