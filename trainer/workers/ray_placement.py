"""How the Ray worker group is laid out: what each actor asks Ray for and the placement
group's bundles (:func:`gpus_for`, :func:`bundles`), and how a batch is cut among the ranks
(:func:`shards`, :func:`padded_shard`: FSDP2 ranks must run the same passes)."""

from __future__ import annotations

import ray

from trainer.workers.batch import TrainBatch

__all__ = ["bundles", "gpus_for", "padded_shard", "shards"]


def gpus_for(requested: float | None, device: str) -> float:
    """GPUs each actor asks Ray for: ``requested``, or (None) 1 for ``device=cuda``, 1 for
    ``auto`` on a cluster with GPUs, else 0 (asks the cluster: off the trio thread)."""
    if requested is not None:
        return requested
    if device == "cuda":
        return 1.0
    if device == "auto" and ray.cluster_resources().get("GPU", 0) > 0:
        return 1.0
    return 0.0


def bundles(num_workers: int, gpus: float, with_ref: bool) -> list[dict[str, float]]:
    """The placement group's bundles: one per policy rank (a CPU, and ``gpus`` GPUs), and,
    when the reference model is on GPUs, one more for it (its GPUs alone: it computes
    between the policy's passes, never beside them). So the whole worker group is placed
    at once, or not at all (``pg.ready()`` says so), never a policy without its reference."""
    rank: dict[str, float] = {"CPU": 1.0, **({"GPU": gpus} if gpus else {})}
    return [rank] * num_workers + ([{"GPU": gpus}] if with_ref and gpus else [])


def shards(n: int, world: int) -> list[slice]:
    """Contiguous row ranges, one per rank (the first ``n % world`` ranks get one more)."""
    base, extra = divmod(n, world)
    out, start = [], 0
    for r in range(world):
        size = base + (1 if r < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


def padded_shard(batch: TrainBatch, rows: slice, size: int) -> TrainBatch:
    """``batch``'s ``rows``, padded to ``size`` rows with copies of row 0 whose loss mask is 0."""
    real = list(range(rows.start, rows.stop))
    part = batch.select(real + [0] * (size - len(real)))
    part.loss_mask[len(real) :] = 0.0
    return part
