"""Where a reward call runs, its bound, and what a failed one costs (``data.reward_*``).

:func:`open_rewards` binds the run's reward function to a :class:`RewardRunner`, after which
``await reward_fn.score(response, answer, extra=...)`` runs each call:

- an ``async def`` reward (an HTTP judge) on the trio loop, under ``trio.move_on_after(
  data.reward_timeout_s)``;
- a plain reward, with ``data.reward_workers > 0``, in a worker process of the run's pool
  (:mod:`trainer.data._reward_pool`), killed and replaced past ``data.reward_timeout_s``;
- a plain reward with ``data.reward_workers=0`` (the default) as before: called in the loop's
  thread, unbounded but for the step's deadline, an exception ending the run.

A call that timed out, raised or whose worker died scores ``data.reward_on_failure`` and is
counted in the :class:`RewardTally` of the batch (:func:`count_reward_failures`; the default
generator opens one per ``generate`` call and reports ``reward/timeouts`` and
``reward/errors``); the failure that takes a tally past ``data.max_reward_failures`` raises
``RewardError`` naming the function and that sample. A failure outside any tally counts
toward one tally for the whole run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trainer.data._examples import RewardFunction
from trainer.data._reward_pool import Outcome, RewardPool, open_reward_pool
from trainer.errors import ConfigError, RewardError

if TYPE_CHECKING:
    from trainer.config import DataConfig

__all__ = ["RewardRunner", "RewardTally", "count_reward_failures", "open_rewards"]

log = logging.getLogger(__name__)

#: How much of a failing response a RewardError and the log quote.
_QUOTE = 200


@attrs.define
class RewardTally:
    """Failed reward calls of one batch of rollouts."""

    timeouts: int = 0
    errors: int = 0

    @property
    def failures(self) -> int:
        return self.timeouts + self.errors

    def metrics(self) -> dict[str, float]:
        """``reward/timeouts`` and ``reward/errors``, as a step's metrics line has them."""
        return {"reward/timeouts": float(self.timeouts), "reward/errors": float(self.errors)}


_tally: ContextVar[RewardTally] = ContextVar("reward_tally")


@contextmanager
def count_reward_failures() -> Iterator[RewardTally]:
    """Count the reward failures of the calls made inside (tasks started inside included)."""
    tally = RewardTally()
    token = _tally.set(tally)
    try:
        yield tally
    finally:
        _tally.reset(token)


@attrs.define(eq=False)
class RewardRunner:
    """The run's policy for reward calls (module doc); ``pool`` when workers run them."""

    timeout_s: float | None
    on_failure: float
    max_failures: int
    pool: RewardPool | None = None
    #: Failures counted outside any :func:`count_reward_failures`.
    run_tally: RewardTally = attrs.field(factory=RewardTally)

    async def score(
        self, fn: RewardFunction, response: str, answer: str, extra: Mapping[str, Any] | None
    ) -> float:
        row = dict(extra or {})
        if fn.is_async:
            outcome = await self._awaited(fn, response, answer, row)
        elif self.pool is not None:
            outcome = await self.pool.call((response, answer, row), self.timeout_s)
        else:
            return float(fn(response, answer, row))
        kind, value = outcome
        if kind == "ok":
            return float(value)
        self._failed(fn, kind, value, response, answer)
        return self.on_failure

    async def _awaited(
        self, fn: RewardFunction, response: str, answer: str, extra: dict[str, Any]
    ) -> Outcome:
        with trio.move_on_after(math.inf if self.timeout_s is None else self.timeout_s):
            try:
                return "ok", float(await fn(response, answer, extra))
            except Exception as exc:
                return "error", f"{type(exc).__name__}: {exc}"
        return "timeout", f"it ran past data.reward_timeout_s={self.timeout_s:g}s (cancelled)"

    def _failed(self, fn: RewardFunction, kind: str, why: str, response: str, answer: str) -> None:
        tally = _tally.get(self.run_tally)
        if kind == "timeout":
            tally.timeouts += 1
        else:
            tally.errors += 1
        log.warning(
            "reward %s failed (%d in this batch, data.max_reward_failures=%d): %s",
            fn.name,
            tally.failures,
            self.max_failures,
            why,
        )
        if tally.failures > self.max_failures:
            raise RewardError(
                fn.name, tally.failures, self.max_failures, response[:_QUOTE], answer, why
            )


@asynccontextmanager
async def open_rewards(data: DataConfig, fn: RewardFunction) -> AsyncIterator[RewardFunction]:
    """``fn`` bound to the run's :class:`RewardRunner`, with its worker pool when
    ``data.reward_workers > 0`` and ``fn`` is not async (stopped, every worker reaped, on exit).

    ConfigError when the workers cannot import ``fn`` (a function defined inside another, or
    in ``__main__``).
    """
    runner = RewardRunner(data.reward_timeout_s, data.reward_on_failure, data.max_reward_failures)
    if data.reward_workers == 0 or fn.is_async:
        yield attrs.evolve(fn, runner=runner)
        return
    spec = fn.name
    if "<" in spec or spec.startswith("__main__:"):
        raise ConfigError(
            f"config: data.reward_workers={data.reward_workers} imports the reward function in "
            f"each worker, and {spec} cannot be imported there: define it at the top level of "
            "a module and name it with data.reward_fn=module:function"
        )
    async with open_reward_pool(spec, data.reward_workers, data.reward_max_memory_mb) as pool:
        runner.pool = pool
        yield attrs.evolve(fn, runner=runner)
