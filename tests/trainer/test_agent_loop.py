"""The default generator and a custom one against the real in-process engine (DESIGN 4.7)."""

from __future__ import annotations

import pytest

from engines.local.inprocess import open_inprocess_client
from engines.models import build_tiny_model, load_tokenizer
from engines.types import SamplingParams
from tests.trainer.helpers import OneCallGenerator, batch_of
from trainer.errors import FaultInjected
from trainer.generators import (
    AgentLoopGenerator,
    EnvStep,
    GeneratorInput,
    TrajectoryInput,
)
from trainer.generators.agent_loop import shared_first_turns
from trainer.vocabulary import install_faults

#: Words of the tiny model's vocabulary (an unknown word would become a single <unk>).
LONG_OBSERVATION = " ".join(["no , what is the answer ?"] * 4)


class TalkativeEnv(AgentLoopGenerator):
    """Answers every model turn with an observation longer than the response budget."""

    async def env_step(self, item: TrajectoryInput, response_ids: list[int], turn: int) -> EnvStep:
        return EnvStep(done=False, observation=LONG_OBSERVATION)


@pytest.fixture(scope="module")
def model_dir():
    return build_tiny_model()


async def test_an_observation_never_takes_the_response_past_max_response_tokens(model_dir):
    tokenizer = load_tokenizer(model_dir)
    budget = 8
    async with open_inprocess_client(model_dir) as engine:
        gen = TalkativeEnv(
            engine=engine,
            tokenizer=tokenizer,
            reward_fn=lambda response, answer: 0.0,
            # the model turn takes 6 of the 8 tokens: the observation gets the 2 left
            sampling=SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
            max_turns=3,
            max_response_tokens=budget,
        )
        out = await gen.generate(batch_of(tokenizer, 4))
    for t in out.trajectories:
        assert len(t.response_ids) == budget
        assert t.loss_mask == [1] * 6 + [0] * 2
        assert t.finish_reason == "truncated" and t.num_turns == 1


async def test_a_generate_fault_fires_in_a_custom_generator(model_dir):
    tokenizer = load_tokenizer(model_dir)
    async with open_inprocess_client(model_dir) as engine:
        gen = OneCallGenerator(
            engine=engine,
            tokenizer=tokenizer,
            reward_fn=lambda response, answer: 0.0,
            sampling=SamplingParams(max_tokens=2),
        )
        assert len((await gen.generate(batch_of(tokenizer, 2))).trajectories) == 2
        install_faults("generate:error=engine fell over")
        with pytest.raises(FaultInjected) as info:
            await gen.generate(batch_of(tokenizer, 2))
    assert info.value.operation == "generate" and info.value.message == "engine fell over"


class CountingClient:
    """The real in-process client, counting the requests a generator makes."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.urls = inner.urls
        self.requests: list[int] = []  # samples asked by each request

    async def generate(self, prompt_ids, sampling, *, trajectory_id=None):
        self.requests.append(1)
        return await self.inner.generate(prompt_ids, sampling, trajectory_id=trajectory_id)

    async def generate_n(self, prompt_ids, sampling, n, *, trajectory_id=None):
        self.requests.append(n)
        return await self.inner.generate_n(prompt_ids, sampling, n, trajectory_id=trajectory_id)


async def test_a_groups_first_turn_is_one_request_sampling_what_one_per_trajectory_would(
    model_dir,
):
    tokenizer = load_tokenizer(model_dir)
    sampling = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    async with open_inprocess_client(model_dir) as inner:
        engine = CountingClient(inner)
        gen = TalkativeEnv(
            engine=engine,
            tokenizer=tokenizer,
            reward_fn=lambda response, answer: 0.0,
            sampling=sampling,
            max_turns=2,
            max_response_tokens=64,
        )
        batch = batch_of(tokenizer, 4)
        grouped = await gen.generate(batch)
        # the first turn of the four is one request; each second turn is its own
        assert engine.requests == [4, 1, 1, 1, 1]
        alone = [await gen.rollout(item) for item in batch]
    assert [t.response_ids for t in grouped.trajectories] == [t.response_ids for t in alone]
    for g, a in zip(grouped.trajectories, alone):
        assert g.rollout_logprobs == pytest.approx(a.rollout_logprobs, abs=1e-5)
        assert g.num_turns == a.num_turns == 2
    assert len({tuple(t.response_ids) for t in alone}) > 1


def test_shared_first_turns_join_only_a_groups_consecutive_seeds_of_one_prompt():
    def item(group: int, seed: int, prompt: tuple[int, ...] = (1, 2)) -> TrajectoryInput:
        return TrajectoryInput(
            prompt="p",
            prompt_ids=list(prompt),
            answer="a",
            group_id=group,
            trajectory_id=f"t{group}-{seed}",
            seed=seed,
        )

    batch = GeneratorInput(
        (
            item(0, 10),
            item(0, 11),
            item(0, 12),
            item(1, 13),  # another group, though its seed follows
            item(1, 14),
            item(1, 20),  # a seed that does not follow
            item(2, 21),
            item(2, 22, prompt=(3,)),  # another prompt
        )
    )
    assert shared_first_turns(batch) == [[0, 1, 2], [3, 4], [5], [6], [7]]
