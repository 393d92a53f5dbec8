"""data.task=reasoning_gym: reasoning-gym's datasets as prompts, its scorer as the reward."""

from __future__ import annotations

import logging

import pytest

from trainer.config import load_config
from trainer.data import load_datasets
from trainer.data._reasoning_gym import reasoning_gym_reward
from trainer.errors import ConfigError

pytest.importorskip("reasoning_gym")

TASK = ("data.task=reasoning_gym",)


def _load(*overrides: str):
    cfg = load_config(None, [*TASK, *overrides])
    return load_datasets(cfg.data, cfg.trainer.seed)


def test_items_are_chat_prompts_with_the_system_prompt_and_eval_items_are_held_out():
    data = _load("data.reasoning_gym.name=chain_sum", "data.num_examples=20")
    assert len(data.train) == 20 and data.eval
    system, user = data.train[0].prompt
    assert system["role"] == "system" and "<answer>" in system["content"]
    assert user["role"] == "user" and user["content"] == data.train[0].extra["question"]
    asked = {ex.extra["question"] for ex in data.train}
    assert not asked & {ex.extra["question"] for ex in data.eval}
    # another seed draws other training items
    other = load_datasets(
        load_config(None, [*TASK, "data.reasoning_gym.name=chain_sum", "trainer.seed=7"]).data, 7
    )
    assert [e.extra["question"] for e in other.train[:5]] != [
        e.extra["question"] for e in data.train[:5]
    ]


def test_the_reward_is_reasoning_gyms_score_of_the_tagged_answer_partial_credit_kept():
    data = _load("data.reasoning_gym.name=count_bits")
    ex = data.train[0]
    reward = data.reward_fn
    assert reward(f"so <answer>{ex.answer}</answer>", ex.answer, ex.extra) == 1.0
    assert reward(ex.answer, ex.answer, ex.extra) == 0.0  # no tags: nothing extracted
    partial = reward(f"<answer>{ex.answer} {ex.answer}</answer>", ex.answer, ex.extra)
    assert 0.0 < partial < 1.0  # reasoning-gym's own len(answer)/len(found)
    assert reward("<answer>zzzz</answer>", ex.answer, ex.extra) == 0.0


def test_answer_tag_none_scores_the_whole_response_and_no_system_prompt():
    data = _load(
        "data.reasoning_gym.name=count_bits",
        "data.reasoning_gym.config.max_n=63",
        "data.reasoning_gym.answer_tag=null",
        "data.reasoning_gym.system_prompt=null",
        "data.num_examples=8",
    )
    ex = data.train[0]
    assert [m["role"] for m in ex.prompt] == ["user"]
    assert data.reward_fn(f" {ex.answer} ", ex.answer, ex.extra) == 1.0


def test_a_weighted_mix_draws_from_each_dataset_and_scores_each_with_its_own():
    data = _load(
        "data.reasoning_gym.mix=[{name: chain_sum, weight: 1, config: {max_terms: 2}}, "
        "{name: spell_backward, weight: 3}]",
        "data.num_examples=64",
    )
    names = [ex.extra["reasoning_gym"]["dataset"] for ex in data.train]
    assert 5 < names.count("chain_sum") < names.count("spell_backward")
    for ex in data.train[:10]:
        assert data.reward_fn(f"<answer>{ex.answer}</answer>", ex.answer, ex.extra) == 1.0


def test_without_partial_credit_only_a_reply_paid_in_full_scores():
    args = ["data.reasoning_gym.name=chain_sum", "data.reasoning_gym.answer_tag=null"]
    args += ["data.reasoning_gym.config.max_terms=2", "data.reasoning_gym.config.max_digits=1"]
    partial, exact = _load(*args), _load(*args, "data.reasoning_gym.partial_credit=false")
    ex = exact.train[0]
    # a reply listing candidates contains the answer: reasoning-gym pays it partial credit
    hedge = " ".join(str(n) for n in range(-9, 19))
    assert 0.0 < partial.reward_fn(hedge, ex.answer, partial.train[0].extra) < 0.1
    assert exact.reward_fn(hedge, ex.answer, ex.extra) == 0.0
    assert exact.reward_fn(f"The answer is {ex.answer}.", ex.answer, ex.extra) == 0.0
    assert exact.reward_fn(f" {ex.answer}\n", ex.answer, ex.extra) == 1.0


def test_few_shot_turns_are_solved_items_the_same_for_every_prompt_and_never_eval_questions():
    args = ["data.reasoning_gym.name=chain_sum", "data.num_examples=30"]
    plain, shots = _load(*args), _load(*args, "data.reasoning_gym.few_shot=2")
    # the training and eval items are the ones drawn without the turns, eval less their questions
    assert [e.extra["question"] for e in shots.train] == [e.extra["question"] for e in plain.train]
    prefixes = [[dict(m) for m in ex.prompt[1:5]] for ex in [*shots.train, *shots.eval]]
    prefix = prefixes[0]
    assert all(p == prefix for p in prefixes)
    assert [m["role"] for m in prefix] == ["user", "assistant", "user", "assistant"]
    for question, reply in (prefix[0:2], prefix[2:4]):
        # a solved item: "...problem: 4 - 1 =", its reply the answer in the tags the reward reads
        expression = question["content"].rsplit(":", 1)[1].removesuffix("=")
        assert reply["content"] == f"<answer>{eval(expression)}</answer>"
        assert question["content"] not in {e.extra["question"] for e in shots.eval}
    assert shots.train[0].prompt[0]["role"] == "system"
    assert dict(shots.train[0].prompt[5]) == {
        "role": "user",
        "content": shots.train[0].extra["question"],
    }
    shot_questions = {prefix[0]["content"], prefix[2]["content"]}
    assert {e.extra["question"] for e in shots.eval} == {
        e.extra["question"] for e in plain.eval
    } - shot_questions
    # without tags the reply is the bare answer, which the whole-response scorer pays in full
    bare = _load(*args, "data.reasoning_gym.few_shot=1", "data.reasoning_gym.answer_tag=null")
    question, reply = bare.train[0].prompt[1:3]
    assert reply["content"].lstrip("-").isdigit()
    assert bare.reward_fn(reply["content"], reply["content"], bare.train[0].extra) == 1.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.reasoning_gym.name=chain_sums"], "no dataset 'chain_sums' (close: chain_sum"),
        ([], "needs exactly one of data.reasoning_gym.name"),
        (["data.reasoning_gym.name=chain_sum", "data.reasoning_gym.config.bogus=1"], "bogus"),
        (["data.reasoning_gym.name=chain_sum", "data.reasoning_gym.config.seed=1"], "seed"),
        (["data.reasoning_gym.name=chain_sum", "data.reasoning_gym.system_prompt=nope"], "nope"),
        (["data.reasoning_gym.name=chain_sum", "data.reasoning_gym.few_shot=-1"], "few_shot=-1"),
        (
            ["data.reasoning_gym.mix=[{name: chain_sum, weight: 0}]"],
            "'weight' must be a number > 0",
        ),
    ],
)
def test_bad_reasoning_gym_config_is_a_config_error_at_load(overrides, message):
    with pytest.raises(ConfigError, match="config: ") as info:
        load_config(None, [*TASK, *overrides])
    assert message in str(info.value)


def test_the_section_without_the_task_is_refused():
    with pytest.raises(ConfigError, match=r"applies to data\.task=reasoning_gym"):
        load_config(None, ["data.reasoning_gym.name=chain_sum"])


def test_a_task_space_smaller_than_training_leaves_no_eval_and_says_so():
    with pytest.raises(ConfigError, match="also asked in training"):
        _load(
            "data.reasoning_gym.name=count_bits",
            "data.reasoning_gym.config.max_n=3",
            "data.num_examples=64",
        )


def test_an_eval_set_mostly_asked_in_training_is_warned_with_what_is_left(caplog):
    # one-digit two-term chain sums are 200 questions: 400 training items ask most of them
    args = ["data.reasoning_gym.name=chain_sum", "data.reasoning_gym.config.max_terms=2"]
    args += ["data.reasoning_gym.config.max_digits=1", "data.num_eval_examples=20"]
    with caplog.at_level(logging.WARNING, logger="trainer.data._reasoning_gym"):
        held_out = _load(*args, "data.num_examples=400").eval
    assert len(held_out) < 10
    assert f"eval measures only {len(held_out)} held-out questions" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.data._reasoning_gym"):
        held_out = _load(*args, "data.num_examples=40").eval
    assert len(held_out) >= 10 and caplog.text == ""


def test_the_reward_refuses_items_it_did_not_make():
    with pytest.raises(ValueError, match="no 'reasoning_gym'"):
        reasoning_gym_reward("7", "7", extra={})
