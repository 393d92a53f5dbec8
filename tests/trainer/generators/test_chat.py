"""Chat prompts render with the model's chat template; a chat turn appends as tokens alone."""

from __future__ import annotations

import pytest

from engines.models import build_tiny_model, load_tokenizer
from trainer.data._examples import Example, load_jsonl
from trainer.errors import DataError
from trainer.generators.chat import chat_turn_ids, check_prompts, render_prompt

USER = [{"role": "user", "content": "max 7 5 ="}]
OBSERVATION = {"role": "user", "content": "no , what is the answer ?"}

#: ChatML's shape with the tiny vocabulary: ``<eos>`` ends a turn (``<|im_end|>``) and a
#: ``;`` follows it (ChatML's ``\n``), which the model never samples: it stops at ``<eos>``.
CHATML_LIKE = (
    "{%- for message in messages -%}"
    "[ {{ message['role'] }} ] {{ message['content'] }} {{ eos_token }} ; "
    "{% endfor -%}"
    "{%- if add_generation_prompt -%}[ assistant ]{%- endif -%}"
)


@pytest.fixture
def tokenizer():
    return load_tokenizer(build_tiny_model())


def test_a_text_prompt_is_tokenized_as_it_always_was(tokenizer):
    text, ids = render_prompt(tokenizer, "max 7 5 =")
    assert (text, ids) == ("max 7 5 =", tokenizer.encode("max 7 5 =", add_special_tokens=False))


def test_chat_messages_render_with_the_template_and_the_generation_prompt(tokenizer):
    text, ids = render_prompt(tokenizer, USER)
    assert text == "user : max 7 5 = <eos> assistant :"
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ids[-2:] == tokenizer.encode("assistant :", add_special_tokens=False)


@pytest.mark.parametrize("template", ["tiny", "chatml_like"])
def test_a_chat_turn_appended_as_tokens_equals_the_whole_conversation_rendered(tokenizer, template):
    if template == "chatml_like":
        tokenizer.chat_template = CHATML_LIKE
    _, prompt_ids = render_prompt(tokenizer, USER)
    reply = [*tokenizer.encode("7", add_special_tokens=False), tokenizer.eos_token_id]
    turn = chat_turn_ids(tokenizer, OBSERVATION)
    conversation = [*USER, {"role": "assistant", "content": "7"}, OBSERVATION]
    _, whole = render_prompt(tokenizer, conversation)
    assert prompt_ids + reply + turn == whole
    if template == "chatml_like":  # what follows the model's end-of-turn token comes first
        assert tokenizer.decode(turn[:1]) == ";"


def test_chat_prompts_without_a_chat_template_say_what_to_do(tokenizer, tmp_path):
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="the tokenizer has no chat template"):
        render_prompt(tokenizer, USER)
    with pytest.raises(DataError, match="no chat template"):
        chat_turn_ids(tokenizer, OBSERVATION)
    f = tmp_path / "train.jsonl"
    f.write_text(
        '{"prompt": "max 1 2 =", "answer": "2"}\n{"prompt": [{"role": "user", "content": "max 1 2 ="}], "answer": "2"}\n'
    )
    with pytest.raises(DataError) as info:
        check_prompts(tokenizer, load_jsonl(f), str(f))
    assert str(info.value).startswith(
        f"{f}:2: 'prompt' is a list of chat messages, but the tokenizer has no chat template"
    )
    assert "give the prompt as a string" in str(info.value)


def test_a_template_error_at_start_up_names_the_row(tokenizer):
    tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    examples = [
        Example("max 1 2 =", "2", 1),
        Example(({"role": "user", "content": "max 1 2 ="},), "2", 2),
        Example(({"role": "assistant", "content": "2"},), "2", 3),
    ]
    with pytest.raises(
        DataError,
        match=r"^data\.jsonl:3: the chat template cannot render 'prompt': .*first must be user",
    ):
        check_prompts(tokenizer, examples, "data.jsonl")
    check_prompts(tokenizer, examples[:2], "data.jsonl")
