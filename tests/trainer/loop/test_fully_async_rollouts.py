"""Fully-async rollout tasks against their bound (``generator.rollout_timeout_s``).

The rollout tasks of :class:`trainer.fully_async.RolloutFeed` and the step's
``take_batch``, with a scripted generator that hangs where a test says, under trio's
MockClock: a rollout past its bound is cancelled, logged, counted and handed out again; a
prompt cut off every time ends the run with ``RolloutTimeoutError``; a shorter step deadline
still fails the step first.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import trio

from trainer.config import load_config
from trainer.data._examples import task_examples
from trainer.errors import RolloutTimeoutError, StepTimeoutError
from trainer.generators import GeneratorInput, GeneratorOutput, Trajectory
from trainer.loop import WeightVersions
from trainer.loop._fully_async import ROLLOUT_ATTEMPTS, RolloutFeed
from trainer.loop._prompt_stream import PromptKey, PromptStream
from trainer.vocabulary import Timer, open_owner_nursery, operation, step_deadline

#: A hang decision: (prompt key, how many rollouts of that prompt started before this one).
HangWhen = Callable[[PromptKey, int], bool]


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


class ScriptedGenerator:
    """Each group takes 1 s in ``env_step``, or hangs there when ``hang_when`` says so."""

    def __init__(self, hang_when: HangWhen) -> None:
        self.hang_when = hang_when
        self.started: list[tuple[PromptKey, int]] = []  # (key, step) of each rollout
        self.cancelled: list[PromptKey] = []

    async def generate(self, batch: GeneratorInput) -> GeneratorOutput:
        epoch, position = (int(x) for x in batch[0].trajectory_id.split("-")[0][1:].split("p"))
        key = (epoch, position)
        before = sum(1 for k, _ in self.started if k == key)
        self.started.append((key, batch.global_step))
        try:
            with operation("env_step"):
                if self.hang_when(key, before):
                    await trio.sleep_forever()
                await trio.sleep(1)
        except trio.Cancelled:
            self.cancelled.append(key)
            raise
        return GeneratorOutput(
            [
                Trajectory(item.prompt_ids, [1], [1], 0.0, [0.0], group_id=0, weight_versions=[0])
                for item in batch
            ]
        )


def _feed(
    hang_when: HangWhen, *overrides: str, prompts: int = 4, workers: int = 2
) -> tuple[RolloutFeed, ScriptedGenerator]:
    cfg = load_config(
        None,
        [
            "trainer.strategy=fully_async",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=2",
            f"generator.num_parallel_workers={workers}",
            *overrides,
        ],
    )
    generator = ScriptedGenerator(hang_when)
    ctx = SimpleNamespace(
        cfg=cfg,
        versions=WeightVersions(current=1),  # after the first sync
        first_step=1,
        generator=generator,
        tokenizer=_Tokenizer(),
    )
    stream = PromptStream(task_examples("max_digit", prompts, 0), seed=0, epochs=1)
    return RolloutFeed(ctx, stream), generator  # type: ignore[arg-type]


def _start(nursery: trio.Nursery, feed: RolloutFeed) -> None:
    for _ in range(feed.ctx.cfg.generator.num_parallel_workers):
        nursery.start_soon(feed.roll_out_groups)


def _first_attempt_of(key: PromptKey) -> HangWhen:
    return lambda k, before: k == key and before == 0


async def test_a_rollout_past_its_bound_is_cancelled_counted_and_its_prompt_handed_out_again(
    autojump_clock, caplog
):
    caplog.set_level(logging.INFO, logger="trainer.fully_async")
    feed, generator = _feed(_first_attempt_of((0, 0)), "generator.rollout_timeout_s=5")
    async with trio.open_nursery() as nursery:
        _start(nursery, feed)
        first, m1 = await feed.take_batch(1)
        assert [g.key for g in first] == [(0, 1), (0, 2)]  # finished while (0, 0) hangs
        assert m1["async/rollouts_timed_out"] == 0
        second, m2 = await feed.take_batch(2)
        assert trio.current_time() == pytest.approx(6.0)  # cut off at 5 s, rolled out again
        nursery.cancel_scope.cancel()
    assert [g.key for g in second] == [(0, 0), (0, 3)]
    assert m2["async/rollouts_timed_out"] == 1
    assert generator.cancelled == [(0, 0)]  # the hung call was cancelled, not abandoned
    assert [k for k, _ in generator.started].count((0, 0)) == 2
    # nothing lost, nothing doubled: every prompt of the epoch trained once, none pending,
    # and the cut-off rollout's admission given back: 4 groups counted for the 4 trained,
    # plus the 2 tasks admitted and waiting for a prompt of the exhausted stream
    trained = Counter(g.key for g in first + second)
    assert sorted(trained) == [(0, 0), (0, 1), (0, 2), (0, 3)] and set(trained.values()) == {1}
    assert feed.prompts.state_dict()["pending"] == [] and feed.prompts.exhausted
    assert feed.admission.admitted == 4 + 2
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage() == (
        "the rollout of prompt (epoch 0, position 0) for step 1 ran past its 5s bound "
        "(generator.rollout_timeout_s) in stage='generate' operation='env_step': cancelled, "
        f"its prompt handed out again (attempt 1 of {ROLLOUT_ATTEMPTS})"
    )


async def test_a_cut_off_rollouts_prompt_is_pending_in_a_checkpoint_until_it_is_trained(
    autojump_clock,
):
    feed, generator = _feed(
        lambda k, before: k == (0, 0) and before < 2,  # its first two attempts hang
        "generator.rollout_timeout_s=5",
        workers=1,
    )
    async with trio.open_nursery() as nursery:
        _start(nursery, feed)
        await trio.sleep(7)  # (0, 0) was cut off at 5 s; its second attempt hangs
        assert generator.started == [((0, 0), 1), ((0, 0), 1)]
        assert feed.prompts.state_dict()["pending"] == [[0, 0]]
        resumed = PromptStream(feed.prompts.examples, seed=0, epochs=1)
        resumed.load_state_dict(feed.prompts.state_dict())
        assert (await resumed.take())[0] == (0, 0)  # a resume rolls it out first
        nursery.cancel_scope.cancel()


async def test_a_prompt_cut_off_every_time_ends_the_run_with_rollout_timeout_error(
    autojump_clock,
):
    feed, generator = _feed(lambda k, before: True, "generator.rollout_timeout_s=5", workers=1)
    with pytest.raises(RolloutTimeoutError) as info:
        async with open_owner_nursery() as nursery:
            _start(nursery, feed)
            await feed.take_batch(1)
    error = info.value
    assert (error.step, error.prompt, error.attempts, error.timeout_s) == (
        1,
        (0, 0),
        ROLLOUT_ATTEMPTS,
        5.0,
    )
    assert (error.stage, error.operation) == ("generate", "env_step")
    assert trio.current_time() == pytest.approx(5.0 * ROLLOUT_ATTEMPTS)
    assert generator.started == [((0, 0), 1)] * ROLLOUT_ATTEMPTS
    assert "raise generator.rollout_timeout_s" in str(error)


async def test_without_rollout_timeout_s_a_rollouts_bound_is_the_steps_budget(autojump_clock):
    feed, generator = _feed(_first_attempt_of((0, 0)), "trainer.step_timeout_s=8")
    async with trio.open_nursery() as nursery:
        _start(nursery, feed)
        await feed.take_batch(1)
        _, metrics = await feed.take_batch(2)
        nursery.cancel_scope.cancel()
    assert metrics["async/rollouts_timed_out"] == 1
    assert trio.current_time() == pytest.approx(9.0)  # cut off at 8 s, rolled out again
    assert generator.cancelled == [(0, 0)]


async def test_with_neither_budget_a_hung_rollout_runs_until_the_run_stops_it(autojump_clock):
    feed, generator = _feed(_first_attempt_of((0, 0)))
    async with trio.open_nursery() as nursery:
        _start(nursery, feed)
        await feed.take_batch(1)
        await trio.sleep(10_000)
        assert generator.cancelled == []
        assert feed.longest_running() == "; the longest running for 10002.0s"
        nursery.cancel_scope.cancel()
    assert generator.cancelled == [(0, 0)]  # by the end of the run, not by a bound


async def test_a_step_deadline_shorter_than_the_rollouts_bound_fails_the_step_first(
    autojump_clock, caplog
):
    feed, _ = _feed(
        lambda k, before: True, "trainer.step_timeout_s=3", "generator.rollout_timeout_s=5"
    )
    with pytest.raises(StepTimeoutError) as info:
        async with open_owner_nursery() as nursery:
            _start(nursery, feed)
            with step_deadline(1, 3.0), Timer("wait_for_generation_buffer"):
                await feed.take_batch(1)
    assert (info.value.step, info.value.budget_s) == (1, 3.0)
    assert (info.value.stage, info.value.operation) == (
        "wait_for_generation_buffer",
        "wait_for_batch",
    )
    assert trio.current_time() == pytest.approx(3.0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
