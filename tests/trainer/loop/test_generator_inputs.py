"""What a generator gets: a data row's extra fields, chat prompts, its kwargs (stages, run)."""

from __future__ import annotations

import json
import types

import pytest

import trainer.run
from engines.models import build_tiny_model, load_tokenizer
from tests.trainer.helpers import Recording
from trainer.config import load_config
from trainer.data._examples import Example, load_jsonl, task_examples
from trainer.errors import ConfigError, DataError
from trainer.loop import WeightVersions
from trainer.loop._stages import generator_input, group_inputs, trajectory_seed

ROWS = [
    {"prompt": "max 7 5 =", "answer": "7", "weight": 0.5, "id": "a"},
    {"prompt": [{"role": "user", "content": "max 3 8 ="}], "answer": "8", "weight": 1.0, "id": "b"},
]


def _ctx(seed: int = 0):
    tokenizer = load_tokenizer(build_tiny_model())
    cfg = load_config(None, [f"trainer.seed={seed}"])
    return types.SimpleNamespace(cfg=cfg, tokenizer=tokenizer, versions=WeightVersions(current=3))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_step_inputs_are_one_group_per_prompt_with_the_seeds_of_before(tmp_path):
    ctx = _ctx(seed=5)
    prompts = task_examples("max_digit", 3, seed=0)
    batch = generator_input(ctx, prompts, step=7)  # type: ignore[arg-type]
    assert batch.items == tuple(
        item
        for g, ex in enumerate(prompts)
        for item in group_inputs(ctx, ex, g, 8, ids=f"7-{g}", first_seed=trajectory_seed(5, 7, g))  # type: ignore[arg-type]
    )
    assert (batch.global_step, batch.weight_version, len(batch)) == (7, 3, 24)
    # the seeds and ids every run had before the data path was split into groups
    for i, item in enumerate(batch):
        g, s = divmod(i, 8)
        assert item.seed == (5 * 1_000_003 + 7 * 10_007 + g * 101 + s) % (2**62)
        assert item.seed == trajectory_seed(5, 7, g) + s
        assert item.trajectory_id == f"7-{g}-{s}"
        assert item.prompt == prompts[g].prompt and item.messages is None and item.extra == {}
        assert item.prompt_ids == ctx.tokenizer.encode(prompts[g].prompt, add_special_tokens=False)


def test_a_rows_extra_fields_and_chat_messages_reach_every_trajectory_as_copies(tmp_path):
    ctx = _ctx()
    text_ex, chat_ex = load_jsonl(_write(tmp_path / "t.jsonl", ROWS))
    first, second = group_inputs(ctx, text_ex, 0, 2, ids="1-0", first_seed=0)  # type: ignore[arg-type]
    assert first.extra == {"weight": 0.5, "id": "a"}
    first.extra["id"] = "changed"  # a generator may scribble on its own copy
    assert second.extra["id"] == "a" and text_ex.extra["id"] == "a"
    (chat,) = group_inputs(ctx, chat_ex, 1, 1, ids="1-1", first_seed=0)  # type: ignore[arg-type]
    assert chat.messages == [{"role": "user", "content": "max 3 8 ="}]
    assert chat.prompt == "user : max 3 8 = <eos> assistant :"
    assert chat.prompt_ids == ctx.tokenizer.apply_chat_template(
        chat.messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert chat.extra == {"weight": 1.0, "id": "b"}


async def test_a_run_passes_kwargs_extra_fields_and_chat_prompts_through(tmp_path):
    Recording.seen.clear()
    Recording.options.clear()
    data = _write(tmp_path / "train.jsonl", ROWS)
    cfg = load_config(
        None,
        [
            "generator.cls=tests.trainer.helpers:Recording",
            "generator.kwargs.label=hello",
            "generator.kwargs.depth=2",
            f"data.train={data}",
            "data.reward_fn=tests.trainer.helpers:weighted",
            "trainer.max_steps=1",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=2",
            "engine.backend=inprocess",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.progress=false",
        ],
    )
    await trainer.run.train(cfg)
    assert Recording.options == [("hello", 2)]
    assert sorted(i.extra["id"] for i in Recording.seen) == ["a", "a", "b", "b"]
    chat = [i for i in Recording.seen if i.extra["id"] == "b"]
    assert all(i.messages == ROWS[1]["prompt"] for i in chat)
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["reward/mean"] == pytest.approx(0.75)  # (0.5 + 0.5 + 1.0 + 1.0) / 4
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "kwargs:\n    label: hello\n    depth: 2" in saved


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["generator.kwargs.temprature=0.5"],
            "config: generator.kwargs.temprature: trainer.generators.agent_loop:"
            "AgentLoopGenerator takes no keyword argument 'temprature'",
        ),
        (
            ["generator.kwargs.max_turns=2"],
            "config: generator.kwargs.max_turns is set by the trainer itself; use generator.max_turns",
        ),
        (
            ["data.reward_fn=tests.trainer.data.test_data:one_argument"],
            "one_argument(response) has the wrong signature",
        ),
    ],
)
async def test_a_run_with_a_bad_generator_or_reward_setting_fails_at_start_up(
    tmp_path, overrides, message
):
    cfg = load_config(None, [*overrides, f"trainer.run_dir={tmp_path}", "trainer.progress=false"])
    with pytest.raises(ConfigError) as info:
        await trainer.run.train(cfg)
    assert message in str(info.value)
    assert not (tmp_path / "metrics.jsonl").exists()


async def test_chat_prompts_with_a_tokenizer_without_a_template_fail_at_start_up(tmp_path):
    model = tmp_path / "model"
    build = build_tiny_model()
    model.mkdir()
    for f in build.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    assert load_tokenizer(model).chat_template is None
    data = _write(tmp_path / "train.jsonl", ROWS)
    cfg = load_config(
        None,
        [
            f"model.path={model}",
            f"data.train={data}",
            "trainer.train_batch_size=2",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.progress=false",
        ],
    )
    with pytest.raises(
        DataError,
        match=rf"^{data}:2: 'prompt' is a list of chat messages, but the tokenizer has no chat template",
    ):
        await trainer.run.train(cfg)


def test_examples_of_the_built_in_task_have_no_extra():
    assert all(ex.extra == {} and not ex.is_chat for ex in task_examples("max_digit", 5, 0))
    assert Example("p", "a").extra == {}
