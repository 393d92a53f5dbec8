"""A checkpoint save runs off the event loop: however long it takes, the loop keeps serving."""

from __future__ import annotations

import json

import trainer.run
from trainer.config import load_config

#: One step, one checkpoint, in this process.
RUN = [
    "engine.backend=inprocess",
    "trainer.train_batch_size=2",
    "generator.n_samples_per_prompt=2",
    "trainer.max_steps=1",
    "trainer.ckpt_interval=1",
    "trainer.progress=false",
]


async def test_a_slow_save_does_not_stall_the_event_loop(tmp_path):
    # the save's worker thread blocks 2 s (a slow disk looks like this); were the save on the
    # trio thread, the loop's longest stall during it would be at least as long
    await trainer.run.train(
        load_config(None, [*RUN, f"trainer.run_dir={tmp_path}", "faults=save_checkpoint:sleep=2"])
    )
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["timing/save_checkpoints"] >= 2.0
    assert row["checkpoint/max_stall_ms"] < 1000  # generous: it is ~1 ms on an idle machine
    assert row["checkpoint/max_stall_ms"] <= row["loop/max_stall_ms"]


async def test_a_checkpoints_policy_is_a_model_directory_transformers_takes_as_it_is(tmp_path):
    """The weights, their config and the tokenizer with its chat template: the trained model,
    loadable (and servable) without the run's model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines.models import resolve_model_path
    from trainer.checkpoint import CheckpointManager

    await trainer.run.train(load_config(None, [*RUN, f"trainer.run_dir={tmp_path}"]))
    ckpt = CheckpointManager(tmp_path / "checkpoints")
    step_dir = ckpt.resolve("latest")  # verified: the manifest covers the copied files
    assert step_dir is not None
    policy = step_dir / "policy"
    source = resolve_model_path(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (policy / name).read_bytes() == (source / name).read_bytes(), name
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    want = AutoTokenizer.from_pretrained(source).apply_chat_template(messages, tokenize=False)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    assert tokenizer.apply_chat_template(messages, tokenize=False) == want
    model = AutoModelForCausalLM.from_pretrained(policy)
    ids = tokenizer(want, return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == model.config.vocab_size
