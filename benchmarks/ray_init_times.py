"""How long ``ray.init`` takes to start a local cluster here, over N fresh tries.

Usage: ``python benchmarks/ray_init_times.py N [plain|fixed]``. ``plain`` is ``ray.init()``
with Ray's defaults; ``fixed`` is how the trainer starts its cluster
(:func:`trainer.workers.ray_cluster.init_kwargs`). Each try is a fresh process so no state
carries over; failures are counted, not retried.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import sys, time
mode = sys.argv[1]
import ray
if mode != "plain":
    from trainer.workers.ray_cluster import init_kwargs, prepare_env
t0 = time.monotonic()
try:
    if mode == "plain":
        ray.init(num_cpus=2, log_to_driver=False)
    else:
        prepare_env()
        ray.init(**init_kwargs(None))
    print("OK", time.monotonic() - t0)
except Exception as exc:
    print("FAIL", time.monotonic() - t0, type(exc).__name__, str(exc)[:200].replace("\n", " "))
finally:
    ray.shutdown()
"""


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    mode = sys.argv[2] if len(sys.argv) > 2 else "fixed"
    times, fails = [], []
    for _ in range(n):
        out = (
            subprocess.run(
                [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=180
            )
            .stdout.strip()
            .splitlines()
        )
        line = out[-1] if out else "FAIL nan no-output"
        kind, secs, *_rest = line.split(" ", 2)
        (times if kind == "OK" else fails).append(float(secs))
        print(line, flush=True)
        time.sleep(1)
    summary = {
        "mode": mode,
        "tries": n,
        "failures": len(fails),
        "ok_s": sorted(round(t, 2) for t in times),
        "median_s": round(statistics.median(times), 2) if times else None,
        "max_s": round(max(times), 2) if times else None,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
