"""``trainer.strategy=fully_async`` for real: ``python -m trainer`` runs, their ends and resumes.

- SkyRL #2524 scaled to this machine: 32 rollouts call a real HTTP environment service
  (1 s per step, the client's timeout 2 s) while a weight transfer takes 5 s. The transfer
  runs off the event loop, so no environment call times out; the same run with the transfer
  forced onto the trio thread (a test fixture) has timeouts. The pause before the transfer
  freezes each rollout at its next ``generate``, so only calls already in flight are caught
  by the transfer: a call lasts 1 s so that they still are after a slow pause (0.4 s seen on
  an idle machine; with 0.2 s calls that run had none left, and no timeout).
- A failing rollout, a hung one past the step's deadline, a hung one past its own bound
  (``generator.rollout_timeout_s``: cut off and rolled out again; every rollout hanging ends
  the run with ``RolloutTimeoutError``) and the end at ``max_steps``: each its own outcome,
  and no process of the run left.
- A weight transfer broken off mid-way, with rollouts in flight: finished and nothing lost
  (before its finish), or the run ends with ``EngineUnusableError`` (buckets missing); either
  way no rollout reached the engine while its weights were partial.
- A run killed with SIGKILL and resumed trains every prompt of the epoch exactly once.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import pytest

from tests.e2e.helpers import (
    REPO,
    last_stderr_line,
    new_marker,
    popen_trainer,
    processes_with_marker,
    read_metrics,
    run_trainer,
    wait_until_gone,
)

pytestmark = pytest.mark.slow

ASYNC = ("trainer.strategy=fully_async",)
STEP_LINE = re.compile(r"INFO trainer\.run: step (\d+) reward")


# ---------------------------------------------------------------- SkyRL #2524


@pytest.fixture(scope="module")
def env_service() -> Iterator[str]:
    """``examples.http_env``'s service in its own process: 1 s per step, 2 turns."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "examples.http_env",
            "--port",
            "0",
            "--delay-s",
            "1.0",
            "--turns",
            "2",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def _run_beside_a_slow_transfer(
    run_dir: Path, env_url: str, *, on_event_loop: bool, marker: str
) -> subprocess.CompletedProcess[str]:
    # the wrong way is a test fixture's (tests/e2e/transfer_on_event_loop.py), not a switch
    return run_trainer(
        *ASYNC,
        "generator.cls=examples.http_env:HttpEnvGenerator",
        f"generator.kwargs.env_url={env_url}",
        "generator.kwargs.env_timeout_s=2.0",
        "generator.max_turns=2",
        "generator.num_parallel_workers=8",
        "generator.n_samples_per_prompt=4",  # 8 groups x 4 = 32 rollouts in flight
        "trainer.train_batch_size=4",
        "trainer.max_steps=4",
        "faults=broadcast_to_inference_engines:sleep=5@2",  # the sync after step 2
        f"trainer.run_dir={run_dir}",
        marker=marker,
        module="tests.e2e.transfer_on_event_loop" if on_event_loop else "trainer",
    )


@attrs.frozen
class SlowTransferRun:
    """The run with its transfer off the event loop (the product's way), as it ended."""

    run_dir: Path
    proc: subprocess.CompletedProcess[str]
    marker: str
    #: The environment service's ``/stats`` before and after the run.
    stats_before: dict
    stats_after: dict


@pytest.fixture(scope="module")
def slow_transfer_run(env_service: str, tmp_path_factory) -> SlowTransferRun:
    """One run beside a slow transfer, shared: the SkyRL #2524 test reads its environment
    calls, and the end-of-run test its end at ``max_steps`` with rollouts in flight."""
    stats_url = env_service.removesuffix("/step") + "/stats"
    run_dir, marker = tmp_path_factory.mktemp("slow-transfer") / "thread", new_marker()
    before = httpx.get(stats_url).json()
    proc = _run_beside_a_slow_transfer(run_dir, env_service, on_event_loop=False, marker=marker)
    return SlowTransferRun(run_dir, proc, marker, before, httpx.get(stats_url).json())


def _timeouts(run_dir: Path) -> float:
    return max(r["env/timeouts_total"] for r in read_metrics(run_dir))


def test_rollouts_call_their_environment_on_time_while_a_slow_transfer_runs(
    tmp_path, env_service, slow_transfer_run
):
    run = slow_transfer_run
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    stats = run.stats_after
    assert stats["requests"] - run.stats_before["requests"] >= 4 * 4 * 2  # 4 steps, 2 turns
    assert stats["peak_in_flight"] >= 16, stats  # many rollouts in their environment at once
    # the transfer really took its 5 s, and not one environment call timed out meanwhile
    rows = read_metrics(run.run_dir)
    assert rows[1]["sync/last_weight_sync_seconds"] >= 5.0
    assert rows[1]["sync/max_stall_ms"] < 1000  # the loop kept turning during the sync
    assert _timeouts(run.run_dir) == 0

    # the same run with the transfer's 5 s blocking the event loop: calls in flight time out
    marker = new_marker()
    proc = _run_beside_a_slow_transfer(
        tmp_path / "loop", env_service, on_event_loop=True, marker=marker
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _timeouts(tmp_path / "loop") > 0
    assert max(r["loop/max_stall_ms"] for r in read_metrics(tmp_path / "loop")) >= 5000
    assert read_metrics(tmp_path / "loop")[1]["sync/max_stall_ms"] >= 5000  # inside the sync
    assert wait_until_gone(marker) == []


# ---------------------------------------------------------------- how a run ends


def test_a_failing_rollout_ends_the_run_with_its_own_error(tmp_path):
    marker = new_marker()
    proc = run_trainer(
        *ASYNC,
        "engine.backend=local",
        "trainer.max_steps=6",
        # a rollout's step is the first that may train on it, so which steps the rollouts
        # get depends on how generation and training interleave: a range always has one
        "faults=env_step:error=environment exploded@3-6",
        f"trainer.run_dir={tmp_path}",
        marker=marker,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert re.fullmatch(
        r"FaultInjected: fault injected in 'env_step' at step [3-6]: environment exploded",
        last_stderr_line(proc),
    ), last_stderr_line(proc)
    assert "ExceptionGroup" not in proc.stderr  # one error, however many rollouts hit it
    assert wait_until_gone(marker) == []


def test_a_hung_rollout_fails_the_step_waiting_for_it(tmp_path):
    marker = new_marker()
    proc = run_trainer(
        *ASYNC,
        "engine.backend=inprocess",
        "trainer.fully_async.max_staleness_steps=0",  # step 2's groups start after step 1
        "trainer.max_steps=4",
        "trainer.step_timeout_s=8",
        "faults=env_step:hang@2",
        f"trainer.run_dir={tmp_path}",
        marker=marker,
    )
    assert proc.returncode == 1
    line = last_stderr_line(proc)
    match = re.fullmatch(
        r"StepTimeoutError: step 2 exceeded its 8s budget after ([\d.]+)s "
        r"\(stage='wait_for_generation_buffer', operation='wait_for_batch'\)",
        line,
    )
    assert match, line
    assert 8.0 <= float(match[1]) < 30.0
    assert wait_until_gone(marker) == []


#: 16 prompts, one epoch, 2 per step: the run ends only once every prompt is trained, so it
#: waits for a hung group's prompt to be rolled out again. Admission (staleness 4) lets 10
#: groups start on the initial policy and 2 more after each sync, so step 3 fills from groups
#: of steps 1-2 while the 2 that started after step 2's sync hang (env_step:hang@3); cut off
#: after 3 s, their prompts are rolled out again for a later step, where the fault is over.
ONE_SHORT_EPOCH = (
    *ASYNC,
    "engine.backend=inprocess",
    "data.num_examples=16",
    "trainer.train_batch_size=2",
    "generator.n_samples_per_prompt=2",
    "trainer.epochs=1",
    "trainer.max_steps=null",
)


def test_a_hung_rollout_is_cut_off_at_its_bound_and_its_prompt_trained_later(tmp_path):
    proc = run_trainer(
        *ONE_SHORT_EPOCH,
        "trainer.step_timeout_s=60",
        "generator.rollout_timeout_s=3",
        "faults=env_step:hang@3",
        f"trainer.run_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # train.log holds each warning (the console counts repeated ones: trainer.metrics._repeats)
    cut_off = re.findall(
        r"the rollout of prompt \(epoch 0, position (\d+)\) for step 3 ran past its 3s "
        r"bound \(generator.rollout_timeout_s\) in stage='generate' operation='env_step': "
        r"cancelled, its prompt handed out again \(attempt 1 of 3\)",
        (tmp_path / "train.log").read_text(),
    )
    assert cut_off, proc.stderr[-3000:]
    assert "WARNING: the rollout of prompt (epoch 0, position" in proc.stderr
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert sum(r["async/rollouts_timed_out"] for r in rows) == len(cut_off)
    # nothing lost, nothing doubled: the cut-off prompts were trained, once
    trained = Counter(i for r in rows for i in r["data/example_index"])
    assert sorted(trained) == list(range(16)) and set(trained.values()) == {1}


def test_a_run_whose_every_rollout_hangs_ends_with_rollout_timeout_error(tmp_path):
    marker = new_marker()
    proc = run_trainer(
        *ASYNC,
        "engine.backend=inprocess",
        "trainer.max_steps=2",  # no step budget: only the rollouts' bound ends it
        "generator.rollout_timeout_s=1",
        "faults=env_step:hang",
        f"trainer.run_dir={tmp_path}",
        marker=marker,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = last_stderr_line(proc)
    assert re.fullmatch(
        r"RolloutTimeoutError: the rollout of prompt \(epoch 0, position \d+\) for step 1 ran "
        r"past its 1s bound 3 times in a row \(stage='generate', operation='(env_step|generate)'\); "
        r"if rollouts are slow but healthy, raise generator.rollout_timeout_s "
        r"\(unset, it is trainer.step_timeout_s\)",
        line,
    ), line
    assert "attempt 2 of 3" in proc.stderr  # each prompt was handed out again first
    assert not (tmp_path / "metrics.jsonl").exists() or read_metrics(tmp_path) == []
    assert wait_until_gone(marker) == []


def test_the_last_step_stops_the_rollouts_and_the_run_ends_cleanly(slow_transfer_run):
    """At ``max_steps`` (the slow-transfer run above: 4 steps, each rollout two 1 s calls to
    its environment, so some are always in flight) the rollouts are stopped, not awaited."""
    run = slow_transfer_run
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    rows = read_metrics(run.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert json.loads((run.run_dir / "summary.json").read_text())["last_step"] == 4
    # rollouts were still running when the last step ended: they were cancelled, not awaited
    stopped = re.search(
        r"stopping the rollouts: (\d+) groups in flight", (run.run_dir / "train.log").read_text()
    )
    assert stopped and int(stopped[1]) > 0
    assert wait_until_gone(run.marker) == []


# ---------------------------------------------------------------- a broken-off transfer

#: One short epoch against a reference server, which dies (vLLM's way) if a rollout reaches it
#: while its weights are partial: a run whose engine log does not say so shows none did.
BROKEN_EPOCH = (
    *ONE_SHORT_EPOCH,
    "engine.backend=local",
    "generator.num_parallel_workers=4",
)


def _break_the_transfer_at_step_3(tmp_path: Path, point: str) -> subprocess.CompletedProcess[str]:
    """The epoch, rollouts in flight across every sync, its transfer broken off at ``point``
    in step 3's sync; no process of the run left, and the engine never died."""
    marker = new_marker()
    proc = run_trainer(
        *BROKEN_EPOCH,
        f"faults=env_step:delay=0.2,{point}:error=boom@3",
        f"trainer.run_dir={tmp_path}",
        marker=marker,
    )
    assert wait_until_gone(marker) == []
    assert "the engine died" not in (tmp_path / "engines" / "engine-0.log").read_text()
    return proc


def test_a_transfer_broken_off_before_its_finish_is_finished_and_nothing_is_lost(tmp_path):
    proc = _break_the_transfer_at_step_3(tmp_path, "transfer_before_finish")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the transfer broke off (FaultInjected" in proc.stderr
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert sum(r["sync/resends"] for r in rows) == 1
    trained = Counter(i for r in rows for i in r["data/example_index"])
    assert sorted(trained) == list(range(16)) and set(trained.values()) == {1}


def test_a_transfer_broken_off_with_buckets_missing_ends_typed_and_the_engine_left_paused(
    tmp_path,
):
    proc = _break_the_transfer_at_step_3(tmp_path, "transfer_after_first_bucket")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert last_stderr_line(proc).startswith("EngineUnusableError"), proc.stderr[-2000:]


# ---------------------------------------------------------------- kill and resume


EPOCH = (
    *ASYNC,
    "engine.backend=inprocess",
    "data.num_examples=48",
    "trainer.train_batch_size=4",
    "generator.n_samples_per_prompt=2",
    "trainer.epochs=1",
    "trainer.max_steps=null",  # the epoch: 12 steps
    "trainer.ckpt_interval=2",
    "generator.num_parallel_workers=6",
    "faults=env_step:delay=0.3",  # rollouts that take a while: some are always in flight
)


def test_a_killed_and_resumed_run_trains_every_prompt_of_the_epoch_exactly_once(tmp_path):
    marker = new_marker()
    proc = popen_trainer(*EPOCH, f"trainer.run_dir={tmp_path}", marker=marker)
    log = tmp_path / "train.log"
    # kill it mid-run, once a few steps (two checkpoints) are done
    while (
        proc.poll() is None and len(STEP_LINE.findall(log.read_text() if log.exists() else "")) < 5
    ):
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()
    assert wait_until_gone(marker) == []
    state = json.loads(
        (tmp_path / "checkpoints" / "global_step_4" / "trainer_state.json").read_text()
    )
    assert state["loader"]["pending"], "the checkpoint should name prompts in flight"

    done = run_trainer(
        *EPOCH, f"trainer.run_dir={tmp_path}", "trainer.resume_mode=latest", marker=marker
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in (tmp_path / "train.log").read_text()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 13))
    trained = Counter(i for r in rows for i in r["data/example_index"])
    assert sorted(trained) == list(range(48)) and set(trained.values()) == {1}
    assert processes_with_marker(marker) == []
