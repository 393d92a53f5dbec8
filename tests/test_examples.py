"""The examples run for real: the multi-turn generator against the in-process engine and in training."""

from __future__ import annotations

import json

import attrs

import trainer.run
from engines.local.inprocess import open_inprocess_client
from engines.models import build_tiny_model, load_tokenizer
from engines.types import SamplingParams
from examples.multi_turn_generator import RETRY_OBSERVATION, RetryOnWrongGenerator
from tests.trainer.helpers import batch_of
from trainer.config import load_config
from trainer.generators import GeneratorInput
from trainer.generators.chat import chat_turn_ids, render_prompt

GENERATOR = "examples.multi_turn_generator:RetryOnWrongGenerator"


def always_wrong(response: str, answer: str) -> float:
    """A reward function under which every first answer is wrong (so every trajectory retries)."""
    return 0.0


def always_right(response: str, answer: str) -> float:
    return 1.0


async def _generate(reward_fn, max_turns: int, batch=None, **kwargs):
    model_dir = build_tiny_model()
    tokenizer = load_tokenizer(model_dir)
    async with open_inprocess_client(model_dir) as engine:
        gen = RetryOnWrongGenerator(
            engine=engine,
            tokenizer=tokenizer,
            reward_fn=reward_fn,
            sampling=SamplingParams(temperature=1.0, max_tokens=6),
            max_turns=max_turns,
            max_response_tokens=64,
            **kwargs,
        )
        out = await gen.generate(batch or batch_of(tokenizer, 4))
    return tokenizer, out


def half_right(response: str, answer: str) -> float:
    return 0.5


async def test_retry_discount_is_a_constructor_option():
    _, out = await _generate(half_right, max_turns=2, retry_discount=0.25)
    assert [t.reward for t in out.trajectories] == [0.5 * 0.25] * 4


async def test_with_a_chat_prompt_the_retry_is_a_user_chat_turn():
    tokenizer = load_tokenizer(build_tiny_model())
    messages = [{"role": "user", "content": "max 7 5 ="}]
    text, ids = render_prompt(tokenizer, messages)
    batch = GeneratorInput(
        tuple(
            attrs.evolve(item, prompt=text, prompt_ids=ids, messages=messages)
            for item in batch_of(tokenizer, 2)
        )
    )
    _, out = await _generate(always_wrong, max_turns=2, batch=batch)
    turn = chat_turn_ids(tokenizer, {"role": "user", "content": RETRY_OBSERVATION})
    assert tokenizer.decode(turn) == f"user : {RETRY_OBSERVATION} <eos> assistant :"
    for t in out.trajectories:
        assert t.num_turns == 2
        assert [tok for tok, m in zip(t.response_ids, t.loss_mask) if m == 0] == turn


async def test_wrong_first_answer_gets_an_observation_and_a_second_model_turn():
    tokenizer, out = await _generate(always_wrong, max_turns=2)
    obs = tokenizer.encode(RETRY_OBSERVATION, add_special_tokens=False)
    assert len(out.trajectories) == 4
    assert out.metrics["generate/num_turns_mean"] == 2.0
    # the example's own metrics: one retry each, none solved
    assert out.metrics["generate/retries"] == 1.0 and out.metrics["generate/solved"] == 0.0
    for t in out.trajectories:
        assert t.num_turns == 2
        assert t.reward == 0.0
        env_tokens = [tok for tok, m in zip(t.response_ids, t.loss_mask) if m == 0]
        assert env_tokens == obs  # exactly the observation is masked out, nothing else
        first_env = t.loss_mask.index(0)
        assert t.response_ids[first_env : first_env + len(obs)] == obs
        assert all(m == 1 for m in t.loss_mask[first_env + len(obs) :])  # the second model turn
        assert len(t.loss_mask) > first_env + len(obs)
        assert all(lp == 0.0 for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m == 0)


async def test_right_first_answer_ends_the_trajectory_after_one_turn():
    _, out = await _generate(always_right, max_turns=2)
    # no trajectory retried: a name none of the batch reported is not in the step's metrics
    assert out.metrics["generate/solved"] == 1.0 and "generate/retries" not in out.metrics
    for t in out.trajectories:
        assert t.num_turns == 1
        assert t.reward == 1.0
        assert all(m == 1 for m in t.loss_mask)


async def test_multi_turn_generator_trains_end_to_end(tmp_path):
    cfg = load_config(
        None,
        [
            f"generator.cls={GENERATOR}",
            "generator.max_turns=2",
            "generator.kwargs.retry_discount=0.25",
            "trainer.max_steps=2",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=2",
            f"trainer.run_dir={tmp_path}",
            "trainer.progress=false",
            "data.reward_fn=tests.test_examples:always_wrong",
        ],
    )
    await trainer.run.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["generate/num_turns_mean"] == 2.0 for r in rows)
    # one name per value: the trained-token count is response_length/mean, nothing else
    assert all(
        "generate/response_length_mean" not in r and r["response_length/mean"] > 0 for r in rows
    )
    assert all(r["reward/mean"] == 0.0 for r in rows)
