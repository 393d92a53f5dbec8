"""The ``workers`` section: where the policy and reference workers run, on what device, how sharded.

Re-exported by :mod:`trainer.config._schema` (``WorkersConfig``); see docs/gpus.md for the
device keys and docs/scaling.md for Ray.
"""

from __future__ import annotations

from typing import Literal

import attrs

from trainer.config._fields import at_least, positive
from trainer.config._fields import config_field as _field

__all__ = ["WorkersConfig"]


@attrs.define
class WorkersConfig:
    backend: Literal["local", "ray"] = _field(
        "local",
        "Where policy/ref workers run: 'local' (threads in this process) or 'ray' (Ray actors, "
        "data parallel over num_policy_workers; see docs/scaling.md).",
    )
    num_policy_workers: int = _field(
        1,
        "Data-parallel policy workers (backend=ray; the local backend runs exactly one).",
        check=at_least(1),
    )
    ray_address: str | None = _field(
        None,
        "workers.backend=ray or engine.placement=ray: the cluster to join ('auto' or "
        "HOST:PORT); None starts a local cluster for this run and stops it at exit.",
    )
    ray_init_retries: int = _field(
        3,
        "workers.backend=ray or engine.placement=ray: extra attempts to start the local "
        "cluster when ray.init fails (cluster start-up only; never retries a step).",
        check=at_least(0),
    )
    collective_timeout_s: float = _field(
        1800.0,
        "Timeout of torch.distributed collectives (the process group's own watchdog).",
        check=positive,
    )
    device: Literal["auto", "cpu", "cuda"] = _field(
        "auto",
        "Where the policy and reference models, their optimizer state and batches live: "
        "'auto' is CUDA when this process sees a GPU (Ray workers: when each asks Ray for one, "
        "workers.gpus_per_worker; on a cluster the run joins, set one of the two), else the "
        "CPU; 'cuda' fails at load, saying what to do, where there is none (docs/gpus.md).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = _field(
        "auto",
        "Parameter dtype of the policy and reference models: 'auto' is bfloat16 on CUDA and "
        "float32 on the CPU (logprobs are computed in float32 either way).",
    )
    gradient_checkpointing: bool = _field(
        False,
        "Recompute each layer's activations in the backward pass (activation checkpointing): "
        "less memory for longer sequences, about a third more compute.",
    )
    gpus_per_worker: float | None = _field(
        None,
        "backend=ray: GPUs each policy actor (and the reference actor) asks Ray for; None: 1 "
        "when workers.device=cuda, or auto where the cluster the run starts has GPUs, else 0. "
        "A fraction shares a GPU between actors.",
        check=at_least(0),
    )
    data_parallel: Literal["auto", "replicate", "fsdp2"] = _field(
        "auto",
        "backend=ray with num_policy_workers > 1: 'fsdp2' shards parameters, gradients and "
        "optimizer state over the ranks with PyTorch's FSDP2 (fully_shard); 'replicate' keeps "
        "the whole model on every rank and all-reduces gradients; 'auto' is fsdp2 on CUDA, "
        "replicate on the CPU. Checkpoints of a sharded policy are not supported yet.",
    )
