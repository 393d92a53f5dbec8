"""Data files, rewards and the resumable prompt order."""

from __future__ import annotations

import pytest

from trainer.data._examples import (
    Example,
    PromptLoader,
    digit_task_reward,
    load_jsonl,
    modular_sum_examples,
    resolve_reward_fn,
    reward_function,
    task_examples,
)
from trainer.errors import ConfigError, DataError


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (
            "{not json",
            "not valid JSON (Expecting property name enclosed in double quotes at column 2)",
        ),
        ("[1, 2]", "expected an object with 'prompt' and 'answer', got list"),
        ('{"answer": "1"}', "missing required field 'prompt'"),
        ('{"prompt": "sum 1 2 ="}', "missing required field 'answer'"),
        (
            '{"prompt": "", "answer": "1"}',
            "'prompt' must be a non-empty string or a list of chat messages, got ''",
        ),
        (
            '{"prompt": 5, "answer": "1"}',
            "'prompt' must be a non-empty string or a list of chat messages, got 5",
        ),
        (
            '{"prompt": [], "answer": "1"}',
            "'prompt' is an empty list; give at least one chat message",
        ),
        (
            '{"prompt": ["hi"], "answer": "1"}',
            "'prompt' message 0 must be an object with 'role' and 'content', got str",
        ),
        (
            '{"prompt": [{"role": "user", "content": "a"}, {"content": "b"}], "answer": "1"}',
            "'prompt' message 1 needs a non-empty string 'role', got None",
        ),
        (
            '{"prompt": [{"role": "user", "content": 5}], "answer": "1"}',
            "'prompt' message 0 needs a string 'content', got int",
        ),
        ('{"prompt": "p", "answer": [1]}', "'answer' must be a string or number, got list"),
    ],
)
def test_bad_row_names_file_line_and_problem(tmp_path, line, problem):
    f = tmp_path / "train.jsonl"
    f.write_text('{"prompt": "sum 1 2 =", "answer": "3"}\n\n' + line + "\n")
    with pytest.raises(DataError) as info:
        load_jsonl(f)
    assert str(info.value) == f"{f}:3: {problem}"


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="has no rows"):
        load_jsonl(empty)
    with pytest.raises(DataError, match="cannot read the data file"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_numbers_are_accepted_as_answers(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "sum 1 2 =", "answer": 3}\n')
    (ex,) = load_jsonl(f)
    assert (ex.answer, ex.index) == ("3", 1)


def test_fields_beyond_prompt_and_answer_are_kept_read_only_as_extra(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(
        '{"prompt": "sum 1 2 =", "answer": "3", "level": 2, "tags": ["a"]}\n'
        '{"prompt": "sum 2 2 =", "answer": "4"}\n'
    )
    first, second = load_jsonl(f)
    assert dict(first.extra) == {"level": 2, "tags": ["a"]} and dict(second.extra) == {}
    with pytest.raises(TypeError):
        first.extra["level"] = 3  # type: ignore[index]
    assert hash(first) != hash(second)  # still a hashable value


def test_a_chat_prompt_is_kept_as_its_messages(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(
        '{"prompt": [{"role": "system", "content": "be brief"}, '
        '{"role": "user", "content": "sum 1 2 =", "name": "u"}], "answer": "3"}\n'
    )
    (ex,) = load_jsonl(f)
    assert ex.is_chat and not Example("p", "a").is_chat
    assert [dict(m) for m in ex.prompt] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "sum 1 2 =", "name": "u"},
    ]
    assert dict(ex.extra) == {}


def needs_extra(response: str, answer: str, *, extra) -> float:
    return float(extra["level"])


def one_argument(response: str) -> float:
    return 0.0


def test_reward_fn_resolution():
    assert resolve_reward_fn(None, digit_task_reward).fn is digit_task_reward
    assert resolve_reward_fn("trainer.data:exact_match_reward", digit_task_reward)("7 ", "7") == 1.0
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        resolve_reward_fn("no_such_module:f", digit_task_reward)
    with pytest.raises(ConfigError, match="has no callable 'nope'"):
        resolve_reward_fn("trainer.data:nope", digit_task_reward)


@pytest.mark.parametrize(
    "fn",
    [
        needs_extra,
        lambda response, answer, extra: float(extra["level"]),
        lambda response, answer, extra=None: float(extra["level"]),
        lambda response, answer, **kwargs: float(kwargs["extra"]["level"]),
    ],
)
def test_a_reward_function_that_takes_extra_gets_the_examples_fields(fn):
    reward = reward_function(fn)
    assert reward.takes_extra
    assert reward("r", "a", extra={"level": 2}) == 2.0


def test_a_two_argument_reward_function_never_sees_extra():
    reward = resolve_reward_fn("trainer.data:exact_match_reward", digit_task_reward)
    assert not reward.takes_extra
    assert reward("7 ", "7", extra={"level": 2}) == reward("7", "7") == 1.0


def test_a_reward_function_with_another_signature_is_a_config_error_at_load():
    spec = "tests.trainer.data.test_data:one_argument"
    with pytest.raises(ConfigError) as info:
        resolve_reward_fn(spec, digit_task_reward)
    assert str(info.value) == (
        f"config: data.reward_fn={spec!r}: one_argument(response) has the wrong signature; "
        "a reward function is (response: str, answer: str) -> float or "
        "(response: str, answer: str, *, extra: Mapping[str, Any]) -> float"
    )
    with pytest.raises(ConfigError, match=r"<lambda>\(r, a, b, c\) has the wrong signature"):
        reward_function(lambda r, a, b, c: 0.0)


def test_builtin_task_reward_pays_partial_credit_in_order():
    assert digit_task_reward("7", "7") == 1.0
    assert digit_task_reward("7 3", "7") == 0.5
    assert digit_task_reward("4", "7") == 0.1
    assert digit_task_reward("sum", "7") == 0.0
    assert digit_task_reward("", "7") == 0.0


def test_builtin_task_answers_are_the_last_digit_of_the_sum():
    for ex in modular_sum_examples(100, seed=0):
        _, a, b, _ = ex.prompt.split()
        assert ex.answer == str((int(a) + int(b)) % 10)
    assert len({ex.prompt for ex in modular_sum_examples(100, seed=0)}) == 100


def test_loader_resumes_with_the_same_order_across_epochs():
    examples = modular_sum_examples(10, seed=0)
    full = PromptLoader(examples, batch_size=3, seed=5)
    seen = [[e.index for e in full.next_batch()] for _ in range(7)]  # crosses two epoch ends
    first = PromptLoader(examples, batch_size=3, seed=5)
    for _ in range(4):
        first.next_batch()
    resumed = PromptLoader(examples, batch_size=3, seed=5)
    resumed.load_state_dict(first.state_dict())
    assert [[e.index for e in resumed.next_batch()] for _ in range(3)] == seen[4:]
    assert seen[0] != seen[3]  # each epoch has its own permutation


def test_max_digit_task_answers_the_larger_digit():
    examples = task_examples("max_digit", 100, seed=0)
    for ex in examples:
        _, a, b, _ = ex.prompt.split()
        assert ex.answer == str(max(int(a), int(b)))
    with pytest.raises(ConfigError, match="choose one of 'max_digit', 'modular_sum'"):
        task_examples("nope", 10, 0)


def test_batch_larger_than_data_is_a_config_error():
    with pytest.raises(ConfigError, match="only 10 prompts"):
        PromptLoader(modular_sum_examples(10, 0), batch_size=11, seed=0)


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        ({"seed": 6}, r"trainer\.seed differs from the checkpoint's \(6 here, 5 in"),
        ({"batch_size": 2}, r"trainer\.train_batch_size differs .*\(2 here, 3 in"),
        ({"examples": 12}, r"number of training prompts differs .*\(12 here, 10 in"),
    ],
)
def test_resume_with_another_data_order_is_a_config_error(changed, named):
    first = PromptLoader(modular_sum_examples(10, 0), batch_size=3, seed=5)
    first.next_batch()
    kwargs = {"batch_size": 3, "seed": 5, **changed}
    examples = modular_sum_examples(kwargs.pop("examples", 10), 0)
    resumed = PromptLoader(examples, **kwargs)
    with pytest.raises(ConfigError, match=named):
        resumed.load_state_dict(first.state_dict())
    assert (resumed.epoch, resumed.index) == (0, 0)  # nothing half-loaded


def test_loader_state_saved_before_the_order_fields_still_loads():
    loader = PromptLoader(modular_sum_examples(10, 0), batch_size=3, seed=5)
    loader.load_state_dict({"epoch": 1, "index": 2})
    assert (loader.epoch, loader.index) == (1, 2)
