"""Fault specs: ``OP:ACTION[@STEPS],...`` parsed into :class:`Faults` (DESIGN 4.5).

- ``OP`` is one of :data:`~trainer.vocabulary.OPERATIONS` (the operations of DESIGN 4.3).
- ``ACTION`` is ``hang`` (never returns), ``sleep=S`` (a blocking sleep of S seconds where
  the operation runs), ``delay=S`` (a non-blocking wait of S seconds) or ``error=MSG``
  (raises :class:`~trainer.errors.FaultInjected`). ``MSG`` cannot contain ``,``; the last
  ``@`` of an entry starts ``STEPS``. Two act on an engine server rather than where the
  operation runs, once per entry: ``kill_engine=I`` (``SIGKILL`` to engine ``I``'s server,
  its whole process group: it dies) and ``stop_engine=I`` (``SIGSTOP``: it hangs), for the
  operations the trainer itself runs (:data:`ENGINE_SIGNAL_OPS`).
- Four make the reference engine's sampler disagree with the trainer on purpose, silently (the
  call succeeds), each at the one operation where it happens (:data:`SKEW_OPS`):
  ``/finish_weight_update:stale`` (the update is acknowledged, the previous weights keep
  serving), ``/update_weights:drop_bucket`` (the bucket is acknowledged and not applied),
  ``generate:bf16_logits`` (the logits are rounded to bfloat16 before sampling and
  logprobs, as a bf16 engine's are) and ``/v1/load_lora_adapter:skip_load`` (a LoRA adapter's
  load is acknowledged and not done: the previous adapter serves on). They show what catches such
  a bug (``sync.verify``, the ``mismatch/*`` diagnostics; docs/algorithms.md).
- ``STEPS`` is ``N`` or ``N-M`` (inclusive); without it the fault fires on every call, with
  it only when the current step is known and in range.
"""

from __future__ import annotations

import difflib
import enum
import math
import re
from collections.abc import Iterator, Mapping

import attrs

from trainer.errors import ConfigError
from trainer.vocabulary._names import OPERATIONS

__all__ = ["ENGINE_SIGNAL_OPS", "SKEW_OPS", "Action", "Fault", "Faults", "parse_faults"]

_ACTIONS_HELP = (
    "hang, sleep=S, delay=S, error=MSG, kill_engine=I, stop_engine=I, "
    "or at their one operation stale, drop_bucket, bf16_logits or skip_load"
)
#: The operations an engine-signal action may target: those the trainer's own trio thread
#: runs (engine servers and workers fire the others, and cannot signal an engine).
ENGINE_SIGNAL_OPS = ("generate", "wait_for_batch")
_STEPS_RE = re.compile(r"(\d+)(?:-(\d+))?")


class Action(enum.Enum):
    """What a fault does when it fires."""

    HANG = "hang"
    SLEEP = "sleep"
    DELAY = "delay"
    ERROR = "error"
    KILL_ENGINE = "kill_engine"
    STOP_ENGINE = "stop_engine"
    STALE = "stale"
    DROP_BUCKET = "drop_bucket"
    BF16_LOGITS = "bf16_logits"
    SKIP_LOAD = "skip_load"

    @property
    def signals_engine(self) -> bool:
        """Whether it acts on an engine server (once), not where the operation runs."""
        return self in (Action.KILL_ENGINE, Action.STOP_ENGINE)

    @property
    def skews_sampler(self) -> bool:
        """Whether it makes the reference engine disagree silently (:data:`SKEW_OPS`) rather
        than hang, wait or fail: the engine asks for it where it does the work."""
        return self in SKEW_OPS


#: Each sampler-skewing action and the one operation it fires at.
SKEW_OPS: Mapping[Action, str] = {
    Action.STALE: "/finish_weight_update",
    Action.DROP_BUCKET: "/update_weights",
    Action.BF16_LOGITS: "generate",
    Action.SKIP_LOAD: "/v1/load_lora_adapter",
}


@attrs.frozen
class Fault:
    """One parsed ``OP:ACTION[@STEPS]`` entry."""

    #: The operation it targets, one of :data:`OPERATIONS`.
    op: str = attrs.field(validator=attrs.validators.in_(OPERATIONS))
    #: What it does.
    action: Action
    #: Seconds for ``sleep``/``delay``; ``None`` otherwise.
    seconds: float | None = None
    #: The message for ``error``; ``None`` otherwise.
    message: str | None = None
    #: Inclusive ``(first, last)`` steps; ``None`` fires on every call, step known or not.
    steps: tuple[int, int] | None = None
    #: The engine index of ``kill_engine``/``stop_engine``; ``None`` otherwise.
    engine: int | None = None

    def applies_to(self, step: int | None) -> bool:
        """Whether this fault fires at ``step`` (``None``: the step is unknown)."""
        if self.steps is None:
            return True
        return step is not None and self.steps[0] <= step <= self.steps[1]

    def __str__(self) -> str:
        if self.action is Action.ERROR:
            action = f"error={self.message}"
        elif self.action.signals_engine:
            action = f"{self.action.value}={self.engine}"
        elif self.seconds is not None:
            action = f"{self.action.value}={self.seconds:g}"
        else:
            action = self.action.value
        if self.steps is None:
            steps = ""
        elif self.steps[0] == self.steps[1]:
            steps = f"@{self.steps[0]}"
        else:
            steps = f"@{self.steps[0]}-{self.steps[1]}"
        return f"{self.op}:{action}{steps}"


@attrs.frozen
class Faults:
    """The faults active in a process, in spec order; empty when none.

    ``Faults.parse("forward_backward:hang@2").match("forward_backward", 2)`` is the fault
    that fires there; the first entry that applies wins.
    """

    #: The parsed entries, in the order they were written.
    faults: tuple[Fault, ...] = ()
    #: Per operation, its entries (every operation present, most with ``()``).
    _by_op: Mapping[str, tuple[Fault, ...]] = attrs.field(
        init=False,
        repr=False,
        eq=False,
        default=attrs.Factory(lambda self: _table_of(self.faults), takes_self=True),
    )

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """Parse ``spec`` (see :func:`parse_faults`)."""
        return cls(parse_faults(spec))

    @property
    def spec(self) -> str:
        """The canonical spec string; ``Faults.parse(f.spec) == f``."""
        return ",".join(str(f) for f in self.faults)

    def entries(self, op: str) -> tuple[Fault, ...]:
        """``op``'s entries, in spec order; ``ValueError`` for an op not in ``OPERATIONS``."""
        try:
            return self._by_op[op]
        except KeyError:
            raise ValueError(
                f"unknown operation {op!r}; operations: {', '.join(OPERATIONS)}"
            ) from None

    def match(self, op: str, step: int | None) -> Fault | None:
        """The fault that fires for ``op`` at ``step``, or ``None``."""
        for f in self.entries(op):
            if f.applies_to(step):
                return f
        return None

    def __bool__(self) -> bool:
        return bool(self.faults)

    def __iter__(self) -> Iterator[Fault]:
        return iter(self.faults)

    def __len__(self) -> int:
        return len(self.faults)


def _table_of(faults: tuple[Fault, ...]) -> dict[str, tuple[Fault, ...]]:
    table: dict[str, tuple[Fault, ...]] = dict.fromkeys(OPERATIONS, ())
    for f in faults:
        table[f.op] = (*table[f.op], f)
    return table


def _bad(what: str, entry: str, allowed: str) -> ConfigError:
    return ConfigError(f"faults: {what} in {entry!r}; {allowed}")


def _parse_seconds(entry: str, name: str, value: str | None) -> float:
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        shown = f"{name}={value}" if value is not None else name
        raise _bad(repr(shown), entry, f"{name} needs seconds >= 0, e.g. {name}=5")
    return seconds


def _parse_entry(entry: str) -> Fault:
    op, colon, rest = entry.partition(":")
    op = op.strip()
    if op not in OPERATIONS:
        close = difflib.get_close_matches(op, OPERATIONS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"faults: unknown operation {op!r} in {entry!r}; {hint}"
            f"operations: {', '.join(OPERATIONS)}"
        )
    if not colon:
        raise _bad("no action", entry, f"write OP:ACTION[@STEPS], ACTION one of {_ACTIONS_HELP}")
    action_text, at, steps_text = rest.rpartition("@")
    if not at:
        action_text, steps_text = rest, ""
    steps: tuple[int, int] | None = None
    if at:
        m = _STEPS_RE.fullmatch(steps_text.strip())
        first = int(m.group(1)) if m else 0
        last = int(m.group(2)) if m and m.group(2) is not None else first
        if m is None or last < first:
            raise _bad(f"bad steps {steps_text!r}", entry, "STEPS is N or N-M with N <= M")
        steps = (first, last)
    name, eq, value = action_text.strip().partition("=")
    name = name.strip()
    arg = value.strip() if eq else None
    if name == Action.HANG.value:
        if arg is not None:
            raise _bad(f"{action_text.strip()!r}", entry, "hang takes no value")
        return Fault(op, Action.HANG, steps=steps)
    skew = next((a for a in SKEW_OPS if a.value == name), None)
    if skew is not None:
        if arg is not None:
            raise _bad(f"{action_text.strip()!r}", entry, f"{name} takes no value")
        if op != SKEW_OPS[skew]:
            raise _bad(f"{name} at {op!r}", entry, f"{name} fires at {SKEW_OPS[skew]} only")
        return Fault(op, skew, steps=steps)
    if name in (Action.SLEEP.value, Action.DELAY.value):
        return Fault(op, Action(name), seconds=_parse_seconds(entry, name, arg), steps=steps)
    if name in (Action.KILL_ENGINE.value, Action.STOP_ENGINE.value):
        if arg is None or not arg.isdigit():
            raise _bad(
                f"{action_text.strip()!r}", entry, f"{name} needs an engine index, e.g. {name}=0"
            )
        if op not in ENGINE_SIGNAL_OPS:
            raise _bad(
                f"{name} at {op!r}",
                entry,
                f"{name} fires where the trainer runs: at {' or '.join(ENGINE_SIGNAL_OPS)}",
            )
        return Fault(op, Action(name), steps=steps, engine=int(arg))
    if name == Action.ERROR.value:
        if not arg:
            raise _bad("'error' without a message", entry, "write error=MSG, e.g. error=boom")
        return Fault(op, Action.ERROR, message=arg, steps=steps)
    raise _bad(
        f"unknown action {action_text.strip()!r}", entry, f"ACTION is one of {_ACTIONS_HELP}"
    )


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """Parse ``"OP:ACTION[@STEPS],..."``; an empty or blank spec is no faults.

    Raises ``ConfigError`` with a one-line message naming the bad entry and what is allowed.
    """
    return tuple(_parse_entry(e.strip()) for e in spec.split(",") if e.strip())
