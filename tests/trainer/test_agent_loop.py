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
    TrajectoryInput,
)
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
