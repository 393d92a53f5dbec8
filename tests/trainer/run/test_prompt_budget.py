"""Prompts longer than the budget: refused or dropped at start-up, never a 400 mid-run."""

from __future__ import annotations

import json
import logging

import pytest

import trainer.run
from engines.models import build_tiny_model, load_tokenizer
from tests.trainer.helpers import Recording
from trainer.config import load_config
from trainer.data._examples import Example, load_jsonl
from trainer.errors import ConfigError, DataError
from trainer.run._prompt_budget import FittedPrompts, check_context, fit_prompts

#: 300 tokens of the tiny vocabulary: past the tiny model's 256-token context.
LONG = " ".join(["max"] * 300)
ROWS = [
    {"prompt": "max 7 5 =", "answer": "7"},
    {"prompt": LONG, "answer": "9"},
    {"prompt": [{"role": "user", "content": "max 3 8 ="}], "answer": "8"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(build_tiny_model())


def _data(**keys):
    overrides = [f"data.{k}={v}" for k, v in keys.items()]
    return load_config(None, overrides).data


def _write(tmp_path, rows=ROWS):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_prompt_is_measured_as_the_engine_sees_it(tokenizer, tmp_path):
    examples = load_jsonl(_write(tmp_path))
    fitted = fit_prompts(tokenizer, examples, "train.jsonl", _data())
    assert fitted.examples == examples and fitted.dropped == 0
    assert fitted.longest == (300, "train.jsonl:2")
    # the chat row counts its rendered template: "user : max 3 8 = <eos> assistant :"
    chat = fit_prompts(tokenizer, examples[2:], "train.jsonl", _data())
    assert chat.longest == (9, "train.jsonl:3")


def test_a_prompt_over_max_prompt_length_is_refused_naming_its_row(tokenizer, tmp_path):
    examples = load_jsonl(_write(tmp_path))
    with pytest.raises(DataError) as info:
        fit_prompts(tokenizer, examples, "train.jsonl", _data(max_prompt_length=20))
    assert str(info.value).startswith(
        "train.jsonl:2: the prompt is 300 tokens, longer than data.max_prompt_length=20:"
    )
    assert "data.overlong_prompts=drop" in str(info.value)


def test_drop_leaves_the_long_prompts_out_and_says_how_many(tokenizer, tmp_path, caplog):
    examples = load_jsonl(_write(tmp_path))
    data = _data(max_prompt_length=20, overlong_prompts="drop")
    with caplog.at_level(logging.WARNING, logger="trainer.run"):
        fitted = fit_prompts(tokenizer, examples, "train.jsonl", data)
    assert [ex.index for ex in fitted.examples] == [1, 3]
    assert (fitted.dropped, fitted.longest) == (1, (9, "train.jsonl:3"))
    assert "train.jsonl: dropped 1 of 3 prompts longer than data.max_prompt_length=20" in (
        caplog.text
    )
    with pytest.raises(
        DataError, match=r"all 1 prompts are longer than data\.max_prompt_length=20"
    ):
        fit_prompts(tokenizer, [examples[1]], "train.jsonl", data)


def test_drop_without_a_length_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"data\.max_prompt_length, which is unset"):
        load_config(None, ["data.overlong_prompts=drop"])


def test_the_longest_prompt_and_max_tokens_must_fit_the_engines_context():
    fitted = [
        FittedPrompts([Example("p", "a")], (100, "train.jsonl:4"), 0),
        FittedPrompts([Example("q", "b")], (120, "eval.jsonl:7"), 0),
        FittedPrompts([], None, 0),
    ]
    check_context(136, fitted, 16)  # exactly full
    check_context(None, fitted, 10_000)  # the engines do not say: theirs to refuse
    with pytest.raises(ConfigError) as info:
        check_context(128, fitted, 16)
    message = str(info.value)
    assert message.startswith(
        "config: the longest prompt (eval.jsonl:7, 120 tokens) plus "
        "generator.sampling.max_tokens=16 is 136 tokens, more than the engines' context of "
        "128 tokens"
    )
    assert "data.max_prompt_length=112 with data.overlong_prompts=drop" in message
    assert "engine.extra_args=[--max-model-len,N]" in message


async def test_a_run_with_a_prompt_past_the_servers_context_fails_at_start_up(tmp_path):
    """Real reference servers: their ``/v1/models`` says 256 tokens; nothing is trained."""
    data = _write(tmp_path)
    cfg = load_config(
        None,
        [
            f"data.train={data}",
            "trainer.train_batch_size=3",
            "generator.sampling.max_tokens=8",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.progress=false",
        ],
    )
    with pytest.raises(ConfigError, match=rf"\({data}:2, 300 tokens\) plus .* context of 256"):
        await trainer.run.train(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


async def test_a_run_that_drops_the_long_prompt_trains_on_the_others(tmp_path):
    Recording.seen.clear()
    data = _write(tmp_path)
    cfg = load_config(
        None,
        [
            "generator.cls=tests.trainer.helpers:Recording",
            f"data.train={data}",
            "data.max_prompt_length=64",
            "data.overlong_prompts=drop",
            "trainer.max_steps=1",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=2",
            "engine.backend=inprocess",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.progress=false",
        ],
    )
    await trainer.run.train(cfg)
    assert sorted(item.messages is None for item in Recording.seen) == [False, False, True, True]
    assert LONG not in [item.prompt for item in Recording.seen]
