"""Generation throughput of the reference engine over HTTP vs sequential ``transformers`` generate.

::

    python benchmarks/engine_throughput.py [--requests 32] [--max-tokens 64] [--model DIR]

Runs, in one process and one sitting (so the machine's noise hits both alike):

1. the baseline: the same requests as sequential ``model.generate`` calls (sampling,
   exactly ``max_tokens`` new tokens each, KV cache on, as transformers does by default);
2. one reference server (``engines.launch``) driven by ``InferenceClient`` at 1, 8 and 32
   requests in flight (the same requests, ``ignore_eos`` so every one yields ``max_tokens``).

Prints tokens/s of each and its ratio to the baseline. Both sides use one torch thread
(the server's default; see ``python -m engines.local serve --help``). Goal (issue 4): at
least 3x the baseline at 32 concurrent requests.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.client import InferenceClient
from engines.launch import launch_local_engines
from engines.models import load_tokenizer, resolve_model_path
from engines.types import SamplingParams

CONCURRENCY = (1, 8, 32)


def prompts(n: int, vocab: int) -> list[list[int]]:
    """``n`` distinct prompts of 6-13 token ids (no special tokens)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(4, vocab, (6 + i % 8,), generator=gen).tolist() for i in range(n)]


def baseline(model_dir: Path, batch: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Sequential ``model.generate``: (seconds, tokens generated)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = load_tokenizer(model_dir)
    torch.manual_seed(0)
    generated = 0
    with torch.no_grad():
        model.generate(
            torch.tensor([batch[0]]),
            max_new_tokens=4,
            do_sample=True,
            pad_token_id=tok.pad_token_id,
        )
        start = time.perf_counter()
        for ids in batch:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                pad_token_id=tok.pad_token_id,
            )
            generated += out.shape[1] - len(ids)
        return time.perf_counter() - start, generated


async def served(
    model_dir: Path, batch: list[list[int]], max_tokens: int
) -> dict[int, tuple[float, int]]:
    """Through one reference server at each concurrency: {concurrency: (seconds, tokens)}."""
    results: dict[int, tuple[float, int]] = {}
    with tempfile.TemporaryDirectory() as logs:
        async with launch_local_engines(1, model_dir, logs) as urls:
            for concurrency in CONCURRENCY:
                async with InferenceClient(urls, max_concurrency=concurrency) as client:
                    await client.generate(batch[0], SamplingParams(max_tokens=4))  # warm up
                    counts: list[int] = []

                    async def one(
                        i: int, client: InferenceClient = client, counts: list[int] = counts
                    ) -> None:
                        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i)
                        counts.append(len((await client.generate(batch[i], params)).token_ids))

                    start = time.perf_counter()
                    async with trio.open_nursery() as nursery:
                        for i in range(len(batch)):
                            nursery.start_soon(one, i)
                    results[concurrency] = (time.perf_counter() - start, sum(counts))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--model", default=None, help="model directory (default: the built-in tiny model)"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    model_dir = resolve_model_path(args.model)
    vocab = len(load_tokenizer(model_dir))
    batch = prompts(args.requests, vocab)

    base_s, base_tokens = baseline(model_dir, batch, args.max_tokens)
    base_tps = base_tokens / base_s
    runs = trio.run(served, model_dir, batch, args.max_tokens)

    print(f"{args.requests} requests x {args.max_tokens} tokens, model {model_dir.name}")
    print(f"{'setup':<34}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}{'ratio':>8}")
    print(
        f"{'transformers generate, sequential':<34}{base_tokens:>8}{base_s:>10.2f}{base_tps:>11.1f}{1.0:>8.2f}"
    )
    for concurrency, (secs, tokens) in runs.items():
        tps = tokens / secs
        label = f"HTTP server, {concurrency} concurrent"
        print(f"{label:<34}{tokens:>8}{secs:>10.2f}{tps:>11.1f}{tps / base_tps:>8.2f}")


if __name__ == "__main__":
    main()
