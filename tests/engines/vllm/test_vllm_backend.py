"""The vLLM backends the trainer starts itself, on the CPU: ``engine.backend=vllm`` (real vLLM
servers) trains the default task as the reference engine does, ``vllm_inprocess`` (vLLM's
``AsyncLLM`` in the trainer, through the trio-asyncio bridge) trains with exact weights, and
neither leaves a process behind.

Each test's run (marker ``trainer_run``: ``python -m trainer`` in ``.venv-vllm`` with these
overrides) starts in the background when the tier starts, one after another in the tests'
order (conftest.py); the test waits for it and checks it.
"""

from __future__ import annotations

import json
import statistics

import pytest

from tests.e2e.helpers import wait_until_gone
from tests.engines.vllm.helpers import assert_exact_steps
from tests.engines.vllm.tier import TrainerRun

pytestmark = pytest.mark.vllm


def _train(run: TrainerRun, steps: int) -> tuple[list[dict], str]:
    """The run's metrics lines, exactly ``steps`` of them and each exact, and its stdout, once
    every process of the run has exited (a bounded wait: vLLM's worker can outlive its server
    by a moment)."""
    proc = run.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert wait_until_gone(run.marker) == []
    return assert_exact_steps(run.run_dir, steps), proc.stdout


@pytest.mark.trainer_run("engine.backend=vllm", "sync.transport=gloo")
def test_the_default_run_against_real_vllm_learns_with_exact_weights(trainer_run):
    """The README's command with ``engine.backend=vllm``: the whole default task (200 steps),
    every step sampled with exactly the policy's weights, the last 20% of rewards at least
    twice the first 20% (measured: 0.03 -> 0.6-0.7, as with the reference engine)."""
    rows, out = _train(trainer_run, 200)
    rewards = [r["reward/mean"] for r in rows]
    fifth = len(rewards) // 5
    first, last = statistics.fmean(rewards[:fifth]), statistics.fmean(rewards[-fifth:])
    assert len(rows) == 200 and last >= 2 * first and last > 0.3, (first, last, out[-500:])


@pytest.mark.parametrize("transport", ["gloo", "disk"])
@pytest.mark.trainer_run("engine.backend=vllm_inprocess", "sync.transport={transport}",
                         "trainer.max_steps=3",
                         "generator.sampling.temperature=0.7")  # fmt: skip
def test_engine_backend_vllm_inprocess_trains_3_steps_exactly(trainer_run, transport):
    """Exact at a temperature other than 1 too: vLLM reports the sampling distribution's
    logprobs (``--logprobs-mode processed_logprobs``), as the trainer computes its own."""
    _train(trainer_run, 3)


@pytest.mark.trainer_run("engine.backend=vllm", "sync.transport=gloo", "trainer.max_steps=4",
                         "faults=generate:kill_engine=0@2",
                         "generator.sampling.temperature=0.7")  # fmt: skip
def test_a_killed_vllm_server_is_restarted_and_synced_before_it_serves_again(trainer_run):
    """The only vLLM server is killed (SIGKILL, its whole process group) at step 2: step 2
    waits for the restarted server, which gets a complete gloo sync, verified, first; every
    step is exact and nothing of either server is left."""
    rows, _ = _train(trainer_run, 4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["engine/restarts"] == 0 and rows[-1]["engine/restarts"] == 1
    summary = json.loads((trainer_run.run_dir / "summary.json").read_text())
    (event,) = summary["engine_restart_events"]
    assert event["engine"] == 0 and event["step"] == 2 and event["seconds"] > 0


@pytest.mark.trainer_run("engine.backend=vllm", "model.lora.rank=8", "optim.lr=0.01",
                         "sync.lora=adapter", "sync.verify=every", "trainer.max_steps=3")  # fmt: skip
def test_a_lora_adapter_loaded_in_place_by_real_vllm_trains_3_exact_steps(trainer_run):
    """``sync.lora=adapter``: vLLM started with ``--enable-lora``, the adapter loaded in place
    through ``/v1/load_lora_adapter`` at every sync and served by name; every sync verified
    (vLLM's logprobs through the adapter are the policy's) and every step exact."""
    rows, _ = _train(trainer_run, 3)
    for row in rows:
        assert abs(row["policy/is_ratio_mean"] - 1) < 1e-4, row
        assert row["sync/verify_max_abs_diff"] < 1e-3, row
        assert 0 < row["sync/bytes"] < 200_000, row  # the adapter's files, not the model


@pytest.mark.trainer_run("engine.backend=vllm_inprocess", "sync.transport=gloo", "model.lora.rank=8",
                         "optim.lr=0.01", "sync.verify=every", "trainer.max_steps=3")  # fmt: skip
def test_vllm_inprocess_serves_a_lora_policys_merged_weights_exactly(trainer_run):
    """``sync.lora=merged`` into vLLM's ``AsyncLLM`` in the trainer's process, over gloo."""
    for row in _train(trainer_run, 3)[0]:
        assert abs(row["policy/is_ratio_mean"] - 1) < 1e-4, row
        assert row["sync/verify_max_abs_diff"] < 1e-3, row


@pytest.mark.trainer_run("engine.backend=vllm_inprocess", "model.lora.rank=8", "optim.lr=0.01",
                         "sync.lora=adapter", "sync.verify=every", "trainer.max_steps=3")  # fmt: skip
def test_vllm_inprocess_serves_a_lora_adapter_loaded_in_place_exactly(trainer_run):
    """``sync.lora=adapter`` into vLLM's ``AsyncLLM`` in the trainer's process: each sync is
    ``add_lora`` in place under the served name (engines/vllm/lora.py), every completion goes
    through it, every sync verified and every step exact."""
    for row in _train(trainer_run, 3)[0]:
        assert abs(row["policy/is_ratio_mean"] - 1) < 1e-4, row
        assert row["sync/verify_max_abs_diff"] < 1e-3, row
        assert 0 < row["sync/bytes"] < 200_000, row


@pytest.mark.trainer_run("engine.backend=vllm", "model.lora.rank=8", "sync.lora=adapter",
                         "trainer.max_steps=3",
                         "faults=broadcast_to_inference_engines:error=boom@2")  # fmt: skip
def test_a_failed_adapter_sync_into_real_vllm_ends_the_run_typed_and_leaves_nothing(trainer_run):
    """The adapter sync of step 2 fails where the transfer starts: the run ends with the
    injected error after one exact step, and no process of it (vLLM's included) is left."""
    proc = trainer_run.result()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "FaultInjected" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
    assert wait_until_gone(trainer_run.marker) == []
    assert_exact_steps(trainer_run.run_dir, 1)
