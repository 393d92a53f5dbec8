"""VerifiersGenerator: verifiers 0.4 episodes (the reasoning-gym taskset and the in-process
harness of ``examples/verifiers_reasoning_gym``) against the real reference server (in this
process, over real HTTP), through the real capture proxy, verifiers' own training client
(``renderers``: client-side rendering, the token-in route) and the trio-asyncio bridge.
Nothing of verifiers is faked.

Skipped where verifiers is not installed (``pip install -e '.[verifiers]'``, which setup.sh
and CI do).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

pytest.importorskip("verifiers.v1", reason="verifiers is an extra: pip install -e '.[verifiers]'")
pytest.importorskip("reasoning_gym", reason="pip install -e '.[verifiers]'")

import trainer.run
from engines.client import InferenceClient
from engines.models import build_tiny_model, load_tokenizer
from engines.types import SamplingParams
from tests.engines.helpers import serve_reference
from tests.sync.exactness import policy_logprobs
from trainer.config import load_config
from trainer.errors import ConfigError, StepTimeoutError
from trainer.generators import GeneratorInput, TrajectoryInput
from trainer.generators.verifiers_env import VerifiersGenerator
from trainer.generators.verifiers_traces import EpisodeOutcome, trajectories_of
from trainer.vocabulary import install_faults, stage, step_deadline

TASKSET = {"id": "examples.verifiers_reasoning_gym", "size": 8, "seed": 1}
HARNESS = {"id": "examples.verifiers_reasoning_gym.harness"}


def batch(groups: int, n: int, step: int = 1) -> GeneratorInput:
    return GeneratorInput(
        tuple(
            TrajectoryInput(
                prompt="unused",
                prompt_ids=[5, 6],
                answer="",
                group_id=g,
                trajectory_id=f"{step}-{g}-{i}",
                seed=100 * g + i,
            )
            for g in range(groups)
            for i in range(n)
        ),
        global_step=step,
    )


def make(engine: Any, model_dir: Path, **kwargs: Any) -> VerifiersGenerator:
    return VerifiersGenerator(
        engine=engine,
        tokenizer=load_tokenizer(model_dir),
        reward_fn=lambda r, a: 0.0,
        sampling=SamplingParams(temperature=1.0, max_tokens=8),
        max_response_tokens=64,
        **{"taskset": TASKSET, "harness": HARNESS, **kwargs},
    )


async def test_episodes_train_on_the_tokens_the_engine_sampled_one_task_per_group() -> None:
    model_dir = build_tiny_model()
    async with serve_reference(model_dir) as url, InferenceClient([url]) as engine:
        gen = make(engine, model_dir)
        async with gen.running():
            assert gen.environment is not None and len(gen.tasks) == 8
            first = await gen.generate(batch(2, 2, step=1))
            second = await gen.generate(batch(2, 2, step=2))
            again = await gen.generate(batch(2, 2, step=1))  # the same tasks and seeds
        assert gen.environment is None  # serving and the bridge closed with the block
        with pytest.raises(RuntimeError, match="outside its running"):
            await gen.generate(batch(1, 1))
    assert (
        first.metrics["generate/failed_episodes"] == 0 == second.metrics["generate/failed_episodes"]
    )
    assert len(first.trajectories) == 4 and len(second.trajectories) == 4
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for t in first.trajectories + second.trajectories:
        assert t.prompt_ids and 0 < len(t.response_ids) <= 8  # generator.sampling.max_tokens
        assert t.loss_mask == [1] * len(t.response_ids)  # one model turn: every token sampled
        # the trace's tokens and logprobs are the engine's samples, scored as the policy
        want = policy_logprobs(policy, t.prompt_ids, t.response_ids)
        assert t.rollout_logprobs == pytest.approx(want, abs=1e-4)
        assert t.reward == 0.0  # the untrained model never writes <answer>...</answer>
        assert t.finish_reason in ("stop", "length") and t.num_turns == 1
    # a group's samples share a task (its prompt), groups and steps get the taskset's next ones
    prompts = [tuple(t.prompt_ids) for t in first.trajectories + second.trajectories]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3]
    assert len({prompts[0], prompts[2], prompts[4], prompts[6]}) == 4
    assert prompts[4] == prompts[5] and prompts[6] == prompts[7]
    # each episode is seeded by its trajectory's seed: a step again samples the same tokens
    assert [t.response_ids for t in again.trajectories] == [
        t.response_ids for t in first.trajectories
    ]


async def test_failed_episodes_teach_nothing_and_are_counted() -> None:
    """Every model call fails (a ``generate`` fault, where the proxy calls the engine): each
    episode fails in verifiers (its trace not ok), and each trajectory has loss mask 0."""
    model_dir = build_tiny_model()
    async with serve_reference(model_dir) as url, InferenceClient([url]) as engine:
        gen = make(engine, model_dir)
        async with gen.running():
            install_faults("generate:error=engine down")
            try:
                out = await gen.generate(batch(1, 3))
            finally:
                install_faults("")
    assert out.metrics["generate/failed_episodes"] == 3
    assert len(out.trajectories) == 3
    for t in out.trajectories:
        assert sum(t.loss_mask) == 0 and t.reward == 0.0


async def test_a_hung_model_call_ends_the_step_typed_and_the_next_step_runs() -> None:
    """A model call that never returns (a ``generate`` hang, where the proxy calls the engine):
    the step's deadline cancels the episodes (asyncio tasks, through the bridge) and raises
    ``StepTimeoutError``; the environment keeps serving the next step; leaving ``running``
    leaves no task behind, the hung call included."""
    model_dir = build_tiny_model()
    async with serve_reference(model_dir) as url, InferenceClient([url]) as engine:
        gen = make(engine, model_dir)
        async with trio.open_nursery() as scope_of_the_test:
            async with gen.running():
                install_faults("generate:hang@4")
                try:
                    with pytest.raises(StepTimeoutError) as info:
                        with step_deadline(4, 5.0), stage("generate"):
                            await gen.generate(batch(1, 2, step=4))
                finally:
                    install_faults("")
                with trio.fail_after(60):
                    after = await gen.generate(batch(1, 2, step=5))
            assert list(scope_of_the_test.child_tasks) == []
    assert (info.value.stage, info.value.step) == ("generate", 4)
    # the step's own task waits in the episode (the model call is the proxy's, in its task)
    assert info.value.operation == "env_step"
    assert after.metrics["generate/failed_episodes"] == 0


def test_a_failed_episode_gets_its_groups_mean_reward_and_no_loss() -> None:
    ok = [([1, 2, 3, 4], [False, False, True, True], [0.0, 0.0, -0.5, -0.25])]
    outcomes = [
        EpisodeOutcome(ok, 1.0, True, finishes=("stop",)),
        EpisodeOutcome(ok, 0.5, True, finishes=("length",)),
        EpisodeOutcome(ok, 0.9, False, "ProviderError: 500"),  # a failed trace's reward: unused
        EpisodeOutcome.raised(TimeoutError("episode")),
    ]
    out = trajectories_of(batch(1, 4), outcomes, decode=str, max_response_tokens=64)
    assert [t.reward for t in out.trajectories] == [1.0, 0.5, 0.75, 0.75]
    assert [sum(t.loss_mask) for t in out.trajectories] == [2, 2, 0, 0]
    assert [t.finish_reason for t in out.trajectories[:2]] == ["stop", "length"]
    assert out.trajectories[0].rollout_logprobs == [-0.5, -0.25]
    assert out.trajectories[3].response_ids == [] and out.trajectories[3].prompt_ids == [5, 6]
    assert out.metrics["generate/failed_episodes"] == 2
    cut = trajectories_of(batch(1, 1), outcomes[:1], decode=str, max_response_tokens=1)
    (t,) = cut.trajectories
    assert (t.response_ids, t.loss_mask, t.finish_reason) == ([3], [1], "truncated")


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"taskset": None}, "generator.kwargs.taskset must be a mapping"),
        ({"taskset": {"dataset": "chain_sum"}}, "generator.kwargs.taskset must be a mapping"),
        ({"runtime": "subprocess"}, "generator.kwargs.runtime must be a mapping"),
    ],
)
def test_kwargs_of_the_wrong_shape_are_config_errors(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        make(None, build_tiny_model(), **kwargs)


async def test_an_environment_verifiers_refuses_ends_the_run_before_any_step() -> None:
    model_dir = build_tiny_model()
    with pytest.raises(ConfigError, match="needs the engines' HTTP client"):
        async with make(None, model_dir).running():
            pass
    async with serve_reference(model_dir) as url, InferenceClient([url]) as engine:
        await check_refused(engine, model_dir)


async def check_refused(engine: Any, model_dir: Path) -> None:
    gen = make(engine, model_dir, taskset={**TASKSET, "size": "many"})
    with pytest.raises(
        ConfigError, match=r"(?s)does not make a verifiers environment.*taskset.size"
    ):
        async with gen.running():
            pass
    gen = make(engine, model_dir, taskset={"id": "examples.no_such_taskset"})
    with pytest.raises(ConfigError, match="no_such_taskset"):
        async with gen.running():
            pass


def train(tmp_path: Path, taskset: dict[str, Any], steps: int, *more: str) -> Any:
    """``steps`` steps of the trainer (reference engine, tiny model) on a verifiers taskset
    with the example's harness: 2 groups of 4 a step; the metrics rows."""
    cfg = load_config(
        None,
        [
            "generator.cls=trainer.generators.verifiers_env:VerifiersGenerator",
            f"generator.kwargs.taskset={json.dumps(taskset)}",
            f"generator.kwargs.harness={json.dumps(HARNESS)}",
            f"trainer.max_steps={steps}",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=4",
            "generator.sampling.max_tokens=6",
            f"trainer.run_dir={tmp_path}",
            "trainer.progress=false",
            *more,
        ],
    )
    return cfg


async def test_the_reasoning_gym_example_trains_through_the_reference_engine(tmp_path):
    await trainer.run.train(train(tmp_path, TASKSET, 2))
    rows = metrics_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["generate/failed_episodes"] == 0
        assert r["reward/mean"] == 0.0  # reasoning-gym's scorer: no <answer> from this model
        # the engine sampled with exactly the policy's weights, and the trace kept its tokens
        assert abs(r["policy/is_ratio_min"] - 1) < 1e-3 and abs(r["policy/is_ratio_max"] - 1) < 1e-3


async def test_a_verifiers_reward_with_spread_moves_the_policy_and_traces_stay_exact(tmp_path):
    taskset = {"id": "tests.trainer.generators.verifiers_digits", "size": 4}
    # an eval generator too (at step 3): a second verifiers generator of the run, its loop shared
    more = ("trainer.eval_interval=3", "data.num_eval_examples=4")
    await trainer.run.train(train(tmp_path, taskset, 3, *more))
    rows = metrics_rows(tmp_path)
    (evaluated,) = [r for r in rows if "eval/reward_mean" in r]
    assert evaluated["step"] == 3 and 0 < evaluated["eval/reward_mean"] < 1
    rows = [r for r in rows if "eval/reward_mean" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any(r["reward/std"] > 0 for r in rows)
    assert any(r["policy/grad_norm"] > 0 for r in rows)  # the policy moved, and was synced
    for r in rows:
        assert r["generate/failed_episodes"] == 0
        assert abs(r["policy/is_ratio_min"] - 1) < 1e-3 and abs(r["policy/is_ratio_max"] - 1) < 1e-3


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


async def renderers_generate(base_url: str, model_dir: Path) -> dict[str, Any]:
    """verifiers' model call as its training client makes it: renderers' ``generate`` (asyncio)."""
    import openai
    from renderers import create_renderer
    from renderers.base import load_tokenizer as renderers_tokenizer
    from renderers.client import generate

    renderer = create_renderer(renderers_tokenizer(str(model_dir)))
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        return await generate(
            client=client,
            renderer=renderer,
            messages=[{"role": "user", "content": "max 7 5 ="}],
            model=str(model_dir),
            sampling_params={"temperature": 1.0, "max_tokens": 4},
        )
    finally:
        await client.close()


async def test_renderers_rejects_the_engines_token_in_answer_and_reads_the_proxys() -> None:
    """The engines answer the token-in route as vLLM 0.32 does (logprob entries by
    ``token_id``); renderers 0.1.12 wants ``token: "token_id:N"``: straight to the engine it
    fails, through the capture proxy (its adapter) it reads the engine's tokens."""
    from renderers import MalformedGenerateResponseError

    from engines.bridge import open_bridge
    from trainer.generators.token_capture import open_capture_proxy

    model_dir = build_tiny_model()
    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    async with (
        serve_reference(model_dir) as url,
        InferenceClient([url]) as engine,
        open_capture_proxy(engine, sampling) as proxy,
        open_bridge() as bridge,
    ):
        with pytest.raises(MalformedGenerateResponseError, match="token_id:"):
            await bridge.run(renderers_generate, f"{url}/v1", model_dir)
        answer = await bridge.run(renderers_generate, proxy.register("t", 7), model_dir)
        (turn,) = proxy.turns("t")
    assert answer["completion_ids"] == turn.completion_ids and turn.completion_ids
    assert answer["completion_logprobs"] == turn.logprobs
    assert answer["prompt_ids"] == turn.prompt_ids
