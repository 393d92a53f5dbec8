"""What the policy update's logprobs cost: the full logits against the head fused in chunks.

::

    python benchmarks/update_memory.py [--vocab 49152] [--rows 32] [--prompt 15] [--response 40]

One forward and backward of the policy loss (``PolicyWorker.forward_backward``) over a batch
of ``rows`` sequences of ``prompt + response`` tokens, on a small Qwen2 model with a real
model's vocabulary (SmolLM2's 49,152 by default: the logits dominate, as in a 135M model),
each way in its own fresh process: ``full`` (the wrapper's ``[B, L, V]`` logits, what every
model took before :func:`trainer.workers.logprobs.fused_head`) and ``fused`` (the head applied
to the trained positions only, in chunks). Prints each way's peak RSS (the process's, so the
model and torch's own memory are in both) and the median time of three passes.

A benchmark, never a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _build(directory: Path, vocab: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(directory)


def _measure(model_dir: str, way: str, rows: int, prompt: int, response: int) -> dict:
    import torch

    import trainer.workers.logprobs as logprobs
    from trainer.workers.batch import TrainBatch
    from trainer.workers.policy import PolicyWorker

    torch.set_num_threads(1)
    if way == "full":
        logprobs.fused_head = lambda model: None  # every model as an unrecognised one
    worker = PolicyWorker(model_dir, lr=1e-5)
    vocab = worker.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    width = prompt + response
    mask = torch.zeros(rows, width - 1)
    mask[:, prompt - 1 :] = 1.0
    batch = TrainBatch(
        input_ids=torch.randint(0, vocab, (rows, width), generator=g),
        attention_mask=torch.ones(rows, width, dtype=torch.long),
        loss_mask=mask,
        advantages=torch.randn(rows, generator=g),
    )
    times = []
    for _ in range(3):
        start = time.perf_counter()
        worker.forward_backward(batch)
        times.append(time.perf_counter() - start)
        worker.optimizer.zero_grad(set_to_none=False)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"way": way, "peak_rss_mb": peak_mb, "median_s": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=15)
    p.add_argument("--response", type=int, default=40)
    p.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "WAY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        out = _measure(args.child[0], args.child[1], args.rows, args.prompt, args.response)
        print(json.dumps(out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        _build(Path(tmp), args.vocab)
        print(f"vocab {args.vocab}, {args.rows} x ({args.prompt} + {args.response}) tokens")
        print("| way | peak RSS (MB) | forward+backward (s, median of 3) |\n|---|---|---|")
        for way in ("full", "fused"):
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.update_memory",
                *sys.argv[1:],
                "--child",
                tmp,
                way,
            ]
            line = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
            got = json.loads(line.stdout.strip().splitlines()[-1])
            print(f"| {way} | {got['peak_rss_mb']:.0f} | {got['median_s']:.2f} |")


if __name__ == "__main__":
    main()
