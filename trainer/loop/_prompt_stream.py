"""The prompts of a fully-async run, one group at a time, resumable with nothing lost or doubled.

The synchronous loop takes a step's prompts as one batch (``PromptLoader``). Fully-async
rollouts take one prompt at a time and finish out of order, so the stream also knows which
prompts are *in flight*: handed to a rollout task, not yet trained on. A checkpoint
records the stream's position and those prompts; a resume hands them out again first, so
every prompt of an epoch is trained on exactly once across a kill and resume. A group
dropped as too stale is re-queued the same way.

A prompt is named by its key ``(epoch, position)``: its place in the epoch's order, which
is :func:`trainer.data._examples.epoch_order` (the synchronous loop's order too).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs
import trio

from trainer.data import Example, check_same_order, check_same_strategy, epoch_order

__all__ = ["PromptKey", "PromptStream"]

#: ``(epoch, position)``: where a prompt sits in the run's data order.
PromptKey = tuple[int, int]


@attrs.define(eq=False)
class PromptStream:
    """Every epoch's prompts in order, then nothing: :meth:`take` waits for a re-queued one."""

    examples: list[Example]
    seed: int
    #: Epochs to hand out (``trainer.epochs``).
    epochs: int
    epoch: int = 0
    position: int = 0
    #: Handed out and not yet trained on (running, or waiting in the buffer).
    in_flight: set[PromptKey] = attrs.field(factory=set)
    #: Handed out again before the stream moves on (a resume's in-flight prompts, stale drops).
    requeued: deque[PromptKey] = attrs.field(factory=deque)
    _more: trio.Event = attrs.field(factory=trio.Event, init=False)

    def example(self, key: PromptKey) -> Example:
        epoch, position = key
        return self.examples[epoch_order(len(self.examples), self.seed, epoch)[position]]

    @property
    def exhausted(self) -> bool:
        """Every prompt of every epoch handed out and none waiting to be handed out again."""
        return self.epoch >= self.epochs and not self.requeued

    async def take(self) -> tuple[PromptKey, Example]:
        """The next prompt (re-queued ones first); waits while the stream is exhausted."""
        while self.exhausted:
            self._more = trio.Event()
            await self._more.wait()
        if self.requeued:
            key = self.requeued.popleft()
        else:
            key = (self.epoch, self.position)
            self.position += 1
            if self.position >= len(self.examples):
                self.epoch, self.position = self.epoch + 1, 0
        self.in_flight.add(key)
        return key, self.example(key)

    def trained(self, key: PromptKey) -> None:
        self.in_flight.discard(key)

    def requeue(self, key: PromptKey) -> None:
        """Hand ``key`` out again (its rollouts were dropped)."""
        self.in_flight.discard(key)
        self.requeued.append(key)
        self._more.set()

    def state_dict(self) -> dict[str, Any]:
        """The position, the prompts to hand out again (in flight first, oldest first), and
        what fixes the order (checked by :meth:`load_state_dict`)."""
        return {
            "strategy": "fully_async",
            "epoch": self.epoch,
            "position": self.position,
            "pending": [list(k) for k in [*sorted(self.in_flight), *self.requeued]],
            "seed": self.seed,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s position, its pending prompts first.

        ConfigError for a checkpoint of the synchronous loop (its batches are not this
        stream's groups) or one whose data order differs (another seed or prompt count).
        """
        check_same_strategy(state, "fully_async")
        check_same_order(
            state,
            ("seed", "trainer.seed", self.seed),
            ("num_examples", "the number of training prompts", len(self.examples)),
        )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.in_flight = set()
        self.requeued = deque((int(e), int(p)) for e, p in state["pending"])
