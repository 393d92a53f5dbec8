"""The reference engine's prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's
logprob, rank and the k best at its position, equal to ``transformers``' own forward of the
prompt alone to 1e-5, through a batched, left-padded prefill shared with other requests and
whatever the sampling temperature (vLLM's prompt logprobs are of the raw logits). The HTTP
answers' shapes are checked against vLLM's schemas in ``test_openai_routes`` and
``test_token_route``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

from engines.local.engine import open_local_engine
from engines.types import Completion, PromptLogprob, SamplingParams

PROMPTS = [[5, 17, 3, 22, 9, 40, 41], [7, 8], [30, 31, 32, 33]]
K = 3


def expected(model: torch.nn.Module, prompt: list[int]) -> list[PromptLogprob | None]:
    """The prompt logprobs from the model's forward of ``prompt`` alone, by hand."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    out: list[PromptLogprob | None] = [None]
    for i, tok in enumerate(prompt[1:]):
        row = logprobs[i]
        values, ids = torch.topk(row, K)
        out.append(
            PromptLogprob(
                float(row[tok]),
                int((row >= row[tok]).sum()),
                list(zip(ids.tolist(), values.tolist())),
            )
        )
    return out


def assert_close(got: list[PromptLogprob | None], want: list[PromptLogprob | None]) -> None:
    assert len(got) == len(want)
    assert got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g is not None and w is not None
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert g.rank == w.rank
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [lp for _, lp in g.top] == pytest.approx([lp for _, lp in w.top], abs=1e-5)


@pytest.fixture(scope="module")
def answers(model_dir: Path) -> list[list[Completion]]:
    """Every prompt at once (one left-padded prefill): the first prompt twice at T=0.5 (its
    samples share one prefill row), the others once; plus one request without prompt
    logprobs in the same batch. Run under the processed logprobs mode, which must not touch
    the prompt's."""

    async def main() -> list[list[Completion]]:
        results: list[list[Completion]] = [[] for _ in range(len(PROMPTS) + 1)]
        async with open_local_engine(
            model_dir, logprobs_mode="processed_logprobs", batch_wait_s=0.05
        ) as engine:

            async def one(i: int, prompt: list[int], params: SamplingParams) -> None:
                results[i].append(await engine.generate(prompt, params))

            async with trio.open_nursery() as nursery:
                for i, prompt in enumerate(PROMPTS):
                    params = SamplingParams(
                        temperature=0.5, max_tokens=2, seed=i, prompt_logprobs=K
                    )
                    for _ in range(2 if i == 0 else 1):
                        nursery.start_soon(one, i, prompt, params)
                nursery.start_soon(one, len(PROMPTS), PROMPTS[0], SamplingParams(max_tokens=2))
        return results

    return trio.run(main)


def test_prompt_logprobs_equal_the_models_own_forward_of_each_prompt_alone(
    model_dir: Path, answers: list[list[Completion]]
) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, completions in zip(PROMPTS, answers):
        want = expected(model, prompt)
        for c in completions:
            assert_close(c.prompt_logprobs, want)
    assert answers[-1][0].prompt_logprobs == []  # not asked for: none


def test_a_prompt_logprob_is_at_most_its_positions_best_and_ranked_by_it(
    answers: list[list[Completion]],
) -> None:
    for completions in answers[:-1]:
        for score in completions[0].prompt_logprobs[1:]:
            assert score is not None and len(score.top) == K
            best = score.top[0][1]
            assert score.logprob <= best + 1e-6
            assert (score.rank == 1) == (score.logprob >= best - 1e-6)
            in_top = [i + 1 for i, (_, lp) in enumerate(score.top) if lp == score.logprob]
            assert not in_top or score.rank in in_top
