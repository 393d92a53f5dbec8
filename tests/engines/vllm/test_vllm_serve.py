"""``engine.backend=vllm``: the ``vllm serve`` command against vLLM's own flags, the guard that
takes a server down with its launcher, and the launcher's path for a server told its port.

vLLM cannot run here. The command line is checked against ``reference/vllm_serve_flags.json``
(dumped from vLLM 0.33.0's parser by ``reference/dump_vllm_serve_flags.py``): every option
must exist there and take the number of values given. The process machinery is the same
launcher the reference engine uses; here it runs a reference server under the guard with
a port chosen up front, which is exactly how it runs ``vllm serve``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from engines.client import InferenceClient
from engines.launch import ServerSpec, open_engine_processes
from engines.process_group import free_port
from engines.types import SamplingParams
from engines.vllm._plugin import BACKENDS
from engines.vllm.flags import VLLM_SERVE_MODULE, VllmSettings, WeightTransferBackend
from engines.vllm.serve import (
    TOKEN_IN_FLAG,
    VllmServers,
    check_server_config,
    config_problems,
    gpu_groups,
)
from trainer.config import load_config, plan_run
from trainer.errors import ConfigError
from trainer.run import train
from trainer.run._engines import vllm_servers

RECORDED = Path(__file__).parents[1] / "vllm_recorded"
DUMP = json.loads((RECORDED / "vllm_serve_flags.json").read_text())
FLAGS: dict[str, dict[str, object]] = DUMP["flags"]
PROJECT = Path(__file__).resolve().parents[3]


def serve_args(argv: tuple[str, ...]) -> list[str]:
    """The arguments as ``vllm serve`` would take them (the guard and the interpreter
    stripped; the API server's ``--model M`` is ``vllm serve``'s positional ``M``)."""
    tail = list(argv[argv.index("--") + 1 :])
    assert tail[:4] == [sys.executable, "-m", VLLM_SERVE_MODULE, "--model"], tail
    return tail[4:]


def flag_problems(args: list[str]) -> list[str]:
    """What in ``vllm serve``'s arguments its parser (as dumped) would refuse."""
    problems = []
    if not args or args[0].startswith("-"):
        problems.append(f"the model must come first: {args[:1]}")
    i = 1
    while i < len(args):
        option, _, inline = args[i].partition("=")
        i += 1
        values = [inline] if inline else []
        while i < len(args) and not args[i].startswith("--"):
            values.append(args[i])
            i += 1
        shape = FLAGS.get(option)
        if shape is None:
            problems.append(f"{option} is not a `vllm serve` option")
            continue
        arity, choices = shape["arity"], shape["choices"]
        if arity == "0" and values:
            problems.append(f"{option} takes no value, got {values}")
        elif arity == "1" and len(values) != 1:
            problems.append(f"{option} takes one value, got {values}")
        elif arity == "+" and not values:
            problems.append(f"{option} takes values, got none")
        if isinstance(choices, list) and any(v not in choices for v in values):
            problems.append(f"{option}={values} is not one of {choices}")
    return problems


def _servers(
    backend: WeightTransferBackend, gpu_groups: tuple[tuple[int, ...], ...] = (), **settings: Any
) -> VllmServers:
    return VllmServers(
        VllmSettings("/m", weight_transfer_backend=backend, **settings), gpu_groups=gpu_groups
    )


CASES = {
    "nccl, one GPU each": _servers("nccl", ((1,), (2,))),
    "ipc, colocated, sleep": _servers(
        "ipc", ((0,),), gpu_memory_utilization=0.4, enable_sleep_mode=True
    ),
    "tensor parallel with extra flags": _servers(
        "nccl",
        ((1, 2),),
        tensor_parallel_size=2,
        extra_args=("--max-model-len", "4096", "--enforce-eager"),
    ),
    "gloo on the CPU, float32": _servers("gloo", dtype="float32", cpu=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_command_uses_only_flags_the_pinned_vllm_serve_accepts(case: str) -> None:
    spec = CASES[case](0, "127.0.0.1")
    args = serve_args(spec.argv)
    assert flag_problems(args) == []
    assert args[0] == "/m"
    backend = json.loads(args[args.index("--weight-transfer-config") + 1])
    assert backend == {"backend": CASES[case].settings.weight_transfer_backend}
    assert args[args.index("--port") + 1] == str(spec.port)


def test_every_server_serves_the_token_in_route_once() -> None:
    """``--enable-scale-out`` (``POST /inference/v1/generate``) on every command, once, and
    not where ``extra_args`` already decide it."""
    for case in CASES.values():
        assert serve_args(case(0, "127.0.0.1").argv).count(TOKEN_IN_FLAG) == 1
    for given in (TOKEN_IN_FLAG, "--tokens-only", "--no-enable-scale-out"):
        servers = _servers("gloo", extra_args=(given,))
        args = serve_args(servers(0, "127.0.0.1").argv)
        assert args.count(given) == 1
        assert given == TOKEN_IN_FLAG or TOKEN_IN_FLAG not in args


def test_the_flag_check_refuses_what_vllm_would() -> None:
    """The check can fail: an unknown option, a switch given a value, a missing value."""
    bad = ["/m", "--weight-transfer-backend", "nccl", "--enforce-eager", "yes", "--port"]
    assert flag_problems(bad) == [
        "--weight-transfer-backend is not a `vllm serve` option",
        "--enforce-eager takes no value, got ['yes']",
        "--port takes one value, got []",
    ]
    assert flag_problems(["/m", "--logprobs-mode", "raw"])  # not one of vLLM's choices


def test_each_server_gets_its_gpus_its_seed_and_the_dev_routes() -> None:
    servers = _servers("ipc", ((0, 1), (2, 3)), seed=7)
    second = servers(1, "127.0.0.1")
    assert second.env == {
        "VLLM_SERVER_DEV_MODE": "1",  # vLLM 0.33 serves pause/sleep/weight transfer only then
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # ipc handles travel pickled
        "CUDA_VISIBLE_DEVICES": "2,3",
    }
    args = serve_args(second.argv)
    assert args[args.index("--seed") + 1] == "8"
    assert "--enable-sleep-mode" not in args
    # placed by Ray: the actor's own GPUs, so nothing set here
    assert "CUDA_VISIBLE_DEVICES" not in _servers("nccl")(0, "127.0.0.1").env


def test_a_cpu_server_gets_kv_cache_space_and_the_policys_dtype(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("TRAINER_VLLM_BUSY_LOOP_S", raising=False)
    spec = _servers("gloo", dtype="float32", cpu=True)(0, "127.0.0.1")
    assert spec.env == {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TRAINER_VLLM_BUSY_LOOP_S": "0.005",  # vLLM's 1 s spin takes the training's cores
    }
    args = serve_args(spec.argv)
    assert args[args.index("--dtype") + 1] == "float32"
    assert "--enforce-eager" in args  # no torch.compile warm-up on the CPU
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # the user's own settings are kept
    monkeypatch.setenv("TRAINER_VLLM_BUSY_LOOP_S", "1")
    assert _servers("gloo", cpu=True).env(0) == {"VLLM_SERVER_DEV_MODE": "1"}


@pytest.mark.parametrize("key", ["engine.colocated", "engine.offload_kv_for_weight_sync"])
def test_a_run_that_sleeps_vllm_on_the_cpu_is_refused_at_load(tmp_path, key) -> None:
    """The run plan refuses it (vLLM's CPU build has no sleep mode), so ``load_config`` does
    where this process sees no CUDA; on a GPU the plan's vLLM sleeps."""
    cfg = load_config(None, ["engine.backend=vllm", "sync.transport=gloo"])
    cfg = attrs.evolve(cfg, engine=attrs.evolve(cfg.engine, **{key.split(".")[1]: True}))
    refusal = rf"{key}=true .* vLLM on the CPU has no sleep mode"
    with pytest.raises(ConfigError, match=refusal):
        plan_run(cfg, cuda=False)
    on_a_gpu = plan_run(cfg, cuda=True).vllm
    assert on_a_gpu is not None and on_a_gpu.enable_sleep_mode and not on_a_gpu.cpu
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=refusal):
            load_config(None, ["engine.backend=vllm", "sync.transport=gloo", f"{key}=true"])


def test_gpu_groups_hand_out_tensor_parallel_gpus_server_by_server() -> None:
    assert gpu_groups([], 2, 2, first=1) == ((1, 2), (3, 4))
    assert gpu_groups([4, 5, 6, 7], 2, 2, first=0) == ((4, 5), (6, 7))
    with pytest.raises(ConfigError, match=r"has 3 GPUs, but engine.num_engines=2 x"):
        gpu_groups([1, 2, 3], 2, 2, first=0)


def test_the_run_config_becomes_the_servers_it_starts(tmp_path: Path) -> None:
    """The plan's vLLM settings as a GPU machine plans them (colocated engines sleep, which
    vLLM's CPU build cannot)."""
    cfg = load_config(
        None,
        [
            "engine.backend=vllm",
            "sync.transport=ipc",
            "engine.gpu_memory_utilization=0.5",
            "engine.extra_args=[--enforce-eager]",
        ],
    )
    cfg = attrs.evolve(cfg, engine=attrs.evolve(cfg.engine, colocated=True))
    cfg.plan = plan_run(cfg, cuda=True)
    servers = vllm_servers(cfg, tmp_path)
    assert servers.gpu_groups == ((0,),)  # ipc: the trainer's GPU
    settings = servers.settings
    assert settings.enable_sleep_mode and settings.extra_args == ("--enforce-eager",)
    assert (settings.model, settings.gpu_memory_utilization) == (str(tmp_path), 0.5)
    assert flag_problems(serve_args(servers(0, "127.0.0.1").argv)) == []
    nccl = load_config(None, ["engine.backend=vllm", "sync.transport=nccl", "engine.num_engines=2"])
    assert vllm_servers(nccl, tmp_path).gpu_groups == ((1,), (2,))  # GPU 0 trains


@pytest.mark.parametrize("backend", ["vllm", "vllm_inprocess"])
@pytest.mark.parametrize("transport", ["gloo", "disk"])
def test_gloo_and_disk_are_transports_vllm_has_through_the_plugin(
    backend, transport, tmp_path: Path
) -> None:
    cfg = load_config(None, [f"engine.backend={backend}", f"sync.transport={transport}"])
    assert cfg.sync.transport == transport
    module, name = BACKENDS[transport]  # the plugin's engine for it (its class needs vLLM)
    assert importlib.util.find_spec(module) is not None
    if importlib.util.find_spec("vllm") is not None:
        assert getattr(importlib.import_module(module), name).__name__ == name
    if backend == "vllm":  # the servers the run starts are told the transport
        argv = vllm_servers(cfg, tmp_path)(0, "127.0.0.1").argv
        flag = argv[argv.index("--weight-transfer-config") + 1]
        assert json.loads(flag) == {"backend": transport}


def test_the_server_info_fields_read_are_vllms() -> None:
    assert DUMP["server_info_fields"] == dict.fromkeys(DUMP["server_info_fields"], True)
    assert set(DUMP["server_info_fields"]) >= {
        "weight_transfer_config.backend",
        "model_config.enable_sleep_mode",
    }


def test_a_server_config_that_does_not_fit_the_run_names_the_flag() -> None:
    fits = {"weight_transfer_config": {"backend": "nccl"}, "model_config": {}}
    assert config_problems(fits, "nccl", needs_sleep=False) == []
    unset = {"weight_transfer_config": None, "model_config": {"enable_sleep_mode": False}}
    problems = config_problems(unset, "nccl", needs_sleep=True)
    assert len(problems) == 2
    assert """--weight-transfer-config '{"backend": "nccl"}'""" in problems[0]
    assert "--enable-sleep-mode" in problems[1]
    # vLLM's nccl workers rendezvous through vLLM's StatelessProcessGroup: rank 0 needs vLLM
    (rendezvous,) = config_problems(fits, "nccl", needs_sleep=False, trainer_has_vllm=False)
    assert "pip install vllm" in rendezvous
    ipc = {"weight_transfer_config": {"backend": "ipc"}, "model_config": {}}
    assert config_problems(ipc, "ipc", needs_sleep=False, trainer_has_vllm=False) == []


@attrs.frozen
class GuardedReference:
    """A reference server run as ``vllm serve`` is: under the guard, told its port."""

    model_dir: str

    def __call__(self, index: int, host: str) -> ServerSpec:
        port = free_port(host)
        cmd = [sys.executable, "-m", "engines.local", "serve", "--model", self.model_dir]
        cmd += ["--host", host, "--port", str(port)]
        guard = [sys.executable, "-m", "engines.launch.stdin_guard", "--grace-s", "5", "--"]
        return ServerSpec((*guard, *cmd), {"MARK_GUARDED": "1"}, port)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_server_told_its_port_starts_serves_and_leaves_nothing(
    model_dir: Path, tmp_path: Path
) -> None:
    async with open_engine_processes(
        1, GuardedReference(str(model_dir)), tmp_path, startup_timeout_s=120
    ) as engines:
        (engine,) = engines
        assert engine.url == f"http://127.0.0.1:{engine.told_port}"
        async with InferenceClient([engine.url], api_key=engines.api_key) as client:
            completion = await client.generate([5, 6], SamplingParams(max_tokens=2, seed=0))
            # a server without vLLM's /server_info (404) is not checked
            await check_server_config(client, "nccl", needs_sleep=True)
        group = engine.pid
    assert len(completion.token_ids) == 2
    # the whole group is gone: SIGKILLed at the stop, each member is gone once reaped
    # (by init, as orphans: not instantly), so a generous bound, not the next instant
    with trio.fail_after(30):
        while _group_alive(group):  # noqa: ASYNC110 - no event for another's exit
            await trio.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_guard_takes_its_server_down_when_the_launcher_dies(model_dir: Path) -> None:
    """The launcher's end of the stdin pipe closing (it died, even by SIGKILL) stops the
    guarded server and everything in its group, within the guard's grace."""
    port = free_port()
    cmd = [sys.executable, "-m", "engines.launch.stdin_guard", "--grace-s", "5", "--"]
    cmd += [sys.executable, "-m", "engines.local", "serve", "--model", str(model_dir)]
    cmd += ["--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    guard = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True, env=env
    )
    try:
        end = time.monotonic() + 120
        while not (server_pids := _children(guard.pid)) and time.monotonic() < end:
            time.sleep(0.1)
        assert server_pids, "the guard started no server"
        assert guard.stdin is not None
        guard.stdin.close()  # what the kernel does when the launcher dies
        guard.wait(timeout=60)
        end = time.monotonic() + 30
        while any(alive(p) for p in server_pids) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(alive(p) for p in server_pids)
    finally:
        try:
            os.killpg(guard.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        guard.wait(timeout=10)


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def test_the_guard_exits_with_its_commands_status() -> None:
    reader, writer = os.pipe()  # stdin held open: only the command's own exit ends it
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "engines.launch.stdin_guard",
                "--",
                sys.executable,
                "-c",
                "exit(3)",
            ],
            stdin=reader,
            cwd=PROJECT,
            timeout=60,
            check=False,
        )
    finally:
        os.close(reader)
        os.close(writer)
    assert done.returncode == 3


async def test_no_vllm_here_stops_the_run_before_any_work(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    cfg = load_config(
        None, ["engine.backend=vllm", "sync.transport=nccl", f"trainer.run_dir={tmp_path}/run"]
    )
    with pytest.raises(ConfigError) as info, trio.fail_after(30):
        await train(cfg)
    assert "\n" not in str(info.value) and "pip install vllm" in str(info.value)
    assert not (tmp_path / "run").exists()  # nothing was made
