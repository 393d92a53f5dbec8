"""From the model calls of one trajectory to training samples, by the engine's token ids.

Each call an agent makes is recorded as a :class:`CapturedTurn`: the prompt ids the engine
rendered and the completion ids it sampled, with their logprobs, exactly as the engine
returned them (``return_token_ids``), never re-tokenized from text. :func:`assemble` chains
the turns into samples by the **extension property**: a turn continues the current sample
when its prompt starts with the sample's prompt + response so far; the new prompt tokens
past that point (tool results, user messages, template markup: what the agent inserted)
join the response with loss mask 0 and logprob 0.0, the completion with loss mask 1 and its
logprobs. A turn that does not extend the sample (a chat template that rewrites earlier
turns, such as one that drops past reasoning; a second choice of an ``n > 1`` call; an
agent that restarts the conversation) starts a new sample: the trajectory is split, never
mis-masked, and the split is counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["CapturedTurn", "Sample", "assemble"]


@attrs.frozen
class CapturedTurn:
    """One model call's tokens, as the engine returned them."""

    #: The prompt the engine sampled from (the rendered chat, for chat calls).
    prompt_ids: list[int]
    #: The sampled tokens (the stop token included when the engine returns it).
    completion_ids: list[int]
    #: One logprob per sampled token.
    logprobs: list[float]
    #: ``stop``, ``length`` or ``abort``.
    finish_reason: str

    def __attrs_post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"{len(self.logprobs)} logprobs for {len(self.completion_ids)} completion tokens"
            )


@attrs.define
class Sample:
    """Turns chained by the extension property: one training sequence."""

    prompt_ids: list[int]
    response_ids: list[int] = attrs.field(factory=list)
    loss_mask: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    finish_reason: str = "stop"
    num_turns: int = 0

    def extended_by(self, turn: CapturedTurn) -> bool:
        """Whether ``turn``'s prompt starts with this sample's prompt + response."""
        so_far = self.prompt_ids + self.response_ids
        return turn.prompt_ids[: len(so_far)] == so_far

    def add(self, turn: CapturedTurn) -> None:
        """Append ``turn`` (which must extend this sample): inserted tokens, then the completion."""
        inserted = turn.prompt_ids[len(self.prompt_ids) + len(self.response_ids) :]
        self.response_ids += inserted + turn.completion_ids
        self.loss_mask += [0] * len(inserted) + [1] * len(turn.completion_ids)
        self.logprobs += [0.0] * len(inserted) + list(turn.logprobs)
        self.finish_reason = turn.finish_reason
        self.num_turns += 1


def assemble(turns: Sequence[CapturedTurn]) -> tuple[list[Sample], int]:
    """The samples of a trajectory's turns (in call order), and how many splits it took.

    Each sample is extended by every following turn that extends it; a turn that extends
    none starts a new sample (a split). No turns: no samples.
    """
    samples: list[Sample] = []
    splits = 0
    for turn in turns:
        if samples and samples[-1].extended_by(turn):
            samples[-1].add(turn)
            continue
        if samples:
            splits += 1
        sample = Sample(prompt_ids=list(turn.prompt_ids))
        sample.add(turn)
        samples.append(sample)
    return samples, splits
