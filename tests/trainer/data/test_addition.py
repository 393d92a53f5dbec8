"""The chat task ``addition`` and the run's datasets: held-out eval prompts, the final-number
reward, and the data keys that must fit together."""

from __future__ import annotations

import pytest

from engines.models import build_tiny_model, load_tokenizer
from trainer.config import DataConfig
from trainer.data._addition import PROMPT, addition_examples, addition_reward, default_num_eval
from trainer.data._datasets import DIGIT_TASK_EVAL, load_datasets
from trainer.errors import ConfigError
from trainer.generators.chat import check_prompts, render_prompt


def _pairs(examples):
    return {(ex.extra["a"], ex.extra["b"]) for ex in examples}


def test_one_digit_eval_prompts_are_held_out_of_training_and_every_answer_is_its_sum():
    train, held = addition_examples(digits=1, num_examples=512, num_eval=None, seed=0)
    assert len(train) == 512 and len(held) == default_num_eval(1) == 20
    assert len(_pairs(held)) == 20
    assert _pairs(train) & _pairs(held) == set()
    assert len(_pairs(train)) == 80  # the other pairs, cycled
    for ex in train + held:
        a, b = ex.extra["a"], ex.extra["b"]
        assert 0 <= a <= 9 and 0 <= b <= 9
        assert ex.answer == str(a + b)
        assert ex.prompt == ({"role": "user", "content": PROMPT.format(a=a, b=b)},)
    assert [ex.index for ex in held] == list(range(20))


def test_the_split_is_fixed_by_the_seed():
    first = addition_examples(2, 64, 30, seed=5)
    assert addition_examples(2, 64, 30, seed=5) == first
    other = addition_examples(2, 64, 30, seed=6)
    assert _pairs(other[1]) != _pairs(first[1])
    train, held = first
    assert len(held) == 30 and _pairs(train) & _pairs(held) == set()
    assert max(ex.extra["a"] for ex in train + held) > 9  # two-digit operands occur


def test_many_digits_draw_pairs_without_listing_them():
    train, held = addition_examples(9, 100, None, seed=0)  # 10**18 pairs: listing them never ends
    assert len(held) == 200 and len(train) == 100
    assert _pairs(train) & _pairs(held) == set()


@pytest.mark.parametrize("num_eval", [0, 51])
def test_a_held_out_split_that_leaves_too_few_pairs_is_refused(num_eval):
    with pytest.raises(ConfigError) as err:
        addition_examples(1, 10, num_eval, seed=0)
    assert str(err.value) == (
        f"config: data.num_eval_examples={num_eval} is out of range for data.task=addition with "
        "data.digits=1: its 100 pairs allow 1 to 50 held-out prompts (the rest train); lower "
        "it, or raise data.digits"
    )


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("7", 1.0),
        (" 7\n", 1.0),
        ("The answer is 7.", 1.0),
        ("3 + 4 = 7", 1.0),
        ("07", 1.0),
        ("7 or maybe 8", 0.0),
        ("70", 0.0),
        ("-7", 0.0),
        ("seven", 0.0),
        ("", 0.0),
    ],
)
def test_the_reward_is_whether_the_last_integer_is_the_sum(response, reward):
    assert addition_reward(response, "7") == reward


def test_zero_is_a_sum_like_any_other():
    assert addition_reward("0", "0") == 1.0
    assert addition_reward("10", "0") == 0.0


def test_the_run_trains_on_addition_with_held_out_eval_and_the_sum_reward():
    data = load_datasets(DataConfig(task="addition", num_examples=40), seed=3)
    assert len(data.train) == 40 and len(data.eval) == 20
    assert _pairs(data.train) & _pairs(data.eval) == set()
    ex = data.eval[0]
    assert data.reward_fn(f"It is {ex.answer}", ex.answer, ex.extra) == 1.0
    assert data.reward_fn("no idea", ex.answer, ex.extra) == 0.0


def test_the_digit_tasks_keep_their_eval_prompts_and_take_a_count():
    data = load_datasets(DataConfig(task="max_digit", num_examples=8), seed=0)
    assert len(data.eval) == DIGIT_TASK_EVAL == 100
    assert data.eval[0].prompt.startswith("max ")
    assert len(load_datasets(DataConfig(num_eval_examples=7), seed=0).eval) == 7


def test_digits_without_the_addition_task_is_refused():
    with pytest.raises(ConfigError) as err:
        load_datasets(DataConfig(task="modular_sum", digits=2), seed=0)
    assert str(err.value) == (
        "config: data.digits=2 applies to data.task=addition only (the task is "
        "'modular_sum'): unset it, or set data.task=addition"
    )


def test_an_eval_file_replaces_the_held_out_prompts(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"prompt": "sum 1 2 =", "answer": "3"}\n')
    data = load_datasets(DataConfig(task="addition", eval=str(path)), seed=0)
    assert [ex.answer for ex in data.eval] == ["3"]


def test_a_data_file_without_an_eval_file_gets_its_tasks_eval_prompts(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "sum 1 2 =", "answer": "3"}\n')
    data = load_datasets(DataConfig(train=str(path), task="addition"), seed=0)
    assert [ex.answer for ex in data.train] == ["3"]
    assert len(data.eval) == 20 and all(ex.extra for ex in data.eval)
    assert data.eval == load_datasets(DataConfig(task="addition"), seed=0).eval
    digits = load_datasets(DataConfig(train=str(path), num_eval_examples=5), seed=0)
    assert len(digits.eval) == 5 and digits.eval[0].prompt.startswith("max ")


def test_addition_prompts_render_with_a_chat_template(tmp_path):
    tokenizer = load_tokenizer(build_tiny_model(tmp_path))
    train, held = addition_examples(1, 4, 2, seed=0)
    check_prompts(tokenizer, train + held, "data.task=addition")
    text, ids = render_prompt(tokenizer, held[0].prompt)
    assert "+" in text and ids
