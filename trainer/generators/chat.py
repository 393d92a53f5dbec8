"""Prompts rendered with the model's chat template, and chat turns as tokens to append.

A data row's prompt is a string (tokenized as it is) or chat messages, rendered with the
tokenizer's chat template and ``add_generation_prompt=True``: :func:`render_prompt`. After
that, a multi-turn rollout stays token-in, token-out: the next model turn is sampled from
``prompt_ids + response_ids``, and an observation is appended as the tokens of its own chat
turn (:func:`chat_turn_ids`), never by rendering the whole conversation again (a re-render
can tokenize the model's earlier tokens differently from how it sampled them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trainer.data import ChatMessage, Example
from trainer.errors import DataError

__all__ = ["chat_turn_ids", "check_prompts", "prompt_lengths", "render_prompt"]

#: The conversation a chat turn is rendered after (:func:`chat_turn_ids`); its content never
#: reaches the result.
_BASE_CONVERSATION: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "1"},
    {"role": "assistant", "content": "2"},
)

NO_TEMPLATE = (
    "the tokenizer has no chat template, so chat-message prompts cannot be rendered; give the "
    "prompt as a string, or use a model whose tokenizer_config.json (or chat_template.jinja) "
    "has a chat_template"
)


def _apply(tokenizer: Any, messages: Sequence[ChatMessage], *, generation: bool) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(NO_TEMPLATE)
    ids = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        add_generation_prompt=generation,
        tokenize=True,
        return_dict=False,
    )
    if isinstance(ids, Mapping):  # transformers versions that ignore return_dict=False
        ids = ids["input_ids"]
    return list(ids)


def render_prompt(tokenizer: Any, prompt: str | Sequence[ChatMessage]) -> tuple[str, list[int]]:
    """The prompt as text and as the token ids the engine sees.

    A string is tokenized without special tokens (as the default run always has); chat
    messages are rendered with the chat template and the generation prompt, the text being
    the rendered template. DataError when the tokenizer has no chat template.
    """
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt, add_special_tokens=False)
    ids = _apply(tokenizer, prompt, generation=True)
    text = tokenizer.apply_chat_template(
        [dict(m) for m in prompt], add_generation_prompt=True, tokenize=False
    )
    return str(text), ids


def chat_turn_ids(tokenizer: Any, message: ChatMessage) -> list[int]:
    """The tokens of one chat turn (``message``) plus the next generation prompt.

    What to append to ``prompt_ids + response_ids`` after a model turn that ended with the
    end-of-turn (EOS) token: rendered after a fixed two-message conversation and cut after
    that conversation's last EOS, so the result holds what the template puts between the
    assistant's EOS and the next reply (for ChatML: ``\\n<|im_start|>user\\n...<|im_end|>\\n
    <|im_start|>assistant\\n``), whatever the history before it. The history itself is never
    rendered again. DataError when the tokenizer has no chat template; ValueError when the
    template renders the fixed conversation differently once a turn follows it (a template
    that rewrites earlier turns cannot be extended token by token).
    """
    base = _apply(tokenizer, _BASE_CONVERSATION, generation=False)
    full = _apply(tokenizer, [*_BASE_CONVERSATION, message], generation=True)
    eos = tokenizer.eos_token_id
    cut = len(base) - base[::-1].index(eos) if eos in base else len(base)
    if full[:cut] != base[:cut]:
        raise ValueError(
            "the chat template renders earlier turns differently once a turn follows them; "
            "a chat turn cannot be appended as tokens with this template"
        )
    return full[cut:]


def check_prompts(tokenizer: Any, examples: Sequence[Example], source: str) -> None:
    """Render every chat prompt once, at start-up: DataError naming ``source:LINE`` if one fails.

    Blocking (it renders templates); run it in a thread. :func:`prompt_lengths` does the same
    and measures every prompt.
    """
    prompt_lengths(tokenizer, [ex for ex in examples if ex.is_chat], source)


def prompt_lengths(tokenizer: Any, examples: Sequence[Example], source: str) -> list[int]:
    """Each prompt's length in tokens as the engine sees it (:func:`render_prompt`'s ids).

    Chat prompts are rendered with the template: DataError naming ``source:LINE`` when one
    cannot be. Blocking; run it in a thread.
    """
    lengths = []
    for ex in examples:
        if isinstance(ex.prompt, str):
            lengths.append(len(tokenizer.encode(ex.prompt, add_special_tokens=False)))
            continue
        try:
            lengths.append(len(_apply(tokenizer, ex.prompt, generation=True)))
        except DataError as exc:
            raise DataError(
                f"{source}:{ex.index}: 'prompt' is a list of chat messages, but {exc}"
            ) from None
        except Exception as exc:  # the template's own errors (jinja's, or raise_exception)
            raise DataError(
                f"{source}:{ex.index}: the chat template cannot render 'prompt': "
                f"{type(exc).__name__}: {exc}"
            ) from None
    return lengths
