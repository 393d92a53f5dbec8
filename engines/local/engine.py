"""The CPU reference engine: continuous batching over a Hugging Face causal LM.

Requests wait in a queue; a scheduler task runs one decode step at a time for every active
request together (a single batched forward pass, off the event loop in a worker thread), and
new requests join the batch between decode steps. Weight loads take the same lock as a
decode step, so a request never samples from half-updated weights.

The engine is deliberately simple: no KV cache (each step re-reads the whole sequence,
left-padded), which is cheap for the short sequences of a tiny model and keeps batching and
weight swaps trivially correct.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

import attrs
import torch
import trio

from engines.types import Completion, FinishReason, SamplingParams

__all__ = ["EngineAsleepError", "LocalEngine", "PauseMode", "open_local_engine"]

log = logging.getLogger(__name__)
PauseMode = Literal["keep", "abort", "wait"]


class EngineAsleepError(RuntimeError):
    """A generation was asked of an engine whose weights are offloaded (``/sleep``)."""


@attrs.define(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    out_ids: list[int] = attrs.field(factory=list)
    out_logprobs: list[float] = attrs.field(factory=list)
    finish_reason: FinishReason | None = None
    done: trio.Event = attrs.field(factory=trio.Event)

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.done.set()


class LocalEngine:
    """A causal LM with a continuous-batching scheduler; create with :func:`open_local_engine`."""

    def __init__(self, model_dir: str | Path, *, seed: int = 0, max_num_seqs: int = 256) -> None:
        from transformers import AutoModelForCausalLM

        from trainer.models import load_tokenizer

        self.model_dir = Path(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.eval()
        self.tokenizer = load_tokenizer(self.model_dir)
        self.vocab_size = int(self.model.config.vocab_size)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self.max_num_seqs = max_num_seqs
        self._rng = random.Random(seed)
        self._pending: list[_Request] = []
        self._active: list[_Request] = []
        self._work = trio.Event()
        self._step_lock = trio.Lock()
        self._paused = False
        self._resumed = trio.Event()
        self._resumed.set()
        self._sleep_level = 0
        #: How many decode steps ran at each batch size (tests and /metrics read it).
        self.batch_size_counts: Counter[int] = Counter()
        self.weight_version = 0

    # -- data plane ---------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Sample one completion; joins the running batch at the next decode step.

        Raises ``EngineAsleepError`` while the engine sleeps and ``ValueError`` for token ids
        outside the vocabulary. If the caller is cancelled the request leaves the batch.
        """
        if self._sleep_level:
            raise EngineAsleepError("the engine is sleeping (weights offloaded); call /wake_up first")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        gen = torch.Generator()
        gen.manual_seed(params.seed if params.seed is not None else self._rng.getrandbits(63))
        req = _Request(list(prompt_ids), params, gen)
        if params.max_tokens == 0:
            req.finish("length")
        else:
            self._pending.append(req)
            self._work.set()
        try:
            await req.done.wait()
        finally:
            if req.finish_reason is None:  # cancelled by the caller: leave the batch
                for queue in (self._pending, self._active):
                    if req in queue:
                        queue.remove(req)
        assert req.finish_reason is not None
        return Completion(req.out_ids, req.out_logprobs, req.finish_reason, req.prompt_ids)

    # -- control plane ------------------------------------------------------------------------

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    @property
    def num_requests(self) -> int:
        return len(self._pending) + len(self._active)

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop decoding. ``keep``: in-flight requests freeze and continue after ``resume``;
        ``abort``: they end now with ``finish_reason='abort'`` and their partial tokens;
        ``wait``: they run to completion first (no new request is admitted meanwhile)."""
        if mode == "wait":
            self._paused = True  # stops admissions, active requests keep decoding
            self._resumed = trio.Event()
            while self._active:
                await self._active[0].done.wait()
            return
        self._paused = True
        self._resumed = trio.Event()
        async with self._step_lock:  # the step in flight finishes first
            if mode == "abort":
                for req in [*self._active, *self._pending]:
                    req.finish("abort")
                self._active.clear()
                self._pending.clear()

    def resume(self) -> None:
        self._paused = False
        self._resumed.set()
        self._work.set()

    async def sleep(self, level: int = 1) -> None:
        """Offload: level 1 keeps weights in host memory, level 2 discards them (reload on wake)."""
        async with self._step_lock:
            self._sleep_level = level

    async def wake_up(self, tags: list[str] | None = None) -> None:
        async with self._step_lock:
            if tags is None or "weights" in tags or "kv_cache" in tags:
                if tags is None or "kv_cache" in tags or self._sleep_level:
                    self._sleep_level = 0 if tags is None or "kv_cache" in tags else self._sleep_level
            self._work.set()

    async def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Replace weights between decode steps (atomic with respect to requests)."""
        async with self._step_lock:
            await trio.to_thread.run_sync(self._load_weights_sync, state)
            self.weight_version += 1

    def _load_weights_sync(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, tensor in state.items():
                if name not in params:
                    raise KeyError(f"unknown parameter {name!r}")
                params[name].copy_(tensor)

    def weight_checksum(self) -> str:
        """sha256 over every parameter's name and bytes, in name order."""
        return state_checksum(dict(self.model.named_parameters()))

    # -- scheduler ----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The scheduler loop; runs until cancelled."""
        task_status.started()
        while True:
            await self._work.wait()
            if self._paused and not self._active:
                await self._resumed.wait()
                continue
            if not self._paused:
                room = self.max_num_seqs - len(self._active)
                self._active.extend(self._pending[:room])
                del self._pending[:room]
            if not self._active:
                self._work = trio.Event()
                continue
            async with self._step_lock:
                if self._paused and not self._is_draining() or not self._active:
                    continue
                batch = list(self._active)
                self.batch_size_counts[len(batch)] += 1
                tokens, logprobs = await trio.to_thread.run_sync(self._decode_step, batch)
            for req, tok, lp in zip(batch, tokens, logprobs):
                if req.finish_reason is not None or req not in self._active:
                    continue
                req.out_ids.append(tok)
                req.out_logprobs.append(lp)
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    self._active.remove(req)
                    req.finish(reason)

    def _is_draining(self) -> bool:
        # pause(mode="wait") sets _paused but leaves _resumed unset while requests drain;
        # keep/abort pauses hold the step lock, so a paused engine that reaches here drains.
        return not self._resumed.is_set() and bool(self._active)

    def _stop_reason(self, req: _Request, tok: int) -> FinishReason | None:
        p = req.params
        if (not p.ignore_eos and tok == self.eos_token_id) or tok in p.stop_token_ids:
            return "stop"
        if len(req.out_ids) >= p.max_tokens:
            return "length"
        return None

    @torch.no_grad()
    def _decode_step(self, batch: list[_Request]) -> tuple[list[int], list[float]]:
        seqs = [r.prompt_ids + r.out_ids for r in batch]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits = logits[:, -1, :].float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        tokens: list[int] = []
        for i, req in enumerate(batch):
            tok = sample_token(logits[i], req.params, req.generator)
            tokens.append(tok)
        picked = raw_logprobs[torch.arange(len(batch)), torch.tensor(tokens)]
        return tokens, picked.tolist()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Sample from one row of logits with temperature and top-p (temperature 0: greedy)."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep a token if the mass before it is below top_p (the top token is always kept)
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def state_checksum(named: dict[str, torch.Tensor]) -> str:
    """sha256 over each tensor's name and float32 bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


@asynccontextmanager
async def open_local_engine(
    model_dir: str | Path, *, seed: int = 0, max_num_seqs: int = 256
) -> AsyncIterator[LocalEngine]:
    """Load the model (in a thread) and run the scheduler in a nursery for the block's life."""
    engine = await trio.to_thread.run_sync(
        lambda: LocalEngine(model_dir, seed=seed, max_num_seqs=max_num_seqs)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()
