"""Weight-sync transfer time vs the raw gloo bandwidth, and the event loop's stall during it.

::

    python benchmarks/weight_sync.py [--hidden 512 1024] [--layers 9] [--repeats 10]
        [--bucket-mb 256] [--unpacked]

For each model size (Qwen2 configs built locally from the tiny model's tokenizer), in one
process and one sitting, with policy rank 0 in this process and one reference server in its
own:

1. two warm-up syncs (the engine's two staging pools are touched for the first time: their
   times are printed as the cold syncs);
2. ``--repeats`` rounds, each of them back to back:
   - **raw**: a plain gloo broadcast of one float32 tensor of the model's total size, from
     this process to a child process kept for the whole run (the same transport, no
     protocol, no flattening);
   - **transfer**: ``sync_weights`` over ``sync.transport=gloo`` (vLLM's ``nccl``
     messages, packed unless ``--unpacked``) to the reference server (pause -> four-phase
     routes + gloo broadcast -> resume), reported as ``sync/last_weight_sync_seconds`` (the
     transfer alone), with the loop's longest stall (``StallInstrument``, the same one
     behind ``loop/max_stall_ms``) while it ran;
3. **blocking baseline**: the same transfer driven from another thread while the loop waits
   on it inline (``future.result()`` inside ``async def``, as a blocking ``ray.get`` does).

Raw and transfer alternate, so a change of the shared machine's load falls on both; the
ratio is the median raw time over the median transfer time (and, beside it, best over
best). Goals (issue 16, point 6): for a model of at least 100M parameters, transfer >= 70%
of the raw bandwidth; max stall <= 5 ms (the worst over the rounds; the baseline stalls
for the whole transfer). The last lines print the goal table as Markdown, with the
machine's load.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.client import InferenceClient
from engines.launch import launch_local_engines
from engines.models import build_tiny_model, quiet_transformers
from engines.process_group import free_port, join_group
from sync.transports.broadcast import BroadcastTransport
from sync.weights import sync_weights
from trainer.debug import StallInstrument
from trainer.workers.local import LocalWorkerGroup

_RECEIVER = """
import sys, torch
from engines.process_group import join_group
n, port, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
h = join_group("raw", master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
               store_timeout_s=300)
buf = torch.empty(n)
for _ in range(repeats + 1):
    h.broadcast(buf)
"""


def build_model(hidden: int, layers: int, root: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    quiet_transformers()
    tiny = build_tiny_model()
    cfg = Qwen2Config.from_pretrained(tiny)
    cfg.hidden_size = hidden
    cfg.intermediate_size = hidden * 3
    cfg.num_attention_heads = max(1, hidden // 64)
    cfg.num_key_value_heads = max(1, hidden // 128)
    cfg.num_hidden_layers = layers
    cfg.layer_types = ["full_attention"] * layers
    target = root / f"qwen2-h{hidden}-l{layers}"
    Qwen2ForCausalLM(cfg).save_pretrained(target, safe_serialization=True)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, target / f.name)
    return target


class RawPeer:
    """This process as rank 0 of a plain two-rank gloo group with a child process that
    receives ``rounds`` broadcasts of ``numel`` float32 (blocking methods: call from a thread)."""

    def __init__(self, numel: int, rounds: int) -> None:
        port = free_port()
        self.child = subprocess.Popen(
            [sys.executable, "-c", _RECEIVER, str(numel), str(port), str(rounds)],
            cwd=Path(__file__).resolve().parent.parent,
        )
        self.group = join_group(
            "raw",
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            store_timeout_s=300,
        )
        self.buf = torch.ones(numel)

    def broadcast_seconds(self) -> float:
        t0 = time.perf_counter()
        self.group.broadcast(self.buf)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.child.wait(timeout=120)


class _ThreadWorkers:
    """Rank 0 run inline in the calling thread, without the group's trio limiter (another trio run)."""

    def __init__(self, workers: LocalWorkerGroup) -> None:
        self.model = workers.policy.model

    async def run_on_rank0(self, fn, *args, abandon_on_cancel: bool = False):
        return await trio.to_thread.run_sync(fn, self.model, *args)


async def measure(
    model_dir: Path, bucket_mb: int, repeats: int, logs: Path, packed: bool
) -> dict[str, float]:
    workers = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    numel = sum(p.numel() for p in workers.policy.model.parameters())
    stall = StallInstrument()
    trio.lowlevel.add_instrument(stall)
    out: dict[str, float] = {"params_m": numel / 1e6, "mb": numel * 4 / 2**20}
    # the child receives one warm-up broadcast (connections, page faults), then one a round
    raw = await trio.to_thread.run_sync(RawPeer, numel, repeats)
    try:
        await trio.to_thread.run_sync(raw.broadcast_seconds)
        async with launch_local_engines(1, model_dir, logs, startup_timeout_s=300) as urls:
            async with InferenceClient(urls, api_key=urls.api_key) as client:
                transport = BroadcastTransport(
                    bucket_mb * 2**20, group_init_timeout_s=300, packed=packed
                )
                await transport.init(client, workers)
                for name in ("cold1_s", "cold2_s"):  # both staging pools, first touched
                    r = await sync_weights(client, workers, transport)
                    out[name] = r["sync/last_weight_sync_seconds"]
                raws, transfers, worst_stall = [], [], 0.0
                for _ in range(repeats):
                    raws.append(await trio.to_thread.run_sync(raw.broadcast_seconds))
                    stall.take_max_ms()
                    r = await sync_weights(client, workers, transport)
                    transfers.append(r["sync/last_weight_sync_seconds"])
                    worst_stall = max(worst_stall, stall.take_max_ms())
                out["raw_s"], out["raw_best_s"] = statistics.median(raws), min(raws)
                out["transfer_s"], out["transfer_best_s"] = (
                    statistics.median(transfers),
                    min(transfers),
                )
                out["stall_ms"] = worst_stall

                def blocking() -> None:
                    async def main() -> None:
                        async with InferenceClient(urls, api_key=urls.api_key) as c:
                            await transport.transfer(c, _ThreadWorkers(workers))

                    trio.run(main)

                base_best, base_stall = float("inf"), 0.0
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    for _ in range(min(repeats, 3)):
                        await client.pause("keep")
                        stall.take_max_ms()
                        t0 = time.perf_counter()
                        pool.submit(blocking).result()  # the loop waits inline (ray.get-style)
                        base_best = min(base_best, time.perf_counter() - t0)
                        await trio.lowlevel.checkpoint()  # let the instrument see the stall
                        base_stall = max(base_stall, stall.take_max_ms())
                        await client.resume()
                out["baseline_s"], out["baseline_stall_ms"] = base_best, base_stall
    finally:
        trio.lowlevel.remove_instrument(stall)
        await trio.to_thread.run_sync(raw.close)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description="weight-sync transfer vs raw gloo bandwidth, and loop stalls"
    )
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--layers", type=int, default=9, help="decoder layers (9 at 1024: 113M)")
    ap.add_argument("--repeats", type=int, default=10, help="rounds of raw + transfer")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--unpacked", action="store_true", help="vLLM's packed=false")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="weight-sync-bench-"))
    load = os.getloadavg()
    mode = "packed" if not args.unpacked else "unpacked"
    print(
        f"{'hidden':>6} {'params':>8} {'MB':>7} {'raw s':>7} {'xfer s':>7} {'% raw':>6} "
        f"{'best %':>6} {'stall ms':>8} {'cold s':>11} {'base s':>7} {'base stall ms':>13}"
    )
    rows = []
    try:
        for hidden in args.hidden:
            model_dir = build_model(hidden, args.layers, root)
            r = trio.run(
                measure, model_dir, args.bucket_mb, args.repeats, root / "logs", not args.unpacked
            )
            ratio, best = r["raw_s"] / r["transfer_s"], r["raw_best_s"] / r["transfer_best_s"]
            print(
                f"{hidden:>6} {r['params_m']:>7.1f}M {r['mb']:>7.1f} {r['raw_s']:>7.3f} "
                f"{r['transfer_s']:>7.3f} {100 * ratio:>5.0f}% {100 * best:>5.0f}% "
                f"{r['stall_ms']:>8.1f} {r['cold1_s']:>5.2f}/{r['cold2_s']:<5.2f} "
                f"{r['baseline_s']:>7.3f} {r['baseline_stall_ms']:>13.1f}",
                flush=True,
            )
            rows.append(r)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    end_load = os.getloadavg()
    print(
        f"\n{datetime.date.today()}, {os.cpu_count()} CPUs, load average (1/5/15 min) "
        f"{load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f} at the start, "
        f"{end_load[0]:.2f}/{end_load[1]:.2f}/{end_load[2]:.2f} at the end; "
        f"{mode}, bucket {args.bucket_mb} MB, {args.repeats} rounds (medians; best in brackets)\n"
    )
    print("| model | transfer | transfer GB/s | raw gloo GB/s | ratio | longest stall |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        gb = r["mb"] / 1024
        print(
            f"| {r['params_m']:.0f}M params ({r['mb']:.0f} MB fp32) | {mode} | "
            f"{gb / r['transfer_s']:.2f} ({gb / r['transfer_best_s']:.2f}) | "
            f"{gb / r['raw_s']:.2f} ({gb / r['raw_best_s']:.2f}) | "
            f"{100 * r['raw_s'] / r['transfer_s']:.0f}% "
            f"({100 * r['raw_best_s'] / r['transfer_best_s']:.0f}%) | {r['stall_ms']:.1f} ms |"
        )


if __name__ == "__main__":
    main()
