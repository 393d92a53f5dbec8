"""The ``engine`` and ``sync`` sections: the inference engines, and how weights reach them.

Re-exported by :mod:`trainer.config._schema` (``EngineConfig``, ``SyncConfig``); see
docs/engines.md, docs/vllm.md and docs/weight_sync.md for what the keys do.
"""

from __future__ import annotations

from typing import Literal

import attrs

from engines.types import PauseMode
from sync.registry import TransportName
from trainer.config._fields import at_least, in_range, positive
from trainer.config._fields import config_field as _field

__all__ = ["EngineConfig", "SyncConfig"]


@attrs.define
class EngineConfig:
    backend: Literal["local", "remote", "inprocess", "vllm", "vllm_inprocess"] = _field(
        "local",
        "Inference engines: 'local' starts reference-engine servers (vLLM's HTTP protocol) and "
        "stops them at exit; 'vllm' starts `vllm serve` servers the same way (needs vLLM and "
        "GPUs; see docs/vllm.md); 'remote' uses servers at engine.urls (e.g. a `vllm serve` you "
        "started); 'inprocess' runs the reference engine inside the trainer, without HTTP; "
        "'vllm_inprocess' runs vLLM's AsyncLLM inside the trainer.",
    )
    num_engines: int = _field(1, "Servers to start (backend=local or vllm).", check=at_least(1))
    placement: Literal["process", "ray"] = _field(
        "process",
        "Where backend=local or vllm starts its servers: 'process' (child processes of the "
        "trainer) or 'ray' (each server in a Ray actor on the node Ray picks, on the cluster of "
        "workers.ray_address; a vLLM server's actor reserves engine.tensor_parallel_size GPUs; "
        "see docs/scaling.md). Either way they are stopped at exit.",
    )
    fork_server: str | None = _field(
        None,
        "Unix socket of a fork server (engines.launch.fork_server, run with the trainer's "
        "Python; see docs/engines.md): the reference servers the trainer starts as child "
        "processes (backend=local, placement=process) are forked from it, already imported, "
        "instead of started afresh (about 5 s of CPU less per start and restart). None: each "
        "is a new engines.local server process.",
        env="TRAINER_FORK_SERVER",
    )
    tensor_parallel_size: int = _field(
        1,
        "backend=vllm or vllm_inprocess: GPUs per engine (vLLM's --tensor-parallel-size).",
        check=at_least(1),
    )
    gpu_memory_utilization: float | None = _field(
        None,
        "backend=vllm or vllm_inprocess: the share of each GPU vLLM may take (its "
        "--gpu-memory-utilization); None: vLLM's default (0.92 in vLLM 0.33). Lower it when "
        "training shares the GPU (engine.colocated, sync.transport=ipc).",
        check=in_range(0.01, 1.0),
    )
    extra_args: tuple[str, ...] = _field(
        (),
        "backend=vllm or vllm_inprocess: more `vllm serve` flags, passed as given after the "
        "trainer's own (e.g. [--max-model-len,4096,--enforce-eager]); vllm_inprocess parses "
        "them with vLLM's own engine-argument parser.",
    )
    ray_num_cpus: float = _field(
        1.0, "Ray CPUs each engine actor reserves (placement=ray).", check=positive
    )
    urls: tuple[str, ...] = _field(
        (), "Server base URLs for backend=remote, e.g. [http://host:8000]."
    )
    api_key: str | None = _field(
        None,
        "Bearer token the servers ask for: backend=remote, the key of servers someone else "
        "runs; for servers the trainer starts, given to them (in their environment) instead "
        "of the fresh secret each run makes. Give it by the environment variable (a command "
        "line is visible to every user in `ps`); never written to RUN_DIR/config.yaml, so a "
        "resume needs the variable set again. docs/security.md.",
        env="TRAINER_ENGINE_API_KEY",
    )
    trust_network: bool = _field(
        False,
        "Say that only trusted hosts reach the engines' network. Needed for sync.transport=ipc "
        "where the engines answer beyond this host (engine.placement=ray, or a backend=remote "
        "URL that is not loopback): vLLM then unpickles what its /update_weights is sent "
        "(VLLM_ALLOW_INSECURE_SERIALIZATION=1), which runs code for anyone who reaches the "
        "server with the key. docs/security.md.",
    )
    pause_mode: PauseMode = _field(
        "keep", "How generation pauses for a weight sync: keep (freeze), abort, wait (drain)."
    )
    colocated: bool = _field(
        False,
        "The engines share devices with training: a weight sync wakes the weights, transfers, "
        "then wakes the KV cache (instead of pause/transfer/resume).",
    )
    offload_kv_for_weight_sync: bool = _field(
        False,
        "Free the KV cache during a weight sync: sleep, wake the weights, transfer, wake the "
        "KV cache (always, even when the transfer fails).",
    )
    max_concurrency: int = _field(
        256, "Most generation requests in flight at once.", check=at_least(1)
    )
    startup_timeout_s: float | None = _field(
        None,
        "How long started engines may take to become healthy (placement=ray: Ray placing "
        "their actors included). None: 180 s for the reference engine, 900 s for vLLM "
        "(loading, compiling and capturing CUDA graphs take minutes).",
        check=positive,
    )
    max_restarts: int = _field(
        3,
        "Restarts each engine gets per run after it dies, hangs (a missed health check) or "
        "answers 5xx: stopped, started again (backend=remote: waited for, within "
        "startup_timeout_s), synced to the current weights and verified before it serves "
        "again; its requests go to the other engines or wait for it. Past it the run ends "
        "with EngineFailedError; 0: the first failure ends it. Not for backend=inprocess, "
        "vllm_inprocess or placement=ray (their failure ends the run). docs/fault_tolerance.md.",
        check=at_least(0),
    )
    health_check_interval_s: float = _field(
        10.0,
        "Seconds between two GET /health of each engine (engine.max_restarts > 0).",
        check=positive,
    )
    health_check_timeout_s: float = _field(
        10.0, "An engine whose GET /health takes longer has failed (it is hung).", check=positive
    )
    health_check_first_wait_s: float = _field(
        30.0,
        "Seconds after an engine (re)starts before its first health check (its first "
        "requests may compile).",
        check=at_least(0),
    )
    control_plane_timeout_s: float = _field(
        600.0,
        "Per-request timeout of control-plane calls (pause, resume, sleep, weight transfer), "
        "inside or outside a step; <= 0 disables. Generation requests are not bounded by it.",
        env="TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S",
    )
    device: Literal["auto", "cpu", "cuda"] = _field(
        "auto",
        "Where the reference engines the trainer runs (backend=local or inprocess) hold their "
        "model: 'auto' is CUDA when the engine's process sees a GPU, else the CPU; 'cuda' "
        "refuses to start where there is none. On CUDA the model is bfloat16 (see docs/gpus.md).",
    )
    gpu_ids: tuple[int, ...] = _field(
        (),
        "placement=process: the GPUs of the started engines. backend=local with "
        "engine.device=cuda: engine i on cuda:gpu_ids[i % len] (e.g. [1,2,3] leaves GPU 0 to "
        "the policy); empty: every engine on the first GPU, colocated with the policy. "
        "backend=vllm: engine i gets the tensor_parallel_size GPUs from gpu_ids[i*tp]; empty: "
        "GPU 0 on for sync.transport=ipc (colocated), GPU 1 on otherwise (GPU 0 trains).",
    )


@attrs.define
class SyncConfig:
    transport: TransportName = _field(
        "disk",
        "How weights reach HTTP engines, as vLLM's weight-transfer backends: 'disk' writes "
        "safetensors buckets the engines load (same machine or shared mount); 'nccl' "
        "broadcasts them from policy rank 0 to every server over an NCCL group (GPUs, trainer "
        "and engines on different GPUs); 'gloo' sends nccl's very messages over a gloo group "
        "on the CPU; 'ipc' hands CUDA IPC handles of a reused flat buffer to engines on the "
        "same GPU. disk and gloo reach the reference engine and real vLLM (through the "
        "weight-transfer engines this project installs as a vLLM plugin); nccl and ipc need "
        "CUDA. backend=inprocess always hands tensors over in memory.",
    )
    packed: bool | None = _field(
        True,
        "gloo/nccl: vLLM's 'packed' wire param: true, one /update_weights for the whole "
        "model, sent as flat chunks of sync.bucket_size_mb (vLLM's trainer default; on the CPU "
        "the chunks are slices of rank 0's parameters, no copy); false, one call per bucket, "
        "each parameter broadcast from its own storage (measured slower on the CPU, see "
        "docs/performance.md). None (what older recorded configs hold): true.",
    )
    bucket_size_mb: int = _field(
        256,
        "Weight bucket size in MB: what one /update_weights call carries at most (disk, ipc, "
        "unpacked gloo/nccl; ipc: also the extra memory rank 0 holds for it); packed "
        "gloo/nccl: the size of each broadcast chunk (vLLM's packed_buffer_size_bytes; a "
        "chunk ends with the tensor that crosses it).",
        check=at_least(1),
    )
    master_address: str | None = _field(
        None,
        "sync.transport=gloo|nccl: the address policy rank 0 hosts the weight-sync group at, "
        "which every engine must reach. None: its Ray node address where Ray runs in rank 0's "
        "process, else the local address that routes to the first engine (loopback for "
        "engines on this machine).",
    )
    group_init_timeout_s: float = _field(
        600.0,
        "sync.transport=gloo|nccl: how long the weight-sync process group may take to form "
        "before CheckpointEngineInitError (bounded by the trainer, not inside a worker).",
        check=positive,
        env="TRAINER_GROUP_INIT_TIMEOUT_S",
    )
    transfer_grace_s: float = _field(
        10.0,
        "How long a weight transfer may run past its deadline (trainer.weight_sync_timeout_s, "
        "else the step's), or past a cancellation without one (Ctrl-C), before the run abandons "
        "it: the engines are left paused (their weights may be partial) and the run ends with "
        "WeightSyncTimeoutError saying so (after Ctrl-C: interrupted, exit status 130).",
        check=at_least(0),
    )
    lora: Literal["merged", "adapter"] = _field(
        "merged",
        "How a LoRA policy (model.lora.rank > 0) reaches the engines: 'merged' sends the "
        "merged weights W + (alpha/r) BA through sync.transport (every engine, every "
        "transport; as many bytes as full fine-tuning); 'adapter' writes the adapter alone "
        "(peft's files, under RUN_DIR/weight_sync) and each engine loads it in place through "
        "vLLM's /v1/load_lora_adapter, serving it by name (engine.backend=local, vllm, "
        "vllm_inprocess or remote; the engines need --enable-lora, which the trainer passes to "
        "those it starts). "
        "docs/lora.md compares them.",
    )
    verify: Literal["first", "every", "never"] = _field(
        "first",
        "Check a weight sync: each engine samples a fixed probe and the policy scores the "
        "same tokens; a logprob apart by more than sync.verify_tolerance ends the run with "
        "WeightSyncMismatchError, before a rollout trains on those weights. 'first': the "
        "initial sync (and a resumed run's); 'every': every sync; 'never'. Skipped (logged) "
        "for a policy sharded over Ray workers.",
    )
    verify_tolerance: float | None = _field(
        None,
        "Largest logprob difference sync.verify accepts; None: 1e-3 for a float32 policy, "
        "0.1 for bfloat16 or float16 (the engine's kernels round differently).",
        check=positive,
    )
