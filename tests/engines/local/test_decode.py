"""The reference engine's decode step: packed KV caches and batched sampling.

Greedy results are checked against ``transformers``' own forward of each prompt alone,
through every path a cache takes: one prefill shared by identical prompts, a batch decoding
together (its cache used as it is), requests joining mid-flight (rows gathered from several
caches of different widths) and requests finishing early (a subset of a cache's rows).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
import trio

from engines.local.decode import exponential_noise, sample_tokens
from engines.local.engine import open_local_engine
from engines.types import SamplingParams
from tests.engines.helpers import StepGate, greedy_reference


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


async def test_requests_joining_and_leaving_mid_flight_decode_as_if_alone(model_dir: Path) -> None:
    # (prompt, max_tokens, steps to run before sending it)
    plan = [
        ([5, 6, 7], 16, 0),
        ([9, 10, 11, 12, 13, 14, 15], 16, 0),
        ([20], 3, 0),  # leaves after 3 steps: the others go on as a subset of their cache
        ([30, 31], 12, 4),  # joins a running batch: rows gathered from two caches
        ([30, 31], 12, 4),  # same prompt, same step: one shared prefill
        ([40, 41, 42, 43], 6, 8),  # a third cache, of another width
    ]
    results: dict[int, list[int]] = {}
    async with open_local_engine(model_dir) as engine:
        # each joiner is sent while the step after its count is held, and queues behind it
        with StepGate(engine, hold={after + 1 for _, _, after in plan if after}) as gate:

            async def one(i: int) -> None:
                prompt, max_tokens, after = plan[i]
                if after:
                    await gate.reached(after + 1)
                greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                results[i] = (await engine.generate(prompt, greedy)).token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(plan)):
                    nursery.start_soon(one, i)
                for held in sorted({after + 1 for _, _, after in plan if after}):
                    await gate.reached(held)
                    joiners = sum(1 for _, _, after in plan if after + 1 == held)
                    with trio.fail_after(60):  # the engine has no event for an arrival
                        while engine.num_waiting < joiners:  # noqa: ASYNC110
                            await trio.sleep(0.001)
                    gate.release(held)
        sizes = set(engine.batch_size_counts)
        # 3 at first, 2 once [20] left, 4 with the two joiners, 5 with the third
        assert {2, 3, 4, 5} <= sizes, f"the batch never changed shape: {engine.batch_size_counts}"
        for i, (prompt, max_tokens, _) in enumerate(plan):
            expected = await trio.to_thread.run_sync(
                greedy_reference, engine.model, prompt, max_tokens
            )
            assert results[i] == expected, f"request {i}"


async def test_a_seed_samples_the_same_tokens_whatever_shares_the_batch(model_dir: Path) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=77)
    async with open_local_engine(model_dir) as engine:
        alone = (await engine.generate([5, 6, 7], params)).token_ids
        crowd: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            p = params if i == 0 else SamplingParams(max_tokens=12, ignore_eos=True, seed=i)
            crowd[i] = (await engine.generate([5, 6, 7] if i == 0 else [8 + i, 9], p)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
    assert crowd[0] == alone
    assert len({tuple(v) for v in crowd.values()}) > 1  # the seeds really sample


def _frequencies(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    noise = torch.empty((draws, logits.shape[-1])).exponential_(1.0, generator=generator)
    tokens = sample_tokens(logits.expand(draws, -1), [params] * draws, noise)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / draws


def test_sampling_follows_the_softmax_at_each_rows_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    for temperature in (1.0, 0.5, 2.0):
        freq = _frequencies(logits, SamplingParams(temperature=temperature), 20_000)
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        assert torch.allclose(freq, expected, atol=0.015), (temperature, freq, expected)


def test_top_p_keeps_the_smallest_set_of_tokens_over_p() -> None:
    logits = torch.log(torch.tensor([[0.15, 0.5, 0.05, 0.3]]))
    freq = _frequencies(logits, SamplingParams(top_p=0.7), 20_000)
    # 0.5 + 0.3 reach 0.7: the other two are never sampled, the first two renormalised
    assert freq[0] == 0 and freq[2] == 0
    assert torch.allclose(freq[[1, 3]], torch.tensor([0.625, 0.375]), atol=0.015)


def test_each_row_samples_with_its_own_params_and_noise() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    params = [
        SamplingParams(temperature=0),  # greedy: the argmax whatever the noise
        SamplingParams(temperature=0),
        SamplingParams(),  # uniform probabilities: the smallest noise wins the race
        SamplingParams(),
    ]
    noise = torch.tensor([[0.01, 9.0, 9.0], [9.0, 0.01, 9.0], [0.5, 2.0, 3.0], [3.0, 2.0, 0.5]])
    assert sample_tokens(logits, params, noise).tolist() == [1, 0, 0, 2]


def test_a_seeded_request_samples_what_torch_multinomial_samples() -> None:
    # the same draws as torch.multinomial(probs, 1, generator): seeded runs keep their tokens
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.8)] * 64
    noise = exponential_noise([torch.Generator().manual_seed(s) for s in range(64)], 50)
    probs = torch.softmax(logits / 0.8, dim=-1)
    expected = [
        int(torch.multinomial(probs[s], 1, generator=torch.Generator().manual_seed(s)))
        for s in range(64)
    ]
    assert sample_tokens(logits, params, noise).tolist() == expected


async def test_top_alternatives_are_the_best_logprobs_and_change_nothing_sampled(
    model_dir: Path,
) -> None:
    prompt = [5, 6, 7]
    plain_params = SamplingParams(max_tokens=6, seed=4, ignore_eos=True)
    async with open_local_engine(model_dir) as engine:
        plain = await engine.generate(prompt, plain_params)
        rich = await engine.generate(
            prompt, SamplingParams(max_tokens=6, seed=4, ignore_eos=True, top_logprobs=3)
        )
        seq = prompt + rich.token_ids
        logits = engine.model(torch.tensor([seq])).logits[0, len(prompt) - 1 : -1].float()
    assert plain.top_logprobs == []
    assert rich.token_ids == plain.token_ids
    assert rich.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
    expected = torch.log_softmax(logits, dim=-1).topk(3, dim=-1)
    assert len(rich.top_logprobs) == len(rich.token_ids)
    for top, ids, values in zip(
        rich.top_logprobs, expected.indices.tolist(), expected.values.tolist()
    ):
        assert [t for t, _ in top] == ids
        assert [v for _, v in top] == pytest.approx(values, abs=1e-4)


async def test_a_stop_string_ends_the_completion_at_the_token_that_completes_it(
    model_dir: Path,
) -> None:
    params = SamplingParams(max_tokens=10, seed=1, ignore_eos=True)
    async with open_local_engine(model_dir) as engine:
        free = await engine.generate([5, 6, 7], params)
        words = engine.tokenizer.convert_ids_to_tokens(free.token_ids)
        special = set(engine.tokenizer.all_special_ids)  # not in the text: never a stop
        word = next(w for w, t in zip(words[3:], free.token_ids[3:]) if t not in special)
        stopped = await engine.generate([5, 6, 7], attrs.evolve(params, stop=(word,)))
    first = words.index(word)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
