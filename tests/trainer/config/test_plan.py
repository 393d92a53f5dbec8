"""The run plan: every decision the run acts on, made once from the config (and what this
machine has), read by the parts; and how it shares a CPU-only machine's cores with the
reference servers the trainer starts."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from engines.launch import ReferenceServers
from sync.bracket import Bracket
from trainer.algorithms import RolloutCorrection
from trainer.config import (
    CpuThreads,
    EngineBackend,
    RoleDevice,
    Strategy,
    WorkerBackend,
    cpu_threads,
    load_config,
    plan_run,
    validate_cfg,
)
from trainer.errors import ConfigError

RAY_2 = ["workers.backend=ray", "workers.num_policy_workers=2"]


def test_the_default_plan() -> None:
    plan = load_config(None, []).plan
    assert (plan.strategy, plan.engine_backend, plan.worker_backend, plan.bracket) == (
        Strategy.SYNC,
        EngineBackend.LOCAL,
        WorkerBackend.LOCAL,
        Bracket.PAUSE,
    )
    assert plan.transport.name == "disk" and not plan.transport.group
    assert not plan.sharded and not plan.uses_ray and plan.vllm is None
    assert plan.one_update_per_batch and plan.correction == RolloutCorrection()


@pytest.mark.parametrize(
    ("overrides", "cuda", "sharded"),
    [
        (RAY_2, True, True),  # auto: FSDP2 on CUDA
        (RAY_2, False, False),  # auto: replicated on the CPU
        ([*RAY_2, "workers.data_parallel=replicate"], True, False),
        ([*RAY_2, "workers.data_parallel=fsdp2"], False, True),
        (["workers.backend=ray", "workers.data_parallel=fsdp2"], True, False),  # one rank
    ],
)
def test_whether_the_policy_is_sharded_is_decided_once(overrides, cuda, sharded) -> None:
    cfg = load_config(None, overrides)
    assert plan_run(cfg, cuda=cuda).sharded is sharded


def test_a_sharded_policy_on_cuda_with_checkpoints_is_refused_at_load() -> None:
    """``workers.data_parallel=auto`` shards on CUDA; validation asked only for ``fsdp2``, so
    such a run passed validation and failed at its first checkpoint."""
    cfg = load_config(None, RAY_2)
    cfg = attrs.evolve(cfg, trainer=attrs.evolve(cfg.trainer, ckpt_interval=2))
    cfg.plan = plan_run(cfg, cuda=True)  # as a machine with CUDA plans it
    with pytest.raises(ConfigError, match=r"data_parallel='auto', which shards on CUDA,"):
        validate_cfg(cfg)
    cfg.plan = plan_run(cfg, cuda=False)
    validate_cfg(cfg)  # replicated on the CPU: checkpoints work


def test_ray_workers_device_and_dtype_follow_their_gpus_not_the_driver() -> None:
    """A Ray driver without a GPU plans its GPU workers' device and dtype as they will find
    them, and vLLM serves the dtype they train."""
    overrides = ["workers.backend=ray", "workers.gpus_per_worker=1"]
    cfg = load_config(None, [*overrides, "engine.backend=vllm", "sync.transport=nccl"])
    plan = plan_run(cfg, cuda=False)
    assert plan.policy == RoleDevice("cuda", "bfloat16")
    assert plan.vllm is not None and plan.vllm.dtype == "bfloat16"
    cpu = plan_run(load_config(None, ["workers.backend=ray", "workers.gpus_per_worker=0"]))
    assert cpu.policy == RoleDevice("cpu", "float32")
    joined = ["workers.backend=ray", "workers.ray_address=auto"]
    with pytest.raises(ConfigError, match=r"workers.device='auto' with workers.ray_address"):
        load_config(None, joined)
    assert load_config(None, [*joined, "workers.device=cpu"]).plan.policy.device == "cpu"


@pytest.mark.parametrize(
    ("overrides", "seconds"),
    [
        ([], 180.0),
        (["engine.backend=vllm", "sync.transport=gloo"], 900.0),
        (["engine.backend=vllm_inprocess", "sync.transport=gloo"], 900.0),
        (["engine.backend=remote", "engine.urls=[http://h:1]"], 180.0),
        (["engine.backend=vllm", "sync.transport=gloo", "engine.startup_timeout_s=60"], 60.0),
    ],
)
def test_the_engine_startup_timeout_is_decided_once(overrides, seconds) -> None:
    """The start, the restart of a started engine and the wait for a remote one read it (the
    recovery waited 180 s for a restarted vLLM engine, whose start-up default is 900 s)."""
    assert load_config(None, overrides).plan.timeouts.engine_startup_s == seconds


def test_the_control_plane_timeouts_environment_override_is_applied_once(monkeypatch) -> None:
    monkeypatch.setenv("TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S", "5")
    assert load_config(None, []).plan.timeouts.control_plane_s == 5.0


def test_engines_placed_by_ray_need_the_cluster_whatever_the_backend() -> None:
    """vLLM servers placed by Ray need a connected driver as the reference servers do (the
    run joined a cluster only for the reference engine's)."""
    vllm = ["engine.backend=vllm", "sync.transport=gloo", "engine.placement=ray"]
    assert load_config(None, vllm).plan.uses_ray
    assert load_config(None, ["engine.placement=ray"]).plan.uses_ray
    assert load_config(None, ["workers.backend=ray"]).plan.uses_ray


@pytest.mark.parametrize(
    ("overrides", "cores", "expected"),
    [
        # sync: generation and training take turns, each gets every core in its turn
        ([], 2, CpuThreads(trainer=2, server=2)),
        (["engine.num_engines=2"], 8, CpuThreads(trainer=8, server=4)),
        (["engine.num_engines=4"], 2, CpuThreads(trainer=2, server=1)),
        # fully-async: both at once, one thread per server, the rest for the trainer
        (["trainer.strategy=fully_async"], 2, CpuThreads(trainer=1, server=1)),
        (["trainer.strategy=fully_async", "engine.num_engines=2"], 8, CpuThreads(6, 1)),
        (["trainer.strategy=fully_async", "engine.num_engines=4"], 2, CpuThreads(1, 1)),
        # servers the trainer does not start take no share
        (["trainer.strategy=fully_async", "engine.backend=inprocess"], 2, CpuThreads(2, 1)),
    ],
)
def test_the_cores_are_shared_by_strategy(overrides, cores, expected):
    assert cpu_threads(load_config(None, overrides), cores) == expected


def test_omp_num_threads_is_the_cores_to_share(monkeypatch):
    cfg = load_config(None, ["engine.num_engines=2"])
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert cpu_threads(cfg) == CpuThreads(trainer=4, server=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "nonsense")
    assert cpu_threads(cfg, cores=6) == CpuThreads(trainer=6, server=3)


def test_a_reference_server_is_started_with_its_threads():
    spec = ReferenceServers("m", num_threads=2)(0, "127.0.0.1")
    i = spec.argv.index("--num-threads")
    assert spec.argv[i + 1] == "2"
    assert "--num-threads" not in ReferenceServers("m")(0, "127.0.0.1").argv


#: A run-mode key compared with a string outside the config: a decision re-derived.
_RE_DERIVED = re.compile(
    r"\b(strategy|backend|placement|data_parallel|transport)\s*(==|!=|in|not in)\s*[\"'(]"
)
#: Where asking torch for CUDA is about this process itself, not a decision the run acts on.
_OWN_PROCESS = {
    "trainer/checkpoint/_io.py",  # this process's RNG state, saved and restored
    "trainer/workers/offload.py",  # whether this process can pin host memory
}


def test_no_part_of_the_trainer_re_derives_a_planned_decision() -> None:
    """Outside ``trainer.config`` (which validates and plans), no module compares a mode key
    with a string or asks torch whether CUDA is there: they read the plan."""
    root = Path(__file__).resolve().parents[3]
    found = []
    for path in sorted((root / "trainer").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("trainer/config/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _RE_DERIVED.search(code) or (
                "cuda.is_available()" in code and rel not in _OWN_PROCESS
            ):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert found == []
    assert _RE_DERIVED.search('if t.strategy == "fully_async":')  # the check can fail


def test_a_lora_adapter_is_planned_on_a_sharded_and_on_a_replicated_policy() -> None:
    cfg = load_config(None, [*RAY_2, "workers.data_parallel=fsdp2", "model.lora.rank=8"])
    assert cfg.plan.sharded and cfg.model.lora.enabled
    cfg = load_config(None, [*RAY_2, "workers.data_parallel=replicate", "model.lora.rank=8"])
    assert not cfg.plan.sharded and cfg.model.lora.enabled


def test_lora_without_peft_is_refused_at_load_naming_the_extra(monkeypatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "peft" else find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"pip install -e '.\[lora\]'"):
        load_config(None, ["model.lora.rank=8"])
    load_config(None, ["model.lora.rank=0"])  # full fine-tuning needs no peft


@pytest.mark.parametrize(
    ("targets", "error"),
    [("[]", "must name at least one module"), ("[all-linear,q_proj]", "all-linear stands alone")],
)
def test_lora_target_modules_are_checked_at_load(targets, error) -> None:
    with pytest.raises(ConfigError, match=error):
        load_config(None, ["model.lora.rank=8", f"model.lora.target_modules={targets}"])


def test_the_served_adapter_is_planned_once_with_vllms_smallest_rank_that_holds_it() -> None:
    assert load_config(None, ["model.lora.rank=8"]).plan.served_adapter is None  # merged
    cfg = load_config(None, ["model.lora.rank=12", "sync.lora=adapter", "engine.backend=vllm"])
    assert cfg.plan.served_adapter is not None and cfg.plan.served_adapter.max_rank == 16
    assert cfg.plan.vllm is not None
    assert cfg.plan.vllm.argv()[-5:] == [
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--max-loras",
        "1",
    ]
    assert load_config(None, ["sync.lora=adapter"]).plan.served_adapter is None  # no adapter
    with pytest.raises(ConfigError, match=r"engine.backend='inprocess' takes weights in memory"):
        load_config(None, ["model.lora.rank=8", "sync.lora=adapter", "engine.backend=inprocess"])
    inproc = load_config(
        None, ["model.lora.rank=8", "sync.lora=adapter", "engine.backend=vllm_inprocess"]
    ).plan
    assert inproc.served_adapter is not None and inproc.vllm is not None
    assert "--enable-lora" in inproc.vllm.argv()
    with pytest.raises(ConfigError, match=r"above vLLM's largest --max-lora-rank 512"):
        load_config(None, ["model.lora.rank=600", "sync.lora=adapter"])
