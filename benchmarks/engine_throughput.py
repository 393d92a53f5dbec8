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

Then the short-request case, the default training step's shape (``--groups 16`` prompts x
``--n 8`` samples, ``--short-tokens 4`` new tokens, sampling at temperature 1): the median wall time of
one batched in-process ``model.generate`` of the whole batch (the ceiling), of the same
samples as one HTTP request each, and as one request per prompt with ``n`` samples (what the
default generator sends).
"""

from __future__ import annotations

import argparse
import statistics
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
                async with InferenceClient(
                    urls, api_key=urls.api_key, max_concurrency=concurrency
                ) as client:
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


async def short_requests(
    model_dir: Path, batch: list[list[int]], n: int, repeats: int, tokens: int
) -> dict[str, float]:
    """Median seconds of ``len(batch) * n`` samples of ``tokens`` sent each way over HTTP."""
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    medians: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as logs:
        async with launch_local_engines(1, model_dir, logs) as urls:
            async with InferenceClient(urls, api_key=urls.api_key) as client:

                async def single(prompt: list[int]) -> None:
                    async with trio.open_nursery() as nursery:
                        for _ in range(n):
                            nursery.start_soon(client.generate, prompt, params)

                async def grouped(prompt: list[int]) -> None:
                    await client.generate_n(prompt, params, n)

                for label, send in (
                    (f"{len(batch) * n} requests of 1 sample", single),
                    (f"{len(batch)} requests of n={n}", grouped),
                ):
                    times = []
                    for _ in range(repeats + 1):  # the first round warms up
                        start = time.perf_counter()
                        async with trio.open_nursery() as nursery:
                            for prompt in batch:
                                nursery.start_soon(send, prompt)
                        times.append(time.perf_counter() - start)
                    medians[label] = statistics.median(times[1:])
    return medians


def short_ceiling(
    model_dir: Path, batch: list[list[int]], n: int, repeats: int, tokens: int
) -> float:
    """Median seconds of one batched ``model.generate`` of ``batch``, ``n`` samples each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = load_tokenizer(model_dir).pad_token_id or 0
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = (
        torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in batch])[:, None]
    ).long()
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=True,
                num_return_sequences=n,
                pad_token_id=pad,
            )
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--model", default=None, help="model directory (default: the built-in tiny model)"
    )
    parser.add_argument("--groups", type=int, default=16, help="short case: prompts")
    parser.add_argument("--n", type=int, default=8, help="short case: samples per prompt")
    parser.add_argument("--repeats", type=int, default=5, help="short case: timed rounds")
    parser.add_argument(
        "--short-tokens", type=int, default=4, help="short case: new tokens per sample"
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

    short = prompts(args.groups, vocab)
    tokens = args.short_tokens
    ceiling_s = short_ceiling(model_dir, short, args.n, args.repeats, tokens)
    served_s = trio.run(short_requests, model_dir, short, args.n, args.repeats, tokens)
    print(
        f"\nshort requests: {args.groups} prompts x {args.n} samples x {tokens} tokens (median ms)"
    )
    print(f"{'setup':<34}{'ms':>10}{'x ceiling':>11}")
    print(f"{'batched model.generate (ceiling)':<34}{1000 * ceiling_s:>10.1f}{1.0:>11.2f}")
    for label, secs in served_s.items():
        print(f"{'HTTP, ' + label:<34}{1000 * secs:>10.1f}{secs / ceiling_s:>11.2f}")


if __name__ == "__main__":
    main()
