"""Against real vLLM on the CPU: what the trainer reads of its answers, its pause routes, and
the ``gloo`` weight-transfer plugin making it serve exactly the policy's weights."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import pytest
import trio

from engines.client import DATA_CONNECTIONS_PER_SERVER, InferenceClient
from engines.types import SamplingParams
from sync.transports.broadcast import BroadcastTransport
from tests.engines.vllm.helpers import (
    REMOTE_ENV,
    assert_exact_steps,
    assert_remote_run_is_exact,
    assert_syncs_make_the_engine_score_as_the_policy,
    remote_command,
    run_remote,
)
from tests.engines.vllm.servers import PROJECT, RealServer
from trainer.errors import InferenceServerError

pytestmark = pytest.mark.vllm

PROMPT = [5, 6, 7, 8, 9]


async def test_a_completion_carries_token_ids_logprobs_and_a_finish_reason(vllm_server):
    async with InferenceClient([vllm_server.url]) as client:
        assert await client.max_model_len() == 256  # the server's --max-model-len
        sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        first = await client.generate(PROMPT, sampling)
        again = await client.generate(PROMPT, sampling)
    assert 1 <= len(first.token_ids) <= 6
    assert len(first.logprobs) == len(first.token_ids)
    assert all(lp <= 0.0 for lp in first.logprobs)
    assert first.finish_reason in ("length", "stop")
    assert first.finish_reason == "stop" or len(first.token_ids) == 6
    assert (again.token_ids, again.logprobs) == (first.token_ids, first.logprobs)  # seeded


async def test_n_samples_are_the_seeds_seed_plus_i(vllm_server):
    async with InferenceClient([vllm_server.url]) as client:
        sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
        many = await client.generate_n(PROMPT, sampling, 3)
        assert len(many) == 3
        assert all(len(c.logprobs) == len(c.token_ids) for c in many)


async def test_seeded_prompts_past_one_steps_token_budget_sample_as_they_do_alone(vllm_server):
    """40 seeded prompts of 200 tokens, 32 of them (the client's connections) waiting at once,
    exceed vLLM's CPU step budget (2048 tokens), so one is prefilled in two steps and its first
    sample is discarded and rewound: vLLM 0.32's CPU build died there ("CPU Generator does not
    use offset"); the plugin's rewind restores the generator's state, so each answer is the one
    it gets alone."""
    prompts = [[5 + (i * 7 + j) % 45 for j in range(200)] for i in range(40)]
    async with InferenceClient([vllm_server.url]) as client:

        def sampling(i: int) -> SamplingParams:
            return SamplingParams(max_tokens=6, temperature=1.0, seed=100 + i)

        alone = [(await client.generate(p, sampling(i))).token_ids for i, p in enumerate(prompts)]
        async with httpx.AsyncClient() as http:  # else the prompts are cached, never prefilled
            (await http.post(f"{vllm_server.url}/reset_prefix_cache")).raise_for_status()
        together: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            together[i] = (await client.generate(prompts[i], sampling(i))).token_ids

        await client.pause("keep")  # the burst waits at once: the first step is full
        # as many as the client's data connections carry at once (32: 6400 prompt tokens)
        waiting = _requests_added(vllm_server) + min(len(prompts), DATA_CONNECTIONS_PER_SERVER)
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
            try:
                # vLLM counts nothing while paused (its gauges update on scheduler steps); its
                # log says each request handed to the engine core, where the resume queues
                # behind them
                with trio.fail_after(120):
                    while _requests_added(vllm_server) < waiting:  # noqa: ASYNC110
                        await trio.sleep(0.1)
            finally:
                await client.resume()
    assert [together[i] for i in range(len(prompts))] == alone
    log = vllm_server.log.read_text()
    assert "does not use offset" not in log


def _requests_added(server: RealServer) -> int:
    """Requests the server handed to its engine core so far (``--enable-log-requests``)."""
    return server.log.read_text().count("Added request ")


async def test_pause_keep_and_abort_then_resume(vllm_server):
    async with InferenceClient([vllm_server.url]) as client:
        for mode in ("keep", "abort"):
            await client.pause(mode)
            assert await client.is_paused() == [True]
            await client.resume()
            assert await client.is_paused() == [False]
        completion = await client.generate(PROMPT, SamplingParams(max_tokens=2, seed=0))
        assert len(completion.token_ids) >= 1


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
async def test_a_gloo_sync_makes_the_engine_score_as_the_policy(vllm_server, packed):
    """The plugin's engine takes the trainer's unchanged sender. Packed: one
    ``/update_weights`` in several chunks; unpacked: one per bucket, a broadcast per tensor
    (64 KiB: several of either; each test builds its own group, a second init replaces the
    first)."""
    transport = BroadcastTransport(64 * 1024, group_init_timeout_s=120, packed=packed)
    await assert_syncs_make_the_engine_score_as_the_policy(vllm_server, transport)


def test_engine_backend_remote_trains_3_steps_with_exact_weights(vllm_server, tmp_path):
    """The trainer against a vLLM server someone else started (the tier's)."""
    assert_remote_run_is_exact(vllm_server, tmp_path)


def test_a_lora_policys_merged_weights_train_3_exact_steps(vllm_server, tmp_path):
    """A LoRA adapter (``model.lora``) synced as merged weights into real vLLM over gloo, by
    the base model's names: every sync verified, and the engine samples with exactly the
    policy's weights (``policy/is_ratio`` within 1e-4 of 1)."""
    lora = ["model.lora.rank=8", "optim.lr=0.01", "sync.verify=every"]
    proc = run_remote(vllm_server, tmp_path / "run", 3, *lora)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in assert_exact_steps(tmp_path / "run", 3):
        assert abs(row["policy/is_ratio_mean"] - 1) < 1e-4, row
        assert row["sync/verify_max_abs_diff"] < 1e-3, row
        assert row["policy/grad_norm"] > 0, row


#: A weight transfer into real vLLM broken off at each point (the sync after step 2), and how
#: the run ends: (fault, exit code, the typed error on stderr or None, steps recorded). In
#: this order: each run starts with a complete sync into the same server, so its first step,
#: exact, shows that what the cell before left behind was made whole by one complete sync.
#: These tests, and those that mend what they leave, take the tier's gloo server as the test
#: before left it (``vllm_server_as_left``); a test after them that needs it in a good state
#: gets a fresh one if they left it paused (``-k`` without the mends).
BROKEN_TRANSFERS = {
    "before-start-error": ("broadcast_to_inference_engines:error=boom@2", 1, "FaultInjected", 1),
    "before-start-hang": ("broadcast_to_inference_engines:hang@2", 1, "WeightSyncTimeoutError", 1),
    "before-finish-error": ("transfer_before_finish:error=boom@2", 0, None, 3),
    "after-first-bucket-error": ("transfer_after_first_bucket:error=boom@2", 1, "EngineUnusableError", 1),
    # a LoRA policy's merged weights, broken off the same way: the same typed end
    "lora-after-first-bucket-error": ("transfer_after_first_bucket:error=boom@2", 1, "EngineUnusableError", 1, "model.lora.rank=8"),
}  # fmt: skip
#: Hung past the sync's deadline and grace after the start: abandoned, vLLM left paused with
#: its update open, which makes it refuse the next run's start ("a weight update is already
#: active"): that run's first sync closes the open update and sends the whole transfer again
#: (so each cell's step 1 is exact). Run last.
HUNG_MID_TRANSFER = {
    "after-first-bucket-hang": ("transfer_after_first_bucket:hang@2", 1, "WeightSyncTimeoutError", 1),
    "before-finish-hang": ("transfer_before_finish:hang@2", 1, "WeightSyncTimeoutError", 1),
}  # fmt: skip


def _broken_run(server, tmp_path, cell: tuple) -> None:
    """``cell``: (fault, exit code, typed error or None, steps recorded, *more overrides)."""
    fault, code, error, steps, *more = cell
    run_dir = tmp_path / "run"
    overrides = [f"faults={fault}", "trainer.weight_sync_timeout_s=10", "sync.transfer_grace_s=3"]
    overrides += more
    proc = run_remote(server, run_dir, 3, *overrides)
    assert proc.returncode == code, proc.stderr[-3000:]
    if error is not None:
        assert error in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
    rows = assert_exact_steps(run_dir, steps)
    if code == 0:  # the broken-off transfer at step 2 was completed
        assert rows[1]["sync/resends"] == 1
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("cell", list(BROKEN_TRANSFERS))
def test_a_broken_transfer_into_real_vllm_ends_typed_or_is_completed(
    vllm_server_as_left, tmp_path, cell
):
    """Broken off before its finish, the transfer is finished and the run goes on; with
    buckets missing, the run ends typed and vLLM stays paused (its open update closed, so
    the next run's complete sync is accepted)."""
    _broken_run(vllm_server_as_left, tmp_path, BROKEN_TRANSFERS[cell])


def test_after_the_broken_transfers_one_complete_sync_serves_one_version(
    vllm_server_as_left, tmp_path
):
    assert_remote_run_is_exact(vllm_server_as_left, tmp_path)


@pytest.mark.parametrize("cell", list(HUNG_MID_TRANSFER))
def test_a_transfer_hung_mid_update_ends_with_the_deadlines_error(
    vllm_server_as_left, tmp_path, cell
):
    _broken_run(vllm_server_as_left, tmp_path, HUNG_MID_TRANSFER[cell])


def test_after_the_hung_transfers_the_next_run_mends_the_engine(vllm_server_as_left, tmp_path):
    """The update the last hang left open is closed, the weights sent whole: 3 exact steps."""
    assert_remote_run_is_exact(vllm_server_as_left, tmp_path)


def test_a_trainer_killed_mid_transfer_and_resumed_mends_the_engine(vllm_server_as_left, tmp_path):
    """SIGKILL of the trainer while its transfer hangs after a first bucket (vLLM paused, its
    update open, half its layers reloaded); the run resumed from its step-1 checkpoint: its
    first sync is refused its start, closes the open update and sends the whole transfer
    again, and steps 2 and 3 are exact."""
    run_dir = tmp_path / "run"
    fired = run_dir / "faults_fired.log"
    cmd = remote_command(
        vllm_server_as_left,
        run_dir,
        3,
        "faults=transfer_after_first_bucket:hang@2",
        "trainer.ckpt_interval=1",
    )
    with open(tmp_path / "killed.log", "wb") as out:
        proc = subprocess.Popen(cmd, env=REMOTE_ENV, cwd=PROJECT, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 300
        while not (fired.exists() and fired.read_text().strip()):
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the transfer's fault never fired"
            time.sleep(0.2)
        # the fault fired: the hang holds, and vLLM has the start and a first bucket
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    resumed = run_remote(vllm_server_as_left, run_dir, 3, "trainer.resume_mode=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "already active" in resumed.stderr  # the killed run's open update, closed
    assert [r["step"] for r in assert_exact_steps(run_dir, 3)] == [1, 2, 3]


async def test_the_client_survives_vllms_connection_reset_after_a_500(vllm_server):
    """vLLM answers a failed weight route 500 and resets that keep-alive connection; the next
    control call on the same client still gets through."""
    async with InferenceClient([vllm_server.url]) as client:
        bogus = {"update_info": {"names": ["nope"], "dtype_names": ["float32"], "shapes": [[1]]}}
        with pytest.raises(InferenceServerError) as info:
            await client.control("POST", "/update_weights", json=bogus)  # no update open
        assert info.value.status == 500
        for _ in range(3):
            assert await client.is_paused() == [False]


async def test_prompt_logprobs_answer_in_the_reference_engines_shape_and_values(vllm_lora_server):
    """vLLM's ``prompt_logprobs`` (what the distillation teacher scores with) against the
    reference engine's of the same model: the same JSON shape, key for key, and the same
    values (float32 on both, 1e-4), through the client the teacher uses. On the LoRA server,
    whose base weights no test changes (adapters load beside them by name): the tier's gloo
    server serves whatever the sync tests before this one left in it."""
    vllm_server = vllm_lora_server
    from engines.local.engine import open_local_engine

    ids = [5, 17, 3, 22, 9, 40, 41]
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 2}
    async with httpx.AsyncClient(timeout=120, headers=vllm_server.headers) as http:
        raw = (await http.post(f"{vllm_server.url}/v1/completions", json=body)).json()
    positions = raw["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(ids)
    for tok, position in zip(ids[1:], positions[1:]):
        assert next(iter(position)) == str(tok)  # the prompt token first, then the best
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in position.values())
    async with InferenceClient([vllm_server.url], api_key=vllm_server.api_key) as client:
        vllm = await client.prompt_logprobs(ids, k=2)
    async with open_local_engine(vllm_server.model_dir, dtype="float32") as engine:
        done = await engine.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=2))
    reference = done.prompt_logprobs
    assert vllm[0] is None and reference[0] is None
    for got, want in zip(vllm[1:], reference[1:]):
        assert got is not None and want is not None
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert got.rank == want.rank
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
