"""The default generator and a custom one against the real in-process engine (DESIGN 4.7)."""

from __future__ import annotations

import itertools

import attrs
import pytest

from engines.local.inprocess import open_inprocess_client
from engines.models import build_tiny_model, load_tokenizer
from engines.types import SamplingParams
from tests.trainer.helpers import OneCallGenerator, batch_of
from trainer.errors import ConfigError, FaultInjected
from trainer.generators import (
    AgentLoopGenerator,
    EnvStep,
    GeneratorInput,
    TrajectoryInput,
    check_generator_kwargs,
)
from trainer.generators.agent_loop import shared_first_turns
from trainer.generators.chat import chat_turn_ids, render_prompt
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


class SpyClient:
    """The real in-process client, recording each request's prompt ids and sampled ids."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.urls = inner.urls
        self.calls: list[tuple[list[int], list[int]]] = []  # (prompt ids, sampled ids)

    async def generate(self, prompt_ids, sampling, *, trajectory_id=None):
        c = await self.inner.generate(prompt_ids, sampling, trajectory_id=trajectory_id)
        self.calls.append((list(prompt_ids), list(c.token_ids)))
        return c

    async def generate_n(self, prompt_ids, sampling, n, *, trajectory_id=None):
        cs = await self.inner.generate_n(prompt_ids, sampling, n, trajectory_id=trajectory_id)
        self.calls += [(list(prompt_ids), list(c.token_ids)) for c in cs]
        return cs


class SpyTokenizer:
    """The real tokenizer, recording every text it is asked to tokenize."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.encoded: list[str] = []

    def encode(self, text, **kwargs):
        self.encoded.append(text)
        return self.inner.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ShortTalk(AgentLoopGenerator):
    async def env_step(self, item: TrajectoryInput, response_ids: list[int], turn: int) -> EnvStep:
        if turn + 1 >= self.max_turns:
            return EnvStep(done=True, reward=1.0)
        return EnvStep(done=False, observation="what is the answer ?")


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
async def test_multi_turn_rollouts_are_token_in_token_out(model_dir, chat):
    tokenizer = SpyTokenizer(load_tokenizer(model_dir))
    messages = [{"role": "user", "content": "max 7 5 ="}]
    text, ids = render_prompt(tokenizer.inner, messages if chat else "max 7 5 =")
    item = TrajectoryInput(
        prompt=text,
        prompt_ids=ids,
        answer="7",
        group_id=0,
        trajectory_id="1-0-0",
        seed=3,
        messages=messages if chat else None,
    )
    obs = (
        chat_turn_ids(tokenizer.inner, {"role": "user", "content": "what is the answer ?"})
        if chat
        else tokenizer.inner.encode("what is the answer ?", add_special_tokens=False)
    )
    async with open_inprocess_client(model_dir) as inner:
        engine = SpyClient(inner)
        gen = ShortTalk(
            engine=engine,
            tokenizer=tokenizer,
            reward_fn=lambda response, answer: 0.0,
            sampling=SamplingParams(temperature=1.0, max_tokens=3),
            max_turns=3,
            max_response_tokens=64,
        )
        # two trajectories: the first turn is one generate_n request, later turns their own
        out = await gen.generate(GeneratorInput((item, attrs.evolve(item, seed=4))))
    assert len(engine.calls) == 6 and all(t.num_turns == 3 for t in out.trajectories)
    for t in out.trajectories:
        mine = [(p, s) for p, s in engine.calls if (p + s) == (ids + t.response_ids)[: len(p + s)]]
        assert len(mine) == 3
        for (p0, s0), (p1, _s1) in itertools.pairwise(mine):
            assert p1 == p0 + s0 + obs  # the previous request, its sample, the observation
        assert mine[0][0] == ids
        assert t.prompt_ids + t.response_ids == mine[-1][0] + mine[-1][1]
        assert [m for m in t.loss_mask] == (
            [1] * len(mine[0][1])
            + [0] * len(obs)
            + [1] * len(mine[1][1])
            + [0] * len(obs)
            + [1] * len(mine[2][1])
        )
    # nothing was tokenized but the observations: the conversation never is
    assert set(tokenizer.encoded) <= {"what is the answer ?"}


async def test_the_default_environment_passes_the_examples_extra_to_the_reward_function(model_dir):
    tokenizer = load_tokenizer(model_dir)
    seen: list[dict] = []

    def reward(response: str, answer: str, *, extra) -> float:
        seen.append(dict(extra))
        return float(extra["weight"])

    batch = batch_of(tokenizer, 2)
    batch = GeneratorInput(tuple(attrs.evolve(i, extra={"weight": 0.25}) for i in batch))
    async with open_inprocess_client(model_dir) as engine:
        gen = AgentLoopGenerator(
            engine=engine,
            tokenizer=tokenizer,
            reward_fn=reward,
            sampling=SamplingParams(max_tokens=2),
        )
        out = await gen.generate(batch)
    assert [t.reward for t in out.trajectories] == [0.25, 0.25]
    assert seen == [{"weight": 0.25}] * 2


def test_an_unknown_keyword_argument_to_the_built_in_generator_is_a_config_error(model_dir):
    with pytest.raises(ConfigError) as info:
        AgentLoopGenerator(
            engine=None,  # type: ignore[arg-type]
            tokenizer=None,
            reward_fn=lambda response, answer: 0.0,
            sampling=SamplingParams(),
            temprature=0.5,
        )
    assert str(info.value).startswith(
        "config: generator.kwargs.temprature: trainer.generators.agent_loop:AgentLoopGenerator "
        "takes no keyword argument 'temprature'"
    )
    with pytest.raises(ConfigError, match=r"generator\.kwargs\.temprature: .*AgentLoopGenerator"):
        check_generator_kwargs(AgentLoopGenerator, {"temprature": 0.5})


class Explicit(AgentLoopGenerator):
    def __init__(
        self, engine, tokenizer, reward_fn, sampling, max_turns, max_response_tokens, *, depth=1
    ):
        super().__init__(
            engine=engine,
            tokenizer=tokenizer,
            reward_fn=reward_fn,
            sampling=sampling,
            max_turns=max_turns,
            max_response_tokens=max_response_tokens,
        )
        self.depth = depth


class Forwarding(AgentLoopGenerator):
    def __init__(self, *, depth: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.depth = depth


class KeepsItsOptions(AgentLoopGenerator):
    def __init__(self, *, depth: int = 1, **options) -> None:
        super().__init__(**{k: options.pop(k) for k in list(options) if k in TRAINER_ARGS})
        self.options = options  # free-form: any key may be meant for it


class PopsItsOwn(AgentLoopGenerator):
    def __init__(self, **kwargs) -> None:
        self.depth = kwargs.pop("depth", 1)  # takes a key its signature does not name
        super().__init__(**kwargs)


class Renames(Forwarding):
    def __init__(self, **kwargs) -> None:
        kwargs["depth"] = kwargs.pop("levels", 1)
        super().__init__(**kwargs)


TRAINER_ARGS = ("engine", "tokenizer", "reward_fn", "sampling", "max_turns", "max_response_tokens")


def test_generator_kwargs_are_checked_against_the_constructor_before_anything_starts():
    check_generator_kwargs(Explicit, {"depth": 2})
    check_generator_kwargs(Forwarding, {"depth": 2})
    # **kwargs handed on to super().__init__ all the way: a key no constructor names is
    # refused here, with the closest name (what the journeys met only after start-up)
    with pytest.raises(ConfigError, match=r"kwargs\.detph: .*Forwarding .*did you mean 'depth'"):
        check_generator_kwargs(Forwarding, {"detph": 2})
    check_generator_kwargs(KeepsItsOptions, {"depth": 2, "anything": 1})  # checked when built
    # a constructor that pops or renames a key before handing the rest on takes keys its
    # signature does not name: never refused here
    check_generator_kwargs(PopsItsOwn, {"depth": 2})
    check_generator_kwargs(Renames, {"levels": 2})
    with pytest.raises(ConfigError) as refused:
        check_generator_kwargs(Forwarding, {"slf": 2})
    assert "did you mean" not in str(refused.value)  # 'self' is no keyword it takes
    with pytest.raises(
        ConfigError,
        match=r"generator.kwargs.width: \S*test_agent_loop:Explicit takes no keyword argument 'width'",
    ):
        check_generator_kwargs(Explicit, {"depth": 2, "width": 3})
    with pytest.raises(
        ConfigError,
        match=r"generator\.kwargs\.max_turns is set by the trainer itself; use generator\.max_turns",
    ):
        check_generator_kwargs(Forwarding, {"max_turns": 3})
    with pytest.raises(
        ConfigError, match=r"generator\.kwargs\.width: .*Forwarding takes no keyword"
    ):
        Forwarding(
            engine=None,  # type: ignore[arg-type]
            tokenizer=None,
            reward_fn=lambda response, answer: 0.0,
            sampling=SamplingParams(),
            depth=2,
            width=3,
        )


class RecordingEnv(AgentLoopGenerator):
    """Three model turns; records what ``last_turn_ids`` gives on each; reports metrics."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[list[int], list[int]]] = []

    async def env_step(self, item: TrajectoryInput, response_ids: list[int], turn: int) -> EnvStep:
        self.seen.append((list(response_ids), self.last_turn_ids(response_ids)))
        if turn == 2:
            return EnvStep(done=True, reward=1.0, metrics={"tool_calls": 1.0, "solved": 1.0})
        return EnvStep(done=False, observation="no , what ?", metrics={"tool_calls": 1.0})


async def _three_turns(model_dir, cls: type[RecordingEnv], n: int, max_tokens: int):
    """``n`` trajectories of three ``max_tokens``-token model turns each, by ``cls``."""
    tokenizer = load_tokenizer(model_dir)
    batch = batch_of(tokenizer, n)
    async with open_inprocess_client(model_dir) as engine:
        gen = cls(
            engine=engine,
            tokenizer=tokenizer,
            reward_fn=lambda response, answer: 0.0,
            sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True),
            max_turns=3,
            max_response_tokens=64,
        )
        return gen, batch, tokenizer, await gen.generate(batch)


async def test_last_turn_ids_is_the_models_latest_turn_alone(model_dir):
    gen, _, tokenizer, out = await _three_turns(model_dir, RecordingEnv, 1, 3)
    (t,) = out.trajectories
    obs = tokenizer.encode("no , what ?", add_special_tokens=False)
    turns = [t.response_ids[0:3], t.response_ids[3 + len(obs) : 6 + len(obs)]]
    turns.append(t.response_ids[6 + 2 * len(obs) :])
    assert [last for _, last in gen.seen] == turns
    assert all(len(last) == 3 for last in turns)
    # and outside a rollout there is no latest turn
    with pytest.raises(RuntimeError, match="no model turn is in progress"):
        gen.last_turn_ids(t.response_ids)


async def test_env_step_metrics_add_up_per_trajectory_and_average_over_the_batch(model_dir):
    class SolvesEveryOther(RecordingEnv):
        async def env_step(self, item, response_ids, turn):
            step = await super().env_step(item, response_ids, turn)
            if step.done and item.seed % 2:  # the odd seeds' trajectories are not solved
                return attrs.evolve(step, metrics={"tool_calls": 1.0})
            return step

    _, batch, _, out = await _three_turns(model_dir, SolvesEveryOther, 4, 2)
    solved = [1.0 if item.seed % 2 == 0 else 0.0 for item in batch]
    assert [t.metrics for t in out.trajectories] == [
        {"tool_calls": 3.0, "solved": 1.0} if s else {"tool_calls": 3.0} for s in solved
    ]
    assert out.metrics["generate/tool_calls"] == 3.0
    assert solved == [1.0, 0.0, 1.0, 0.0]
    assert out.metrics["generate/solved"] == 0.5  # a trajectory that never reported it: 0
    assert out.metrics["generate/num_turns_mean"] == 3.0
