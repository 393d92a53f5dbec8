"""Output text as vLLM reports it: cut at stop strings, and streamed in deltas.

The engine samples tokens; the server reports text. ``stop`` strings are matched against the
decoded output (special tokens skipped): the text ends where the first one starts (or after
it with ``include_stop_str_in_output``), while the token ids keep every sampled token, the
one that completed the stop string included (vLLM's behaviour). A stream holds back the
last ``len(longest stop) - 1`` characters until the completion ends, so it never sends text
that a stop string later removes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

__all__ = ["TextStream", "first_stop", "visible_text"]


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the earliest stop string starts in ``text``, and which one; None without one."""
    hits = [(i, stop) for stop in stops if stop and (i := text.find(stop)) >= 0]
    return min(hits) if hits else None


def visible_text(text: str, stops: Sequence[str], include_stop: bool = False) -> str:
    """``text`` cut at its first stop string (kept with ``include_stop``)."""
    hit = first_stop(text, stops)
    if hit is None:
        return text
    start, stop = hit
    return text[: start + len(stop)] if include_stop else text[:start]


@attrs.define
class TextStream:
    """Turns a growing list of token ids into text deltas whose concatenation is the final text."""

    #: Token ids to text (special tokens skipped).
    decode: Callable[[list[int]], str]
    stops: Sequence[str] = ()
    include_stop: bool = False
    token_ids: list[int] = attrs.field(factory=list)
    #: Text already sent.
    sent: str = ""

    def push(self, token_ids: Sequence[int], finished: bool) -> str:
        """Add tokens; the new text to send (held back near a possible stop string unless
        ``finished``)."""
        self.token_ids += token_ids
        text = visible_text(self.decode(self.token_ids), self.stops, self.include_stop)
        if not finished and self.stops:
            text = text[: max(len(self.sent), len(text) - (max(map(len, self.stops)) - 1))]
        if not text.startswith(self.sent):  # a decoder that rewrote sent text: wait it out
            return ""
        delta = text[len(self.sent) :]
        self.sent = text
        return delta
