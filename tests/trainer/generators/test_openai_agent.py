"""OpenAIAgentGenerator: agents written against OpenAI's API, trained from the engine's tokens.

The agents are real ``openai.AsyncOpenAI`` (asyncio, through the bridge) and ``httpx`` (trio)
code against the real reference server (``serve_reference``: the production ``ServerApp``
over real HTTP, in this process), through the real token-capturing proxy.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
import trio

import trainer.run
from engines.client import InferenceClient
from engines.models import build_tiny_model, load_tokenizer
from engines.types import SamplingParams
from tests.engines.helpers import serve_reference
from tests.trainer.helpers import batch_of
from trainer.config import load_config
from trainer.errors import StepTimeoutError
from trainer.generators.openai_agent import AgentRuntime, OpenAIAgentGenerator
from trainer.generators.turns import CapturedTurn, assemble
from trainer.vocabulary import stage, step_deadline

QUESTION = [{"role": "user", "content": "max 7 5 ="}]


def test_turns_that_extend_each_other_make_one_sample_masked_by_who_wrote_what() -> None:
    first = CapturedTurn([1, 2], [3, 4], [-0.1, -0.2], "stop")
    second = CapturedTurn([1, 2, 3, 4, 9, 9], [5], [-0.5], "length")
    (sample,), splits = assemble([first, second])
    assert splits == 0
    assert sample.prompt_ids == [1, 2]
    assert sample.response_ids == [3, 4, 9, 9, 5]
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.5]
    assert sample.finish_reason == "length" and sample.num_turns == 2


def test_a_turn_that_does_not_extend_the_history_starts_a_new_sample() -> None:
    first = CapturedTurn([1, 2], [3, 4], [-0.1, -0.2], "stop")
    rewritten = CapturedTurn([1, 2, 9, 9], [5], [-0.5], "stop")  # the reply 3 4 dropped
    samples, splits = assemble([first, rewritten])
    assert splits == 1
    assert [(s.prompt_ids, s.response_ids, s.loss_mask) for s in samples] == [
        ([1, 2], [3, 4], [1, 1]),
        ([1, 2, 9, 9], [5], [1]),
    ]


class TwoTurnAgent(OpenAIAgentGenerator):
    """Two chat calls; keeps what the engine answered (token ids, logprobs) per trajectory."""

    seen: ClassVar[dict[str, list[dict[str, Any]]]] = {}

    async def agent(self, client: Any, item: Any) -> float:
        messages: list[Any] = list(QUESTION)
        answers = []
        for _ in range(2):
            reply = await client.chat.completions.create(
                model="anything",
                messages=messages,
                max_tokens=3,
                logprobs=True,
                # the untrained model samples <pad>/<unk>; kept in the text, they come back
                # in the next prompt, and the turns extend each other
                extra_body={"return_token_ids": True, "skip_special_tokens": False},
            )
            answers.append(reply.model_dump())
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "tool", "tool_call_id": "c", "content": "result no"},
            ]
        self.seen[item.trajectory_id] = answers
        return 0.5


class TrioTwoTurnAgent(TwoTurnAgent):
    agent_runtime: ClassVar[AgentRuntime] = "trio"

    async def agent(self, client: Any, item: Any) -> float:
        messages: list[Any] = list(QUESTION)
        answers = []
        for _ in range(2):
            response = await client.post(
                "chat/completions",
                json={"messages": messages, "max_tokens": 3, "skip_special_tokens": False},
            )
            reply = response.json()
            answers.append(reply)
            messages += [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "tool", "content": "result no"},
            ]
        self.seen[item.trajectory_id] = answers
        return 0.5


async def _generate(cls: type[OpenAIAgentGenerator], model_dir: Path, n: int = 3):
    tokenizer = load_tokenizer(model_dir)
    async with serve_reference(model_dir) as url, InferenceClient([url]) as engine:
        gen = cls(
            engine=engine,
            tokenizer=tokenizer,
            reward_fn=lambda r, a: 0.0,
            sampling=SamplingParams(temperature=1.0, max_tokens=3),
            max_response_tokens=64,
        )
        return await gen.generate(batch_of(tokenizer, n))


async def test_each_trajectory_holds_exactly_the_tokens_the_engine_returned() -> None:
    model_dir = build_tiny_model()
    out = await _generate(TwoTurnAgent, model_dir)
    assert out.metrics["generate/trajectory_splits"] == 0
    assert len(out.trajectories) == 3
    for i, t in enumerate(out.trajectories):
        first, second = TwoTurnAgent.seen[f"1-0-{i}"]
        c1, c2 = first["choices"][0], second["choices"][0]
        assert t.prompt_ids == first["prompt_token_ids"]
        inserted = second["prompt_token_ids"][
            len(first["prompt_token_ids"]) + len(c1["token_ids"]) :
        ]
        assert t.response_ids == c1["token_ids"] + inserted + c2["token_ids"]
        assert t.loss_mask == [1] * len(c1["token_ids"]) + [0] * len(inserted) + [1] * len(
            c2["token_ids"]
        )
        engine_logprobs = [e["logprob"] for c in (c1, c2) for e in c["logprobs"]["content"]]
        assert [lp for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m] == engine_logprobs
        assert t.reward == 0.5 and t.num_turns == 2


async def test_a_trio_agent_gets_answers_as_it_asked_for_them() -> None:
    out = await _generate(TrioTwoTurnAgent, build_tiny_model(), n=2)
    for i, t in enumerate(out.trajectories):
        answers = TrioTwoTurnAgent.seen[f"1-0-{i}"]
        # what the proxy added for itself (token ids, logprobs) is not in the agent's answer
        assert all(a["choices"][0]["token_ids"] is None for a in answers)
        assert all(a["choices"][0]["logprobs"] is None for a in answers)
        assert all(a["prompt_token_ids"] is None for a in answers)
        assert t.num_turns == 2 and sum(t.loss_mask) > 0


#: A template that rewrites history: earlier assistant replies are dropped from the prompt
#: (as templates that strip past reasoning do), so turn 2's prompt does not extend turn 1's.
REWRITING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'assistant' or loop.last -%}"
    "{{ message['role'] }} : {{ message['content'] }} {{ eos_token }} "
    "{%- endif -%}"
    "{% endfor -%}"
    "{%- if add_generation_prompt -%} assistant :{%- endif -%}"
)


async def test_a_history_rewriting_template_splits_the_trajectory_instead_of_mis_masking(
    tmp_path: Path,
) -> None:
    model_dir = tmp_path / "rewriting-model"
    shutil.copytree(build_tiny_model(), model_dir)
    config = model_dir / "tokenizer_config.json"
    cfg = json.loads(config.read_text())
    cfg["chat_template"] = REWRITING_TEMPLATE
    config.write_text(json.dumps(cfg))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    out = await _generate(TwoTurnAgent, model_dir)
    assert out.metrics["generate/trajectory_splits"] == 3
    assert len(out.trajectories) == 6  # two samples per trajectory, in order
    for i in range(3):
        first, second = TwoTurnAgent.seen[f"1-0-{i}"]
        a, b = out.trajectories[2 * i], out.trajectories[2 * i + 1]
        assert (a.prompt_ids, a.response_ids) == (
            first["prompt_token_ids"],
            first["choices"][0]["token_ids"],
        )
        assert (b.prompt_ids, b.response_ids) == (
            second["prompt_token_ids"],
            second["choices"][0]["token_ids"],
        )
        assert all(m == 1 for m in a.loss_mask + b.loss_mask)
        assert a.group_id == b.group_id and a.reward == b.reward == 0.5


class HungToolAgent(OpenAIAgentGenerator):
    """One model call, then a tool that never answers (asyncio)."""

    unwound: ClassVar[list[str]] = []

    async def agent(self, client: Any, item: Any) -> float:
        await client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=2)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.unwound.append(item.trajectory_id)
            raise
        return 1.0


async def test_an_asyncio_agent_cut_off_by_the_step_deadline_raises_step_timeout_and_unwinds() -> (
    None
):
    HungToolAgent.unwound.clear()
    model_dir = build_tiny_model()
    tokenizer = load_tokenizer(model_dir)
    async with serve_reference(model_dir) as url, InferenceClient([url]) as engine:
        gen = HungToolAgent(
            engine=engine,
            tokenizer=tokenizer,
            reward_fn=lambda r, a: 0.0,
            sampling=SamplingParams(max_tokens=2),
        )
        with pytest.raises(StepTimeoutError) as info:
            with step_deadline(4, 5.0), stage("generate"):
                await gen.generate(batch_of(tokenizer, 3))
        # the engine is free again: nothing of the step is left running against it
        with trio.fail_after(60):
            assert (await engine.generate([5, 6], SamplingParams(max_tokens=2))).token_ids
    assert (info.value.stage, info.value.operation, info.value.step) == ("generate", "env_step", 4)
    assert sorted(HungToolAgent.unwound) == ["1-0-0", "1-0-1", "1-0-2"]  # each saw CancelledError
    assert _tasks_left() == []


async def test_the_example_agent_trains_end_to_end_and_a_deadline_ends_the_run(
    tmp_path: Path,
) -> None:
    before = set(_children())  # e.g. a Ray cluster other tests of this session started
    base = [
        "generator.cls=examples.openai_agent:CalculatorAgent",
        "trainer.train_batch_size=2",
        "generator.n_samples_per_prompt=2",
        "trainer.progress=false",
    ]
    await trainer.run.train(
        load_config(None, [*base, "trainer.max_steps=2", f"trainer.run_dir={tmp_path / 'ok'}"])
    )
    rows = [
        json.loads(line) for line in (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert all(r["generate/num_turns_mean"] == 2.0 for r in rows if "reward/mean" in r)

    hung = [
        "generator.cls=tests.trainer.generators.test_openai_agent:HungToolAgent",
        "trainer.step_timeout_s=10",
        f"trainer.run_dir={tmp_path / 'hung'}",
    ]
    with pytest.raises(StepTimeoutError) as info:
        await trainer.run.train(load_config(None, [*base, "trainer.max_steps=1", *hung]))
    assert (info.value.stage, info.value.operation) == ("generate", "env_step")
    assert _tasks_left() == []
    assert set(_children()) <= before  # the runs' engine servers are gone too


def _tasks_left() -> list[str]:
    """The names of the trio tasks still running below this test's own task (pytest-trio runs
    the test inside a nursery of that task, so the nursery itself is always there)."""
    left, nurseries = [], list(trio.lowlevel.current_task().child_nurseries)
    while nurseries:
        for task in nurseries.pop().child_tasks:
            left.append(task.name)
            nurseries += task.child_nurseries
    return left


def _children() -> list[int]:
    """Live child processes of this process (from /proc)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                found.append(int(entry.name))
    return found
