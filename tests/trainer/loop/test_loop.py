"""The loop owns the run: first sync, steps, eval as its own bounded stage, last checkpoint."""

from __future__ import annotations

import json
import os
import re
import types

import pytest
import trio

import trainer.run
from engines.client import InferenceClient
from engines.launch import launch_local_engines
from engines.models import build_tiny_model, load_tokenizer
from engines.types import SamplingParams
from trainer.config import load_config
from trainer.data._examples import task_examples
from trainer.debug._server import debug_paths
from trainer.errors import ConfigError, StepTimeoutError
from trainer.generators import Generator, GeneratorInput, GeneratorOutput
from trainer.loop import WeightVersions
from trainer.loop._steps import run_eval

CUSTOM = "tests.trainer.helpers:OneCallGenerator"


class GreedyHangs(Generator):
    """Samples normally, but a greedy (eval) rollout never returns."""

    async def generate(self, batch: GeneratorInput) -> GeneratorOutput:
        assert self.sampling.temperature == 0.0
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_eval_is_its_own_stage_under_its_own_step_budget(autojump_clock):
    cfg = load_config(
        None,
        ["trainer.step_timeout_s=30", "workers.collective_timeout_s=30", "trainer.eval_interval=1"],
    )
    tokenizer = load_tokenizer(build_tiny_model())
    ctx = types.SimpleNamespace(
        cfg=cfg,
        tokenizer=tokenizer,
        eval_generator=GreedyHangs(
            engine=None,  # type: ignore[arg-type]  (never reached)
            tokenizer=tokenizer,
            reward_fn=lambda response, answer: 0.0,
            sampling=SamplingParams(temperature=0.0),
        ),
        eval_examples=task_examples("max_digit", 3, 0),
        versions=WeightVersions(current=4),
    )
    t0 = trio.current_time()
    with pytest.raises(StepTimeoutError) as info:
        await run_eval(ctx, 7)  # type: ignore[arg-type]
    err = info.value
    assert (err.step, err.budget_s, err.stage, err.operation) == (7, 30, "eval", "await")
    assert trio.current_time() - t0 == pytest.approx(30)


async def test_a_run_syncs_first_checkpoints_its_last_step_and_evaluates_after_a_step(tmp_path):
    cfg = load_config(
        None,
        [
            "engine.backend=inprocess",
            f"generator.cls={CUSTOM}",
            "trainer.max_steps=3",
            "trainer.ckpt_interval=2",
            "trainer.eval_interval=3",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=2",
            "generator.sampling.max_tokens=2",
            "data.eval=tests/trainer/eval_prompts.jsonl",
            f"trainer.run_dir={tmp_path}",
            "trainer.progress=false",
            # a custom generator without an environment never reaches env_step
            "faults=env_step:error=never@1",
        ],
    )
    await trainer.run.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # the first sync happened before step 1: step 1's own sync is the second
    assert [r["sync/weight_version"] for r in steps] == [2, 3, 4]
    # every ckpt_interval steps and the last step, each inside its step
    assert [r.get("checkpoint/step") for r in steps] == [None, 2, 3]
    assert all("timing/save_checkpoints" in r for r in steps[1:])
    state = json.loads((tmp_path / "checkpoints/global_step_3/trainer_state.json").read_text())
    assert state["step"] == 3 and "global_step" not in state
    (evaluation,) = [r for r in rows if "eval/reward_mean" in r]
    assert evaluation["step"] == 3 and evaluation["eval/num_prompts"] == 2.0
    assert evaluation["timing/eval"] > 0
    assert "fault 'env_step:error=never@1' never fired" in (tmp_path / "train.log").read_text()


async def test_the_addition_task_evaluates_before_training_greedy_and_sampled(tmp_path, capsys):
    cfg = load_config(
        None,
        [
            "engine.backend=inprocess",
            "data.task=addition",
            "data.num_eval_examples=3",
            "trainer.max_steps=2",
            "trainer.eval_interval=2",
            "trainer.eval_before_train=true",
            "trainer.eval_n_samples_per_prompt=2",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=2",
            "generator.sampling.max_tokens=2",
            f"trainer.run_dir={tmp_path}",
            "trainer.progress=true",  # stderr is not a terminal here: plain lines
        ],
    )
    summary = await trainer.run.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # each eval is on the console (a line when it starts, one with its result) and the first
    # and last in the summary
    err = capsys.readouterr().err
    assert "eval at step 0 ...\n" in err and "eval at step 2 ...\n" in err
    result = r"greedy reward \d\.\d{3}, sampled \d\.\d{3} \(3 prompts\) in \d+\.\ds"
    assert re.search(rf"eval at step 2: {result}\n", err), err
    assert (summary["eval/first_step"], summary["eval/last_step"]) == (0.0, 2.0)
    # a run that ended normally leaves no stacks file in $TMPDIR (one per run piled up)
    assert not debug_paths(os.getpid())[1].exists()
    assert summary["eval/last_sampled_reward_mean"] == rows[-1]["eval/sampled_reward_mean"]
    # the eval before step 1 is logged as step 0, ahead of every step's row
    assert [(r["step"], "eval/reward_mean" in r) for r in rows] == [
        (0, True),
        (1, False),
        (2, False),
        (2, True),
    ]
    for evaluation in (rows[0], rows[-1]):
        assert evaluation["eval/num_prompts"] == 3.0
        assert 0.0 <= evaluation["eval/sampled_reward_mean"] <= 1.0
        # the built-in task pays 0 or 1: its accuracy is its mean reward
        assert evaluation["eval/accuracy"] == evaluation["eval/reward_mean"]
        assert evaluation["eval/sampled_accuracy"] == evaluation["eval/sampled_reward_mean"]
    assert rows[1]["reward/accuracy"] == rows[1]["reward/mean"]
    assert "eval/sampled_reward_mean" not in rows[1]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "nosuch.mod:G",
            "generator.cls='nosuch.mod:G' cannot be imported: No module named 'nosuch'",
        ),
        ("trainer.data:Example", "is not a subclass of trainer.generators.Generator"),
        (
            "trainer.generators.agent_loop:AgentLoopGenerator",  # with a misspelled kwarg
            "generator.kwargs.penality",
        ),
    ],
)
async def test_a_bad_generator_stops_the_run_before_any_model_loads(tmp_path, spec, message):
    # a model path that does not exist: had the model been loaded first, that would be the error
    cfg = load_config(
        None,
        [
            f"generator.cls={spec}",
            "generator.kwargs.penality=1.0",
            f"model.path={tmp_path / 'no-model'}",
            f"trainer.run_dir={tmp_path}",
        ],
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        await trainer.run.train(cfg)
    assert not (tmp_path / "engines").exists()  # no server was started


async def test_a_run_against_remote_servers_with_the_kl_loss_shows_its_progress(
    tmp_path, capsys, monkeypatch
):
    """engine.backend=remote (servers someone else runs, their key in the environment), a
    reference model, the progress lines."""
    async with launch_local_engines(
        1, build_tiny_model(), tmp_path / "servers", weight_dir=tmp_path / "run" / "weight_sync"
    ) as urls:
        monkeypatch.setenv("TRAINER_ENGINE_API_KEY", urls.api_key)
        cfg = load_config(
            None,
            [
                "engine.backend=remote",
                f"engine.urls=[{urls[0]}]",
                "algorithm.use_kl_loss=true",
                "trainer.max_steps=2",
                "trainer.train_batch_size=2",
                "generator.n_samples_per_prompt=2",
                f"trainer.run_dir={tmp_path / 'run'}",
                "trainer.progress=true",
            ],
        )
        await trainer.run.train(cfg)
        # the trainer stopped nothing it did not start: the server still answers
        async with InferenceClient(urls, api_key=urls.api_key) as client:
            await client.probe()
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("policy/kl" in r and r["policy/kl"] >= 0 for r in rows)
    assert not (tmp_path / "run/engines").exists()  # no server of its own
    assert not (tmp_path / "run/weight_sync").exists()  # the disk transport's, removed empty
    err = capsys.readouterr().err  # not a terminal: plain lines
    assert "engine-0: pid" not in err  # a remote server's process is not the trainer's
    for phase in ("model", "engines", "workers", "weight transport", "first weight sync"):
        assert f"startup: {phase} ...\n" in err and f"startup: {phase} ready in " in err, phase
    assert err.index("startup: engines ready") < err.index("startup: first weight sync ...")
    step_lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["1/2", "2/2"]
    for line in step_lines:
        assert re.search(r"reward \S+ loss -?\d\.\d{4} kl \d\.\d{4} \S+s/step ETA ", line)
    assert step_lines[0].endswith("ETA -")  # the first step warms up: no ETA from it
    assert step_lines[-1].endswith("ETA 0:00")
    assert "startup: engines ready in " in (tmp_path / "run/train.log").read_text()
