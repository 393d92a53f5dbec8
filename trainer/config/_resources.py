"""What a config may start, bounded at load by what the machine has (DESIGN 8).

:func:`check_resources` refuses, in one line saying the limit, what the machine has and how
to proceed, a key that would start more than the machine can hold: engine servers and their
tensor-parallel ranks, reward worker processes and local Ray policy workers (each against
``trainer.max_processes_per_core`` times the CPUs this process may use), vLLM engines on
CUDA (against the GPUs this process sees), requests in flight (against the open-file
limit), a ``trainer.run_dir`` that cannot be made, and what a Ray cluster would start, whose size is unknown at load (against a
generous absolute cap). Oversubscribing the cores on purpose is one key away:
``trainer.max_processes_per_core``.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from trainer.config._config import Config
from trainer.config._plan import RunPlan
from trainer.errors import ConfigError

__all__ = ["RAY_CAP", "check_resources", "usable_cpus"]

#: The most engines or policy workers a run may ask of a Ray cluster, whose size the config
#: load cannot know (a cluster of 128 nodes with 8 GPUs each holds 1024 one-GPU actors).
RAY_CAP = 1024
#: The most rollout tasks ``generator.num_parallel_workers`` may run at once: each holds a
#: prompt group's trajectories in memory, and no engine serves that many groups at once.
MAX_PARALLEL_ROLLOUTS = 4096


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; the machine's count where there is
    none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _open_file_limit() -> int | None:
    """The soft limit on open files (None: unlimited or unknown)."""
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _local_processes(cfg: Config, plan: RunPlan) -> list[tuple[str, int, str]]:
    """(key, processes it starts on this machine, what they are) for each key that starts
    processes here."""
    e, w = cfg.engine, cfg.workers
    found = [("data.reward_workers", cfg.data.reward_workers, "reward worker processes")]
    if plan.engine_backend.starts_servers and e.placement == "process":
        ranks = e.num_engines * e.tensor_parallel_size
        what = "engine server processes" + (
            f" ({e.num_engines} x engine.tensor_parallel_size={e.tensor_parallel_size})"
            if e.tensor_parallel_size > 1
            else ""
        )
        found.append(("engine.num_engines", ranks, what))
    if w.backend == "ray" and w.ray_address is None:  # a cluster started on this machine
        found.append(("workers.num_policy_workers", w.num_policy_workers, "Ray policy actors"))
    return found


def _check_cpus(cfg: Config, plan: RunPlan, cpus: int) -> None:
    per_core = cfg.trainer.max_processes_per_core
    limit = per_core * cpus
    for key, count, what in _local_processes(cfg, plan):
        if count > limit:
            raise ConfigError(
                f"config: {key}={_value_of(cfg, key)} is out of range: it starts {count} "
                f"{what} on this machine, which has {cpus} usable CPUs, and the limit is "
                f"{limit} (trainer.max_processes_per_core={per_core} per CPU): lower it, or "
                "raise trainer.max_processes_per_core to oversubscribe on purpose"
            )


def _check_gpus(cfg: Config, plan: RunPlan, gpus: int) -> None:
    """vLLM engines on CUDA that the trainer starts here take ``tensor_parallel_size`` GPUs
    each: no more than it sees (or than ``engine.gpu_ids`` names)."""
    e = cfg.engine
    if plan.vllm is None or plan.vllm.cpu or e.placement != "process" or e.backend != "vllm":
        return
    needed = e.num_engines * e.tensor_parallel_size
    have, which = (len(e.gpu_ids), "engine.gpu_ids names") if e.gpu_ids else (gpus, "it sees")
    if needed > have:
        raise ConfigError(
            f"config: engine.num_engines={e.num_engines} is out of range: "
            f"{e.num_engines} vLLM engines x engine.tensor_parallel_size="
            f"{e.tensor_parallel_size} need {needed} GPUs, and this machine has {have} "
            f"({which}): lower engine.num_engines, or place them with engine.placement=ray"
        )


def _check_ray(cfg: Config) -> None:
    e, w = cfg.engine, cfg.workers
    for key, count, asked in (
        ("engine.num_engines", e.num_engines, e.placement == "ray"),
        ("workers.num_policy_workers", w.num_policy_workers, w.backend == "ray"),
    ):
        if asked and count > RAY_CAP:
            raise ConfigError(
                f"config: {key}={count} is out of range: the Ray cluster's size is unknown "
                f"at load, so a run may ask it for at most {RAY_CAP}; lower it"
            )


def _check_concurrency(cfg: Config, open_files: int | None) -> None:
    g, e = cfg.generator, cfg.engine
    if open_files is not None and e.max_concurrency > open_files:
        raise ConfigError(
            f"config: engine.max_concurrency={e.max_concurrency} is out of range: each request "
            f"in flight holds a socket, and this process may open {open_files} files "
            "(ulimit -n): lower it, or raise the limit (ulimit -n) first"
        )
    if g.num_parallel_workers > MAX_PARALLEL_ROLLOUTS:
        raise ConfigError(
            f"config: generator.num_parallel_workers={g.num_parallel_workers} is out of range: "
            f"at most {MAX_PARALLEL_ROLLOUTS} rollout tasks (each holds a prompt group in "
            f"memory; engine.max_concurrency={e.max_concurrency} requests run at once): lower it"
        )


def _value_of(cfg: Config, key: str) -> object:
    """The value of dotted ``key`` in ``cfg``."""
    value: object = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _check_run_dir(cfg: Config) -> None:
    """``trainer.run_dir`` is a folder the run can make or use: not a file, under a folder
    (not a file) this user may write in."""
    if cfg.trainer.run_dir is None:
        return
    run_dir = Path(cfg.trainer.run_dir)
    key = f"config: trainer.run_dir={cfg.trainer.run_dir!r}"
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{key} is not a folder: give a folder's path")
    ancestor = run_dir.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{key} cannot be made: {ancestor} is not a folder")
    if not run_dir.exists() and not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{key} cannot be made: {ancestor} is not writable by this user")


def check_resources(
    cfg: Config,
    plan: RunPlan,
    *,
    cpus: int | None = None,
    gpus: int | None = None,
    open_files: int | None = -1,
) -> None:
    """``ConfigError`` (one line: the limit, what the machine has, how to proceed) where
    ``cfg`` would start more than this machine can hold; see the module docstring.

    ``cpus``, ``gpus`` and ``open_files`` stand in for the machine's (tests); by default
    :func:`usable_cpus`, the GPUs torch sees (asked only where vLLM runs on CUDA) and the
    soft open-file limit. Blocking only in that torch may look for GPUs.
    """
    _check_run_dir(cfg)
    _check_cpus(cfg, plan, usable_cpus() if cpus is None else cpus)
    if plan.vllm is not None and not plan.vllm.cpu:
        _check_gpus(cfg, plan, _visible_gpus() if gpus is None else gpus)
    _check_ray(cfg)
    _check_concurrency(cfg, _open_file_limit() if open_files == -1 else open_files)
