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

from trainer.loop._versions import WeightVersions

__all__ = ["Admission", "staleness"]


def staleness(train_step: int, policy_step: int) -> int:
    """Optimizer steps between the policy that sampled a group and the one training on it."""
    return train_step - 1 - policy_step


@attrs.define(eq=False)
class Admission:
    """Counts admitted groups against the staleness bound; :meth:`admit` waits for room.

    The step whose weights the engines serve is ``versions.policy_step``, the run's one
    count of it (:class:`~trainer.loop._versions.WeightVersions`, moved by each sync).
    """

    batch_size: int
    max_staleness: int
    versions: WeightVersions
    #: Groups counted against the bound (see the module docstring).
    admitted: int = 0

    @classmethod
    def resumed(cls, batch_size: int, max_staleness: int, versions: WeightVersions) -> Admission:
        """With the engines on trained step ``versions.policy_step``: that many steps' groups
        counted (a resumed run's first sync puts the engines on its checkpoint's step)."""
        return cls(batch_size, max_staleness, versions, admitted=versions.policy_step * batch_size)

    @property
    def policy_step(self) -> int:
        """The trained step whose weights the engines serve (0: the initial policy)."""
        return self.versions.policy_step

    @property
    def capacity(self) -> int:
        return (self.max_staleness + self.policy_step + 1) * self.batch_size

    async def admit(self) -> int:
        """Wait until a group may start, count it; return the policy step it starts on."""
        while self.admitted >= self.capacity:
            await self.versions.wait_changed()
        self.admitted += 1
        return self.policy_step

    def release(self) -> None:
        """A dropped group's place is free again."""
        self.admitted -= 1
        self.versions.notify()

    def count_again(self, n: int) -> None:
        """``n`` released groups are trained after all (dynamic sampling's fallback): counted
        again, as every trained group is."""
        self.admitted += n
