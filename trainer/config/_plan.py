"""The run plan: every decision the run acts on, made once from a validated config.

A config holds what the user wrote (``auto``, strings, unset timeouts); the plan holds what
the run does with it: the strategy, backends and bracket as enums, the device and dtype of
each role, whether the policy is sharded, the off-policy correction, the CPU thread split,
every timeout with its default and environment override applied, and the vLLM engine's
settings as one value. The run's parts read :attr:`Config.plan <trainer.config.Config.plan>`
and never re-derive a decision from the config's strings. docs/architecture.md's owner table
names each decision's one place.

::

    plan = load_config(None, ["trainer.strategy=fully_async"]).plan
    plan.strategy is Strategy.FULLY_ASYNC     # True
    plan.correction.rollout_is                # 'token' (algorithm.off_policy_correction=auto)
    plan.policy.dtype                         # 'float32' on a machine without CUDA
"""

from __future__ import annotations

import enum
from typing import Protocol

import attrs

from engines.cpu_share import available_cores
from engines.vllm.flags import VllmSettings
from sync.bracket import Bracket
from sync.registry import TRANSPORTS, TransportSpec
from trainer.algorithms import RolloutCorrection
from trainer.config._corrections import correction_note, plan_correction
from trainer.config._engine import EngineConfig, SyncConfig
from trainer.config._models import ModelConfig
from trainer.config._schema import AlgorithmConfig, TrainerConfig
from trainer.config._workers import WorkersConfig
from trainer.errors import ConfigError

#: What the engines the trainer starts report as a sampled token's logprob (``--logprobs-mode``,
#: vLLM's flag, which the reference engine shares): the sampling distribution's, the logits
#: over the temperature, as the trainer computes its own old logprobs. vLLM's default
#: (``raw_logprobs``, before the temperature) would make every importance ratio, rollout
#: correction and mismatch diagnostic wrong at a temperature other than 1 (verl, TRL and
#: prime-rl set the same). Top-p is not in the trainer's logprobs; vLLM's processed ones
#: renormalise after it, so with ``top_p < 1`` the two still differ on the tokens it cut.
ROLLOUT_LOGPROBS_MODE = "processed_logprobs"

__all__ = [
    "ROLLOUT_LOGPROBS_MODE",
    "CpuThreads",
    "EngineBackend",
    "EnginePlacement",
    "RoleDevice",
    "RunPlan",
    "Strategy",
    "Timeouts",
    "WorkerBackend",
    "cpu_threads",
    "plan_run",
]


class Sections(Protocol):
    """The sections a plan is made from (:class:`trainer.config.Config` has them)."""

    trainer: TrainerConfig
    engine: EngineConfig
    sync: SyncConfig
    workers: WorkersConfig
    algorithm: AlgorithmConfig
    model: ModelConfig


class Strategy(enum.StrEnum):
    """``trainer.strategy``."""

    SYNC = "sync"
    FULLY_ASYNC = "fully_async"


class EngineBackend(enum.StrEnum):
    """``engine.backend``."""

    LOCAL = "local"
    INPROCESS = "inprocess"
    VLLM = "vllm"
    VLLM_INPROCESS = "vllm_inprocess"
    REMOTE = "remote"

    @property
    def runs_vllm(self) -> bool:
        """The trainer runs vLLM itself (``vllm serve`` servers or ``AsyncLLM`` in process)."""
        return self in (EngineBackend.VLLM, EngineBackend.VLLM_INPROCESS)

    @property
    def starts_servers(self) -> bool:
        """The trainer starts HTTP servers (processes or Ray actors) it can restart."""
        return self in (EngineBackend.LOCAL, EngineBackend.VLLM)


class EnginePlacement(enum.StrEnum):
    """``engine.placement``: who starts the servers the trainer runs."""

    PROCESS = "process"
    RAY = "ray"


class WorkerBackend(enum.StrEnum):
    """``workers.backend``."""

    LOCAL = "local"
    RAY = "ray"


@attrs.frozen
class RoleDevice:
    """Where a role's model lives and in what dtype (``cuda`` on a Ray actor: its own GPU)."""

    device: str
    dtype: str


@attrs.frozen
class CpuThreads:
    """torch's intra-op threads on a machine without CUDA: the trainer's, and each reference
    engine server's (``engine.backend=local``)."""

    trainer: int
    server: int


@attrs.frozen
class Timeouts:
    """Every bound the run's parts apply, defaults and environment overrides applied here."""

    #: ``trainer.step_timeout_s`` (None: unbounded).
    step_s: float | None
    #: ``trainer.weight_sync_timeout_s`` (None: the step's budget only).
    weight_sync_s: float | None
    #: ``engine.control_plane_timeout_s`` (its environment override applied by the loader);
    #: <= 0 disables, as the client reads it.
    control_plane_s: float
    #: ``engine.startup_timeout_s``, or its default for the backend (vLLM compiles: longer).
    engine_startup_s: float
    #: ``workers.collective_timeout_s``: torch.distributed's own watchdog.
    collective_s: float
    #: ``sync.group_init_timeout_s``: forming the weight-sync process group.
    group_init_s: float


@attrs.frozen
class RunPlan:
    """What a run does, decided once (:func:`plan_run`); see the module docstring."""

    strategy: Strategy
    engine_backend: EngineBackend
    engine_placement: EnginePlacement
    worker_backend: WorkerBackend
    #: The calls around each weight transfer (sleep or pause).
    bracket: Bracket
    #: ``sync.transport``, as the registry declares it.
    transport: TransportSpec
    #: The policy's (and the reference model's and critic's) device and dtype.
    policy: RoleDevice
    #: The devices of the reference engines the trainer runs (``engine.backend=local`` or
    #: ``inprocess``; one per server; ``auto`` where Ray places them on their node).
    engine_devices: tuple[str, ...]
    #: Whether the policy's parameters are FSDP2-sharded over its Ray workers.
    sharded: bool
    #: The rollout correction (``algorithm.rollout_correction``, ``off_policy_correction``).
    correction: RolloutCorrection
    #: Each batch gets one optimizer step (its old logprobs are the update's own forward's).
    one_update_per_batch: bool
    #: The run has a critic (``algorithm.advantage_estimator`` reads values).
    trains_critic: bool
    #: The run joins or starts a Ray cluster (Ray workers, or Ray-placed engine servers).
    uses_ray: bool
    #: On a machine without CUDA, the trainer's and each reference server's torch threads.
    threads: CpuThreads | None
    timeouts: Timeouts
    #: The vLLM engine's settings (``engine.backend=vllm`` or ``vllm_inprocess``); else None.
    #: Its ``model`` is empty until the run has resolved ``model.path`` (``with_model``).
    vllm: VllmSettings | None
    #: ``sync.verify``'s tolerance (None in the config: by the policy's dtype).
    verify_tolerance: float
    #: How a LoRA policy reaches the engines (``sync.lora=adapter``: the adapter, served by
    #: name); None: full weights (full fine-tuning, or ``sync.lora=merged``).
    served_adapter: ServedAdapter | None = None
    #: The line a run logs at its start where the correction was chosen for it: fully-async
    #: with staleness and nothing chosen (``off_policy_correction=auto``); else None.
    correction_note: str | None = None
    #: The rewards take the KL to the reference model (``algorithm.use_kl_in_reward``): the
    #: old logprobs are read before the advantages.
    kl_in_reward: bool = False
    #: A reference model runs (a ref worker): ``algorithm.use_kl_loss`` or ``use_kl_in_reward``.
    uses_reference_model: bool = False

    @property
    def recomputes_old_logprobs(self) -> bool:
        """Whether the step runs a ``forward`` of the policy for the old logprobs before the
        update: not with ``bypass_mode`` (the rollout's are the old policy's), nor with one
        update per batch (the update's own forward has them) unless a rejection mask or the KL
        in the reward must read them before the advantages."""
        if self.correction.bypass_mode:
            return False
        early = self.correction.rollout_rs is not None or self.kl_in_reward
        return not self.one_update_per_batch or early


@attrs.frozen
class ServedAdapter:
    """``sync.lora=adapter``: the engines serve the policy's LoRA adapter by ``name`` (the
    completions' ``model``), loaded in place at each sync; started with ``--enable-lora
    --max-lora-rank max_rank`` (vLLM's smallest allowed rank that holds ``model.lora.rank``)."""

    name: str
    max_rank: int


#: The name the engines serve the policy's adapter under (``sync.lora=adapter``).
ADAPTER_SERVED_NAME = "policy"


def _served_adapter(cfg: Sections) -> ServedAdapter | None:
    """The adapter the engines serve, or None (full weights); ``ConfigError`` for an engine
    backend that cannot load one by route."""
    from engines.vllm.flags import max_lora_rank_for

    lora = cfg.model.lora
    if not lora.enabled or cfg.sync.lora != "adapter":
        return None
    backend = cfg.engine.backend
    if backend == "inprocess":
        raise ConfigError(
            "config: sync.lora='adapter' loads the adapter through each engine's "
            "/v1/load_lora_adapter, and engine.backend='inprocess' takes weights in memory "
            "only: use engine.backend=local, vllm, vllm_inprocess or remote, or sync.lora=merged"
        )
    try:
        max_rank = max_lora_rank_for(lora.rank)
    except ValueError as exc:
        raise ConfigError(
            f"config: model.lora.rank={lora.rank}: {exc}; use sync.lora=merged"
        ) from None
    return ServedAdapter(ADAPTER_SERVED_NAME, max_rank)


def plan_run(cfg: Sections, *, cuda: bool | None = None) -> RunPlan:
    """The plan of a validated ``cfg``; ``cuda``: whether this process sees CUDA (default:
    asks torch). ``ConfigError`` for a device this process (or the Ray cluster) cannot give."""
    import torch  # here, not at the config's import (``--help`` loads no torch)

    from sync.verify import DEFAULT_TOLERANCE, LOW_PRECISION_TOLERANCE

    cuda = torch.cuda.is_available() if cuda is None else cuda
    t, e, w = cfg.trainer, cfg.engine, cfg.workers
    strategy = Strategy(t.strategy)
    engine_backend = EngineBackend(e.backend)
    policy = _policy_placement(cfg, cuda)
    sharded = (
        w.backend == "ray"
        and w.num_policy_workers > 1
        and (w.data_parallel == "fsdp2" or (w.data_parallel == "auto" and policy.device == "cuda"))
    )
    served = _served_adapter(cfg)
    fully_async = strategy is Strategy.FULLY_ASYNC
    staleness = t.fully_async.max_staleness_steps if fully_async else 0
    tolerance = cfg.sync.verify_tolerance
    if tolerance is None:
        tolerance = DEFAULT_TOLERANCE.get(policy.dtype, LOW_PRECISION_TOLERANCE)
    return RunPlan(
        strategy=strategy,
        engine_backend=engine_backend,
        engine_placement=EnginePlacement(e.placement),
        worker_backend=WorkerBackend(w.backend),
        bracket=_bracket(cfg),
        transport=TRANSPORTS[cfg.sync.transport],
        policy=policy,
        engine_devices=_engine_devices(cfg, cuda),
        sharded=sharded,
        correction=plan_correction(cfg.algorithm, fully_async, staleness=staleness),
        correction_note=correction_note(cfg.algorithm, fully_async, staleness=staleness),
        one_update_per_batch=t.one_update_per_batch,
        kl_in_reward=cfg.algorithm.use_kl_in_reward,
        uses_reference_model=cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward,
        trains_critic=cfg.algorithm.trains_critic,
        uses_ray=w.backend == "ray" or e.placement == "ray",
        threads=None if cuda else cpu_threads(cfg),
        timeouts=Timeouts(
            step_s=t.step_timeout_s,
            weight_sync_s=t.weight_sync_timeout_s,
            control_plane_s=e.control_plane_timeout_s,
            engine_startup_s=_startup_timeout_s(cfg),
            collective_s=w.collective_timeout_s,
            group_init_s=cfg.sync.group_init_timeout_s,
        ),
        vllm=_vllm_settings(cfg, policy, cuda, served) if engine_backend.runs_vllm else None,
        verify_tolerance=tolerance,
        served_adapter=served,
    )


def _bracket(cfg: Sections) -> Bracket:
    """The engine bracket of the run's weight syncs (:meth:`sync.bracket.Bracket.of`): from
    engine.colocated, engine.offload_kv_for_weight_sync and whether rollouts go on during a
    sync (trainer.strategy=fully_async)."""
    return Bracket.of(
        colocated=cfg.engine.colocated,
        offload_kv=cfg.engine.offload_kv_for_weight_sync,
        rollouts_continue=cfg.trainer.strategy == "fully_async",
    )


def _policy_placement(cfg: Sections, cuda: bool) -> RoleDevice:
    """The policy's device and dtype. Local workers: this process's device. Ray workers:
    CUDA when each actor asks Ray for a GPU (``workers.gpus_per_worker``, or ``device=cuda``),
    the CPU when it asks for none; ``auto`` with neither set is this machine's answer for a
    cluster the run starts, and refused for a cluster it joins (the driver cannot see its
    workers' devices before it joins)."""
    import torch

    from engines.devices import resolve_device, resolve_dtype
    from engines.weight_transfer import dtype_name

    w = cfg.workers
    if w.backend == "local":
        device = resolve_device(w.device, key="workers.device")
        return RoleDevice(str(device), dtype_name(resolve_dtype(w.dtype, device)))
    gpus = w.gpus_per_worker
    if w.device == "cuda" or (w.device == "auto" and gpus):
        device_name = "cuda"
    elif w.device == "cpu" or gpus == 0:
        device_name = "cpu"
    elif w.ray_address is None:
        device_name = "cuda" if cuda else "cpu"
    else:
        raise ConfigError(
            f"config: workers.device='auto' with workers.ray_address={w.ray_address!r} cannot "
            "be decided before joining the cluster (the trainer and its workers must agree on "
            "the policy's device and dtype): set workers.device=cuda or cpu, or "
            "workers.gpus_per_worker"
        )
    device = torch.device(device_name)
    return RoleDevice(device_name, dtype_name(resolve_dtype(w.dtype, device)))


def _engine_devices(cfg: Sections, cuda: bool) -> tuple[str, ...]:
    """The reference engines' devices (``engine.device``, ``engine.gpu_ids``), checked here for
    the engines this process starts; Ray-placed servers resolve theirs on their node."""
    from engines.devices import resolve_device

    e = cfg.engine
    if e.backend not in ("local", "inprocess"):
        return ()
    if e.placement == "ray":
        return (e.device,)
    names = [f"cuda:{i}" for i in e.gpu_ids] if e.device == "cuda" and e.gpu_ids else [e.device]
    return tuple(str(resolve_device(name, key="engine.device")) for name in names)


def _startup_timeout_s(cfg: Sections) -> float:
    """``engine.startup_timeout_s``, or its default for the backend."""
    from engines.launch import DEFAULT_STARTUP_TIMEOUT_S
    from engines.vllm.async_llm import DEFAULT_VLLM_STARTUP_TIMEOUT_S

    e = cfg.engine
    if e.startup_timeout_s is not None:
        return e.startup_timeout_s
    if EngineBackend(e.backend).runs_vllm:
        return DEFAULT_VLLM_STARTUP_TIMEOUT_S
    return DEFAULT_STARTUP_TIMEOUT_S


def _vllm_settings(
    cfg: Sections, policy: RoleDevice, cuda: bool, served: ServedAdapter | None
) -> VllmSettings:
    """vLLM's engine settings: ``engine.*`` as given, the run's seed, sleep mode when the
    bracket sleeps, the transport, the policy's dtype (so vLLM serves what the policy trains:
    it would serve a float32 checkpoint in bfloat16 on the CPU), vLLM's CPU build where
    this process sees no CUDA, and LoRA where the engines serve the policy's adapter."""
    e = cfg.engine
    if not cuda and _bracket(cfg).sleeps:
        key = "engine.colocated" if e.colocated else "engine.offload_kv_for_weight_sync"
        raise ConfigError(
            f"config: {key}=true sleeps the engine during weight syncs, and vLLM on the CPU "
            "has no sleep mode (it refuses --enable-sleep-mode at start): unset it, or run "
            "vLLM on a GPU"
        )
    return VllmSettings(
        model="",
        tensor_parallel_size=e.tensor_parallel_size,
        gpu_memory_utilization=e.gpu_memory_utilization,
        seed=cfg.trainer.seed,
        enable_sleep_mode=_bracket(cfg).sleeps,
        weight_transfer_backend=cfg.sync.transport,
        extra_args=tuple(e.extra_args),
        dtype=policy.dtype,
        cpu=not cuda,
        max_lora_rank=served.max_rank if served is not None else None,
        logprobs_mode=ROLLOUT_LOGPROBS_MODE,
    )


def cpu_threads(cfg: Sections, cores: int | None = None) -> CpuThreads:
    """Share the cores between the trainer and the reference engine servers it starts.

    ``trainer.strategy=sync``: generation and training take turns, so the trainer gets every
    core while the servers idle, and the servers split the cores while the trainer waits (a
    135M-parameter model trains 1.7x faster on two threads than on one here). Fully-async:
    the servers roll out while the trainer trains, so each server keeps one thread and the
    trainer the rest (a thread that must wait for a core makes each small forward pass many
    times slower). Other backends: the servers are not the trainer's to size.

    The cores to share are :func:`engines.cpu_share.available_cores`: ``OMP_NUM_THREADS``
    where it is set (the test suite's two workers set it), else the process's CPU affinity.
    These are the most each uses: on a machine shared with other processes the trainer and
    the servers use fewer while they wait for cores (:class:`engines.cpu_share.CpuShare`).
    """
    cores = cores or available_cores()
    servers = cfg.engine.num_engines if cfg.engine.backend == "local" else 0
    if cfg.trainer.strategy == "sync":
        return CpuThreads(trainer=cores, server=max(1, cores // max(1, servers)))
    return CpuThreads(trainer=max(1, cores - servers), server=1)
