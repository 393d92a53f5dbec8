"""Prompts that fit the engines' context: checked at start-up, never met as a 400 mid-run.

Every prompt of the run (training and eval) is measured once, in tokens as the engine sees it
(:func:`trainer.generators.chat.prompt_lengths`: chat prompts rendered with the template).
``data.max_prompt_length`` bounds them: a longer prompt stops the run before anything starts
(``data.overlong_prompts=error``, the default, naming its row) or is left out (``drop``, as
verl's ``filter_overlong_prompts``; a warning gives the count). Once the engines are up, the
longest prompt kept plus ``generator.sampling.max_tokens`` must fit their context (the
shortest ``max_model_len`` of them): otherwise a ConfigError names the numbers and what to
change. Later turns of a multi-turn rollout grow past the first prompt; those the engine
still bounds itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from trainer.data import Example
from trainer.errors import ConfigError, DataError
from trainer.generators.chat import prompt_lengths

if TYPE_CHECKING:
    from trainer.config import DataConfig

__all__ = ["FittedPrompts", "check_context", "fit_prompts"]

log = logging.getLogger("trainer.run")


@attrs.frozen
class FittedPrompts:
    """The prompts of one source that fit ``data.max_prompt_length``."""

    examples: list[Example]
    #: The longest prompt kept, as ``(tokens, "SOURCE:LINE")``; None when none is kept.
    longest: tuple[int, str] | None
    #: Prompts left out (``data.overlong_prompts=drop``).
    dropped: int


def fit_prompts(
    tokenizer: Any, examples: Sequence[Example], source: str, data: DataConfig
) -> FittedPrompts:
    """``examples`` measured and bounded by ``data.max_prompt_length`` (see the module docstring).

    DataError for a prompt that is too long under ``overlong_prompts=error``, for a source
    whose every prompt is too long, and for a chat prompt that cannot be rendered. Blocking
    (it renders every prompt); run it in a thread.
    """
    limit = data.max_prompt_length
    kept: list[Example] = []
    longest: tuple[int, str] | None = None
    for ex, tokens in zip(examples, prompt_lengths(tokenizer, examples, source)):
        if limit is not None and tokens > limit:
            if data.overlong_prompts == "error":
                raise DataError(
                    f"{source}:{ex.index}: the prompt is {tokens} tokens, longer than "
                    f"data.max_prompt_length={limit}: shorten it, raise data.max_prompt_length, "
                    "or set data.overlong_prompts=drop to leave such prompts out"
                )
            continue
        kept.append(ex)
        if longest is None or tokens > longest[0]:
            longest = (tokens, f"{source}:{ex.index}")
    dropped = len(examples) - len(kept)
    if examples and not kept:
        raise DataError(
            f"{source}: all {len(examples)} prompts are longer than "
            f"data.max_prompt_length={limit} tokens: raise it"
        )
    if dropped:
        log.warning(
            "%s: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens",
            source,
            dropped,
            len(examples),
            limit,
        )
    return FittedPrompts(kept, longest, dropped)


def check_context(context: int | None, fitted: Sequence[FittedPrompts], max_tokens: int) -> None:
    """ConfigError unless the longest prompt of ``fitted`` plus ``max_tokens`` fits ``context``
    (the engines' ``max_model_len``; None, unknown: nothing to check)."""
    candidates = [f.longest for f in fitted if f.longest is not None]
    if context is None or not candidates:
        return
    tokens, where = max(candidates)
    if tokens + max_tokens <= context:
        return
    room = context - max_tokens
    drop = (
        f"set data.max_prompt_length={room} with data.overlong_prompts=drop to leave the longer "
        "prompts out, "
        if room >= 1
        else ""
    )
    raise ConfigError(
        f"config: the longest prompt ({where}, {tokens} tokens) plus "
        f"generator.sampling.max_tokens={max_tokens} is {tokens + max_tokens} tokens, more than "
        f"the engines' context of {context} tokens (their max_model_len): {drop}lower "
        "generator.sampling.max_tokens, or give the engines a longer context (vLLM: "
        "engine.extra_args=[--max-model-len,N])"
    )
