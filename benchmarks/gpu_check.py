"""The one-command GPU check (issue 16): ``just gpu-check``, at most about 6 minutes on one GPU.

::

    .venv/bin/python benchmarks/gpu_check.py [--steps 3] [--reward-steps 40] [--out DIR] [--vllm]

What it does, on ``cuda:0``, in one sitting:

0. **CUDA-only tests**: ``pytest tests/gpu`` (skipped on a CPU machine, run here).
1. **Ceiling**: a device-to-device copy of a 4 GB buffer (GB/s).
2. **Model**: builds a random-init Qwen2-architecture model of about 0.5B parameters locally
   (no download: the built-in tokenizer, 28 layers of width 1024, bfloat16 safetensors).
3. **Generation**: HF ``generate`` of 128 prompts x 32 new tokens (one batched call) against
   the reference engine on CUDA (``LocalEngine``, in process) on the same requests: tok/s.
4. **Training on one GPU**: ``python -m trainer`` on that model, ``--steps`` steps, the
   policy and the reference engine on the same GPU, ``sync.transport=ipc``; twice, with the
   engine colocated (``engine.colocated=true``: the policy offloads while the engine works)
   and without. From ``metrics.jsonl``: each stage's median, the transfer's GB/s after the
   first sync, the whole sync's time, the loop's longest stall during it; from
   ``nvidia-smi``, polled, the peak GPU memory of each run.
5. **Learning**: the default task with the built-in tiny model on the GPU for
   ``--reward-steps`` steps: the reward over the first and last 20% of steps.

6. **vLLM** (``--vllm``, issue 11; needs ``vllm`` importable, else it says so and exits 1):
   ``--steps`` steps on the same model with ``engine.backend=vllm`` (``vllm serve`` started
   by the trainer on the same GPU, ``sync.transport=ipc``, colocated) and with
   ``engine.backend=vllm_inprocess``; their sync numbers join the table (a run that fails is
   a failure of the check).

Prints one table with each goal next to what was measured; exits 1 on any error
(a run that fails, a missing GPU) and 2 when it ran but a goal was missed.

Not in a stock PyTorch GPU image (which has torch and numpy): trio, trio-asyncio, httpx,
attrs, omegaconf, pyyaml, rich, hypercorn, pytest, pytest-trio, and often transformers,
tokenizers and safetensors (pyproject.toml's dependencies; Ray is not needed here, and its wheel is large).
Without network on the GPU machine, download them on a connected machine of the same Python
(``pip download -d wheels trio trio-asyncio httpx attrs omegaconf pyyaml rich hypercorn
pytest pytest-trio transformers tokenizers safetensors``), copy ``wheels/`` over, then
``pip install --no-index --find-links wheels`` with the same names, and run this file from
the checkout.

Verified: ran on one NVIDIA H200 on 2026-12-04 (158 s, without ``--vllm``); its table is in
docs/performance.md ("GPU"). ``--vllm`` has not run on a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engines.local.engine import open_local_engine  # noqa: E402
from engines.models import build_tiny_model, load_tokenizer  # noqa: E402
from engines.types import SamplingParams  # noqa: E402

#: About 0.5B parameters with the built-in tokenizer's small vocabulary.
HALF_B: dict[str, Any] = dict(
    hidden_size=1024,
    intermediate_size=4864,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
GOALS = {
    "ipc transfer after the first sync (GB/s)": (">=", 200.0),
    "whole weight sync (ms)": ("<=", 30.0),
    "loop's longest stall during the sync (ms)": ("<=", 2.0),
    "reference engine / HF generate (tok/s ratio)": (">=", 1.0),
    "reward, last 20% minus first 20%": (">", 0.0),
}


def copy_ceiling(gb: float = 4.0) -> float:
    """GB/s of one device-to-device copy of a ``gb`` buffer (best of 5)."""
    n = int(gb * 1e9)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return n / best / 1e9


def build_half_b(out: Path) -> tuple[Path, int]:
    """The 0.5B model directory (random init, bf16) and its parameter bytes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tiny = build_tiny_model()
    base = json.loads((tiny / "config.json").read_text())
    keep = ("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id")
    cfg = Qwen2Config(**{k: base[k] for k in keep}, **HALF_B)
    torch.manual_seed(0)
    model: Any = Qwen2ForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(out, safe_serialization=True)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return out, nbytes


def requests(vocab: int, n: int = 128) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(4, vocab, (8 + i % 8,), generator=gen).tolist() for i in range(n)]


def hf_generate_tok_s(model_dir: Path, prompts: list[list[int]], new: int) -> float:
    """One batched HF ``generate`` (left-padded, sampling, exactly ``new`` tokens each)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.cuda().eval()
    pad = int(load_tokenizer(model_dir).pad_token_id)
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = (ids != pad).long()
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, pad_token_id=pad)
    model.generate(input_ids=ids[:8], attention_mask=mask[:8], **kwargs)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return len(prompts) * new / seconds


async def engine_tok_s(model_dir: Path, prompts: list[list[int]], new: int) -> float:
    """The reference engine on CUDA, every request in flight at once."""
    params = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True)
    async with open_local_engine(model_dir, device="cuda") as engine:
        await engine.generate(prompts[0], params)  # warm-up
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for p in prompts:
                nursery.start_soon(engine.generate, p, params)
        seconds = time.perf_counter() - t0
    torch.cuda.empty_cache()
    return len(prompts) * new / seconds


class MemoryPeak:
    """The largest ``memory.used`` of GPU 0 that ``nvidia-smi`` reports while running."""

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"]
        while not self._stop.is_set():
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
            except OSError:  # no nvidia-smi on this machine: the device-wide use CUDA reports
                free, total = torch.cuda.mem_get_info(0)
                out = str((total - free) / 2**20)
            if out.strip():
                self.peak_mb = max(self.peak_mb, float(out.split()[0]))
            self._stop.wait(0.2)

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def train(run_dir: Path, *args: str) -> tuple[list[dict], dict, float]:
    """``python -m trainer`` on the GPU: (metrics rows, summary, peak GPU memory in MB)."""
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "trainer.progress=false",
        "workers.device=cuda",
        "engine.device=cuda",
        "engine.num_engines=1",
        "sync.transport=ipc",
        f"trainer.run_dir={run_dir}",
        *args,
    ]
    with MemoryPeak() as memory:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return rows, summary, memory.peak_mb


def sync_numbers(rows: list[dict], nbytes: int) -> dict[str, float]:
    """After the first sync: transfer GB/s, whole sync ms, longest loop stall ms (medians)."""
    later = [r for r in rows if r["step"] > 1 and "sync/last_weight_sync_seconds" in r]
    if not later:
        raise RuntimeError("no weight sync after the first step: run more steps")
    return {
        "transfer_gb_s": statistics.median(
            nbytes / r["sync/last_weight_sync_seconds"] / 1e9 for r in later
        ),
        "sync_ms": statistics.median(r["timing/sync_weights"] * 1e3 for r in later),
        "stall_ms": max(r["sync/max_stall_ms"] for r in later),
    }


def stages(rows: list[dict]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r if k.startswith("timing/")})
    return {k: statistics.median(r[k] for r in rows if k in r) * 1e3 for k in keys}


#: ``--vllm``: each backend's run must train every step; its sync numbers are reported.
VLLM_GOALS = {
    f"{backend}: {what}": goal
    for backend in ("vllm", "vllm_inprocess")
    for what, goal in (
        ("steps trained", (">=", 3.0)),
        ("whole weight sync (ms)", ("<=", 1000.0)),
        ("ipc transfer after the first sync (GB/s)", (">", 0.0)),
    )
}


def vllm_runs(out: Path, nbytes: int, steps: tuple[str, ...]) -> dict[str, float]:
    """``--steps`` steps with vLLM serving on the same GPU (ipc, colocated), both backends."""
    measured: dict[str, float] = {}
    for backend in ("vllm", "vllm_inprocess"):
        rows, _, peak_mb = train(
            out / backend,
            *steps,
            f"engine.backend={backend}",
            "engine.colocated=true",
            "engine.gpu_memory_utilization=0.3",
        )
        numbers = sync_numbers(rows, nbytes)
        print(f"{backend}: {len(rows)} steps, peak GPU memory {peak_mb:.0f} MB, stages (ms):")
        for k, v in stages(rows).items():
            print(f"  {k:40s} {v:10.1f}")
        measured[f"{backend}: steps trained"] = float(len(rows))
        measured[f"{backend}: whole weight sync (ms)"] = numbers["sync_ms"]
        measured[f"{backend}: ipc transfer after the first sync (GB/s)"] = numbers["transfer_gb_s"]
    return measured


def met(value: float, how: str, goal: float) -> bool:
    return {">=": value >= goal, "<=": value <= goal, ">": value > goal}[how]


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reward-steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here")
    ap.add_argument("--vllm", action="store_true", help="also train 3 steps with vLLM (issue 11)")
    args = ap.parse_args()
    if args.vllm and importlib.util.find_spec("vllm") is None:
        print("gpu-check --vllm: vllm is not importable here; `pip install vllm==0.33.0`")
        return 1
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible; run it on a machine with a GPU")
        return 1
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0)
    print(f"gpu-check on {gpu}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")

    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
        cwd=REPO,
        check=False,
    )
    if tests.returncode != 0:
        print("gpu-check: the CUDA-only tests failed (above)")
        return 1
    ceiling = copy_ceiling()
    model_dir, nbytes = build_half_b(out / "qwen2-0.5b")
    print(f"model: {nbytes / 1e9:.2f} GB of bf16 parameters; d2d copy {ceiling:.0f} GB/s")
    prompts = requests(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    hf = hf_generate_tok_s(model_dir, prompts, 32)
    ref = trio.run(engine_tok_s, model_dir, prompts, 32)
    print(f"generate 128 x 32: HF {hf:.0f} tok/s, reference engine {ref:.0f} tok/s")

    steps = (f"trainer.max_steps={args.steps}", f"model.path={model_dir}")
    plain, _, plain_mb = train(out / "plain", *steps)
    colocated, _, colocated_mb = train(out / "colocated", *steps, "engine.colocated=true")
    numbers = sync_numbers(plain, nbytes)
    _, summary, _ = train(out / "reward", f"trainer.max_steps={args.reward_steps}")
    rise = summary["reward/last_20pct"] - summary["reward/first_20pct"]

    print("\nstage medians (ms), plain run:")
    for k, v in stages(plain).items():
        print(f"  {k:40s} {v:10.1f}")
    offloaded = max((r.get("workers/offload_bytes", 0) for r in colocated), default=0)
    print(f"peak GPU memory: {plain_mb:.0f} MB plain, {colocated_mb:.0f} MB colocated with")
    print(f"  offload ({offloaded / 1e9:.2f} GB offloaded per step)")
    print(f"ipc transfer {numbers['transfer_gb_s']:.1f} GB/s vs d2d copy {ceiling:.0f} GB/s")
    if args.vllm:
        measured_vllm = vllm_runs(out, nbytes, steps)
    measured = {
        "ipc transfer after the first sync (GB/s)": numbers["transfer_gb_s"],
        "whole weight sync (ms)": numbers["sync_ms"],
        "loop's longest stall during the sync (ms)": numbers["stall_ms"],
        "reference engine / HF generate (tok/s ratio)": ref / hf,
        "reward, last 20% minus first 20%": rise,
    }
    goals = dict(GOALS)
    if args.vllm:
        measured.update(measured_vllm)
        goals.update(VLLM_GOALS)
    print("\n| goal | target | measured | met |\n|---|---|---|---|")
    missed = 0
    for name, (how, goal) in goals.items():
        ok = met(measured[name], how, goal)
        missed += not ok
        print(f"| {name} | {how} {goal:g} | {measured[name]:.3g} | {'yes' if ok else 'NO'} |")
    print(f"\nruns kept in {out}")
    return 2 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
