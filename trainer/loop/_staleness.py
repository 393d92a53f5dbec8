"""Admission control: how far fully-async generation may run ahead of training.

Staleness counts optimizer steps: a group sampled by the policy of trained step ``p`` (the
weights the engines served when it started; 0 is the initial policy) and trained at step
``s`` is ``s - 1 - p`` steps stale (the synchronous loop's groups are 0 steps stale).

A group may start only while ``admitted < (max_staleness + p_engine + 1) * batch_size``,
where ``admitted`` counts every group admitted since step 0 (trained, waiting in the buffer
or running) less the dropped ones, and ``p_engine`` is the step whose weights the engines
serve. Groups are trained in batches of ``batch_size`` as they complete, so the ``a``-th
admitted group (from 0) is trained at step ``a // batch_size + 1`` unless groups admitted
after it overtake it; when none do, its staleness is at most ``max_staleness``. A group
overtaken far enough to be older than the bound is dropped by the trainer (never trained
on) and its prompt re-queued; :meth:`Admission.release` gives its place back.
"""

from __future__ import annotations

import attrs
import trio

__all__ = ["Admission", "staleness"]


def staleness(train_step: int, policy_step: int) -> int:
    """Optimizer steps between the policy that sampled a group and the one training on it."""
    return train_step - 1 - policy_step


@attrs.define(eq=False)
class Admission:
    """Counts admitted groups against the staleness bound; :meth:`admit` waits for room."""

    batch_size: int
    max_staleness: int
    #: The trained step whose weights the engines serve (0: the initial policy).
    policy_step: int = 0
    #: Groups counted against the bound (see the module docstring).
    admitted: int = 0
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)

    @classmethod
    def resumed(cls, batch_size: int, max_staleness: int, step: int) -> Admission:
        """After ``step`` trained steps: their groups counted, the engines on step ``step``'s policy."""
        return cls(batch_size, max_staleness, policy_step=step, admitted=step * batch_size)

    @property
    def capacity(self) -> int:
        return (self.max_staleness + self.policy_step + 1) * self.batch_size

    async def admit(self) -> int:
        """Wait until a group may start, count it; return the policy step it starts on."""
        while self.admitted >= self.capacity:
            await self._changed.wait()
        self.admitted += 1
        return self.policy_step

    def release(self) -> None:
        """A dropped group's place is free again."""
        self.admitted -= 1
        self._notify()

    def synced(self, policy_step: int) -> None:
        """The engines now serve trained step ``policy_step``'s weights."""
        self.policy_step = policy_step
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
