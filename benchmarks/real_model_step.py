"""The SmolLM2 recipe's step, stage by stage, beside a plain GRPO loop on the same batch.

::

    python benchmarks/real_model_step.py [--steps 8] [-- key=value ...]

Runs, in one sitting and each in a fresh child process (so each peak RSS is that process's
own, the model and torch included):

1. **the trainer**: ``python -m trainer --config examples/smollm2_addition.yaml`` for
   ``--steps`` steps without evals (and any ``key=value`` given after ``--``), exactly as a
   user starts it through the reference engine; its ``metrics.jsonl`` gives each ``timing/*``
   stage and ``memory/peak_rss_gb`` (the trainer process's; the engine server is a process of
   its own and is reported beside it, read from ``/proc`` while the run goes);
2. **the plain loop**: what a user would write in one file with transformers alone: the same
   prompts (the recipe's first ``--steps`` batches of 8, 4 samples each, at most 10 new tokens,
   temperature 1), one batched ``model.generate`` per step, the recipe's reward, group-mean
   advantages (GRPO), and one AdamW update of the token-mean policy-gradient loss on the full
   logits (what a loop without the trainer's fused head computes), gradients clipped at 1.0,
   with torch's default thread pool. No reference engine, no weight sync, no checkpoint.

Prints the median of each stage over the steps after the first (which pays for warm-up) on
both sides, the ratio of the trainer's step to the loop's, each side's peak RSS, and each
side's mean reward over its last half (the two sample differently, so the rewards agree only
roughly).

A benchmark, never a test: it asserts nothing (issue 48's goals: a median step at most the
loop's, a trainer peak RSS at most 4 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "smollm2_addition.yaml"


def _rss_of_children_gb(root_pid: int) -> float:
    """The largest RSS among ``root_pid``'s descendants but the trainer itself (the engine
    server), in GB; 0 when none is readable."""
    best = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().split()
            status = (entry / "status").read_text()
        except OSError:
            continue
        pid, ppid = int(entry.name), int(stat[3])
        if pid == root_pid or not _descends(ppid, root_pid):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                best = max(best, int(line.split()[1]))
    return best / 2**20


def _descends(pid: int, root: int) -> bool:
    for _ in range(16):
        if pid == root:
            return True
        if pid <= 1:
            return False
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().split()[3])
        except OSError:
            return False
    return False


def run_trainer(steps: int, overrides: list[str], run_dir: Path) -> dict:
    """The recipe for ``steps`` steps without evals: stage medians, peak RSS, rewards."""
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "--config",
        str(RECIPE),
        f"trainer.max_steps={steps}",
        "trainer.eval_interval=0",
        "trainer.eval_before_train=false",
        f"trainer.run_dir={run_dir}",
        *overrides,
    ]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    server_peak = [0.0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.5):
            server_peak[0] = max(server_peak[0], _rss_of_children_gb(child.pid))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, err = child.communicate()
    stop.set()
    watcher.join()
    wall = time.perf_counter() - start
    if child.returncode != 0:
        sys.exit(f"the trainer failed ({child.returncode}):\n{err.decode()[-3000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_m = [m for m in lines if "timing/step" in m]
    timed = steps_m[1:] if len(steps_m) > 1 else steps_m
    stages = {
        key.removeprefix("timing/"): statistics.median(m[key] for m in timed if key in m)
        for key in sorted({k for m in timed for k in m if k.startswith("timing/")})
    }
    return {
        "wall_s": wall,
        "stages": stages,
        "peak_rss_gb": max(m["memory/peak_rss_gb"] for m in steps_m),
        "server_peak_rss_gb": server_peak[0],
        "rewards": [m["reward/mean"] for m in steps_m],
    }


def plain_loop(steps: int, overrides: list[str]) -> dict:
    """The plain GRPO loop, in this process (run it in a fresh one): stage times per step,
    peak RSS, rewards."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from engines.models import load_tokenizer, resolve_model_path
    from trainer.config import load_config
    from trainer.data import PromptLoader, load_datasets
    from trainer.generators.chat import render_prompt

    cfg = load_config(str(RECIPE), overrides)
    torch.manual_seed(cfg.trainer.seed)
    model_dir = resolve_model_path(cfg.model.path)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.99))
    data = load_datasets(cfg.data, cfg.trainer.seed)
    loader = PromptLoader(data.train, cfg.trainer.train_batch_size, cfg.trainer.seed)
    reward_fn = data.reward_fn
    s, n = cfg.generator.sampling, cfg.generator.n_samples_per_prompt
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    eos = tok.eos_token_id
    out: dict = {"generate": [], "train": [], "step": [], "rewards": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = loader.next_batch()
        prompts = [render_prompt(tok, ex.prompt)[1] for ex in batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        model.eval()
        with torch.no_grad():
            seqs = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=s.max_tokens,
                do_sample=True,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=0,
                num_return_sequences=n,
                pad_token_id=pad,
            )
        t1 = time.perf_counter()
        responses = seqs[:, width:]
        # the response's tokens: up to and including the first EOS
        done = (responses == eos).int().cumsum(1)
        resp_mask = (done == 0) | ((done == 1) & (responses == eos))
        texts = [
            tok.decode(r[m], skip_special_tokens=True)
            for r, m in zip(responses, resp_mask, strict=True)
        ]
        answers = [ex.answer for ex in batch for _ in range(n)]
        rewards = torch.tensor([float(reward_fn(t, a)) for t, a in zip(texts, answers)])
        grouped = rewards.view(-1, n)
        adv = (grouped - grouped.mean(1, keepdim=True)).flatten()
        model.train()
        attention = torch.cat([mask.repeat_interleave(n, 0), resp_mask.long()], 1)
        logits = model(seqs, attention_mask=attention).logits[:, width - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        m = resp_mask.float()
        loss = -(adv[:, None] * logp * m).sum() / m.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
        optim.step()
        optim.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        out["generate"].append(t1 - t0)
        out["train"].append(t2 - t1)
        out["step"].append(t2 - t0)
        out["rewards"].append(rewards.mean().item())
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out["threads"] = torch.get_num_threads()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--plain-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value for both sides (after --)")
    args = parser.parse_args(argv)
    if args.plain_child:
        print(json.dumps(plain_loop(args.steps, args.overrides)))
        return

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_trainer(args.steps, args.overrides, Path(tmp) / "run")
    child = subprocess.run(
        [
            sys.executable,
            __file__,
            "--plain-child",
            "--steps",
            str(args.steps),
            "--",
            *args.overrides,
        ],
        capture_output=True,
        text=True,
    )
    if child.returncode != 0:
        sys.exit(f"the plain loop failed ({child.returncode}):\n{child.stderr[-3000:]}")
    plain = json.loads(child.stdout.strip().splitlines()[-1])
    load_after = os.getloadavg()

    def med(xs: list[float]) -> float:
        return statistics.median(xs[1:] if len(xs) > 1 else xs)

    half = max(1, args.steps // 2)
    print(f"SmolLM2 recipe, {args.steps} steps each, medians of steps 2..{args.steps}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    print(f"{'stage':<34}{'trainer s':>12}{'plain loop s':>14}")
    for stage, value in ours["stages"].items():
        theirs = {"generate": med(plain["generate"]), "step": med(plain["step"])}
        theirs["train_critic_and_policy"] = med(plain["train"])
        other = f"{theirs[stage]:>14.2f}" if stage in theirs else f"{'':>14}"
        print(f"{stage:<34}{value:>12.2f}{other}")
    ratio = ours["stages"]["step"] / med(plain["step"])
    print(f"step, trainer / plain loop: {ratio:.2f}x")
    print(
        f"peak RSS: trainer {ours['peak_rss_gb']:.2f} GB (its engine server "
        f"{ours['server_peak_rss_gb']:.2f} GB), plain loop {plain['peak_rss_gb']:.2f} GB "
        f"({plain['threads']} torch threads)"
    )
    print(
        f"reward/mean over the last {half} steps: trainer "
        f"{statistics.fmean(ours['rewards'][-half:]):.3f}, plain loop "
        f"{statistics.fmean(plain['rewards'][-half:]):.3f}"
    )
    print(f"trainer wall time {ours['wall_s']:.1f} s (start-up and model conversion included)")


if __name__ == "__main__":
    main()
