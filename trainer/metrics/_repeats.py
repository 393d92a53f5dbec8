"""Repeated warnings on the console: the first of each kind at once, then one line per step at
most with the count, fewer and fewer as they go on, and a closing count; ``train.log`` keeps
every one.

A reward that times out on 5% of replies, or dynamic sampling that runs out of rounds on an
easy task, writes the same warning again and again; a console full of them hides the one
that matters. A *kind* is the logger and the message's template (``record.msg`` before its
arguments): ``reward %s failed (...): %s`` is one kind whatever the reward and the reason.

- The first warning of a kind is shown as it comes.
- The rest are held. At the end of a step (:func:`end_step`), a kind held in that step gets one
  line, its latest message with ``[N more like this since the last such line, T in all;
  each in train.log]`` — on the 1st, 2nd, 4th, 8th, ... step the kind recurs in, so a warning
  of every step costs a handful of lines over a long run, not one each.
- At the end of the run (:meth:`RepeatedWarnings.close`) each kind seen more than once gets a
  line with its total.

The filter sits on the console handler only (:func:`~trainer.metrics.setup_run_logging`);
the file handler writes every record to ``train.log``.
"""

from __future__ import annotations

import logging

import attrs

__all__ = ["RepeatedWarnings", "end_step"]


@attrs.define
class _Kind:
    total: int = 1
    #: Held since the last line shown for the kind.
    unshown: int = 0
    #: Held in the step that runs now.
    this_step: int = 0
    #: Steps the kind was held in so far (a line at 1, 2, 4, 8, ...).
    steps: int = 0
    latest: logging.LogRecord | None = None


class RepeatedWarnings(logging.Filter):
    """The console handler's filter of repeated warnings (see the module docstring)."""

    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler
        self.kinds: dict[tuple[str, str], _Kind] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "aggregate", False):
            return True
        key = (record.name, str(record.msg))
        kind = self.kinds.get(key)
        if kind is None:
            self.kinds[key] = _Kind()
            return True
        kind.total += 1
        kind.unshown += 1
        kind.this_step += 1
        kind.latest = record
        return False

    def end_step(self, step: int) -> None:
        """Step ``step`` ended: a line for each kind held in it whose turn it is."""
        for kind in self.kinds.values():
            if not kind.this_step:
                continue
            kind.this_step = 0
            kind.steps += 1
            if kind.steps & (kind.steps - 1) == 0:  # 1, 2, 4, 8, ...
                self._show(kind, f"step {step}")

    def close(self) -> None:
        """The run ends: held warnings and each repeated kind's total, one line per kind."""
        for kind in self.kinds.values():
            if kind.total > 1 and kind.latest is not None:
                self._show(kind, "the run")

    def _show(self, kind: _Kind, where: str) -> None:
        latest = kind.latest
        assert latest is not None
        count = (
            f"{kind.unshown} more like this since the last such line, {kind.total} in all"
            if kind.unshown
            else f"{kind.total} in all"
        )
        line = logging.makeLogRecord(
            {
                "name": latest.name,
                "levelno": latest.levelno,
                "levelname": latest.levelname,
                "msg": f"{latest.getMessage()} [{count} by the end of {where}; each in train.log]",
                "aggregate": True,
            }
        )
        kind.unshown = 0
        self.handler.handle(line)


def end_step(step: int, logger: str = "trainer") -> None:
    """Tell the run's console filter (where one is installed on ``logger``) that ``step``
    ended; a no-op without one."""
    for handler in logging.getLogger(logger).handlers:
        for f in handler.filters:
            if isinstance(f, RepeatedWarnings):
                f.end_step(step)
