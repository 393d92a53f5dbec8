"""The CPU reference engine: continuous batching over a Hugging Face causal LM.

Requests wait in a queue; a scheduler task runs one decode step at a time for every active
request together (a single batched forward pass, off the event loop in a worker thread), and
new requests join the batch between decode steps. Weight loads take the same lock as a
decode step, so a request never samples from half-updated weights.

Each request keeps its own KV cache (see :mod:`engines.local.decode`); a request without one
(new, or its cache dropped) is prefilled in the next step. Sleeping the KV cache and loading
weights drop every cache, so kept requests are recomputed from their tokens with the weights
then loaded (never continued on stale keys and values).

Control-plane state (each change wakes the scheduler):

- *paused* (``pause``/``resume``): no decode step runs and no request is admitted, except
  while ``pause(mode="wait")`` drains the requests that were in flight when it was called.
- *asleep* (``sleep``/``wake_up``), two independent halves as in vLLM: ``weights`` and
  ``kv_cache``. ``sleep(1)`` puts both to sleep (weights kept in host memory); ``sleep(2)``
  also discards the weights (they read as zeros until ``load_weights``). ``wake_up(["weights"])``
  then ``wake_up(["kv_cache"])``, or ``wake_up()`` for both. While either half sleeps no decode
  step runs and ``generate`` raises ``EngineAsleepError``; ``load_weights`` needs the weights
  half awake.
- *weights partial* (``weights_partial``, set by the weight routes from
  ``/start_weight_update`` (:meth:`begin_update`) until a ``/finish_weight_update`` succeeds
  (:meth:`end_update`)): real vLLM's layers hold partial weights then, and its worker crashes
  on the next forward pass. This engine holds its decode steps while the update is open
  (requests queue, as while paused, and run once the finish made the weights whole: a client
  cannot kill the server by sending a completion mid-update); once an update failed and
  closed with the weights still partial, a decode step due ends the engine as vLLM's worker
  ends (``died``; every request and every later one raises ``EngineDeadError``, vLLM's words)
  until a complete update makes it whole.
"""

from __future__ import annotations

import functools
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import torch
import trio

from engines.cpu_share import CpuShare
from engines.devices import resolve_device, resolve_dtype
from engines.local.decode import StepResult, decode_step
from engines.local.engine_states import EngineStates
from engines.local.lora import Adapter, LoraLayers, read_adapter
from engines.local.model_weights import (
    load_into,
    parameter_digests,
    state_checksum,
)
from engines.local.requests import (
    EngineAsleepError,
    EngineDeadError,
    Request,
    TokenCallback,
)
from engines.local.text import first_stop
from engines.models import load_tokenizer
from engines.types import Completion, FinishReason, SamplingParams
from trainer.vocabulary import FaultAction, open_owner_nursery, sampler_skew

__all__ = ["DEFAULT_BATCH_WAIT_S", "LocalEngine", "open_local_engine"]

log = logging.getLogger(__name__)

#: Longest gap between two arriving requests that still joins them into one first step.
DEFAULT_BATCH_WAIT_S = 0.002


class LocalEngine(EngineStates):
    """A causal LM with a continuous-batching scheduler; create with :func:`open_local_engine`."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        seed: int = 0,
        max_num_seqs: int = 256,
        batch_wait_s: float = DEFAULT_BATCH_WAIT_S,
        device: str = "auto",
        dtype: str = "auto",
        threads: int | None = None,
        max_lora_rank: int | None = None,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        #: ``threads``: the most torch threads a decode step uses, fewer while the machine's
        #: other processes hold cores (:class:`engines.cpu_share.CpuShare`); None: torch's own.
        self.cpu = CpuShare(threads) if threads else None
        # heavy (transformers' auto-model registry): loaded with the first engine only
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        #: ``--logprobs-mode processed_logprobs``: logprobs over each request's temperature.
        self.processed_logprobs = logprobs_mode == "processed_logprobs"
        #: Where the model and the KV caches live (``--device``; sampling stays on the CPU).
        self.device = resolve_device(device, key="--device")
        self.dtype = resolve_dtype(dtype, self.device, key="--dtype")
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        torch.nn.Module.to(self.model, self.device)
        self.model.eval()
        self.tokenizer = load_tokenizer(self.model_dir)
        self.vocab_size = int(self.model.config.vocab_size)
        #: Prompt plus completion tokens a request may hold (the model's position embeddings;
        #: 2048 when its config does not say), as ``/v1/models`` reports it.
        self.max_model_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 2048)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self.max_num_seqs = max_num_seqs
        self.batch_wait_s = batch_wait_s
        self._rng = random.Random(seed)
        self._pending: list[Request] = []
        self._active: list[Request] = []
        #: Set (and replaced) on every state change; the scheduler waits on it when idle.
        self._changed = trio.Event()
        self._step_lock = trio.Lock()
        self._paused = False
        #: Requests a ``pause(mode="wait")`` lets finish; None when no drain is running.
        self._drain: set[Request] | None = None
        self._drainers = 0
        self._weights_asleep = False
        self._kv_asleep = False
        self._weights_discarded = False
        #: How many decode steps ran at each batch size (tests and /metrics read it).
        self.batch_size_counts: Counter[int] = Counter()
        #: The version of the weights served: the trainer's when a load names it, else loads
        #: so far (0: the weights it started with).
        self.weight_version = 0
        #: Why the weights are partial (an update started and not finished); None: whole.
        self.weights_partial: str | None = None
        #: An update is open (started, neither finished nor failed): decode steps wait.
        self.update_open = False
        self._held_warned = False
        #: Set once the engine died (see the module docstring); the server then shuts down.
        self.died = trio.Event()
        #: ``--enable-lora``'s ``--max-lora-rank``; None: adapters are not served.
        self.max_lora_rank = max_lora_rank
        self._lora = LoraLayers(self.model) if max_lora_rank is not None else None
        #: The loaded LoRA adapters by name (:mod:`engines.local.lora`).
        self.adapters: dict[str, Adapter] = {}
        #: Held across a LoRA route's checks and its load or unload (vLLM locks per name).
        self.adapter_lock = trio.Lock()

    # -- data plane ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        on_token: TokenCallback | None = None,
        adapter: Adapter | None = None,
    ) -> Completion:
        """Sample one completion; joins the running batch at the next decode step.

        ``adapter``: a loaded LoRA adapter the completion samples through (None: the base).

        ``on_token``, if given, is called with each token as it is sampled (streaming).
        ``params.stop`` strings are matched against the decoded output (special tokens
        skipped) after each token; the first match ends the completion (``stop``, with the
        string as ``stop_reason``).

        Raises ``EngineAsleepError`` while either half of the engine sleeps and it is not
        paused, and ``ValueError`` for an empty prompt or token ids outside the vocabulary.
        While the engine is paused the request waits (queued) until ``resume``, asleep or
        not, as vLLM's requests wait on its pause (a fully-async weight sync pauses, then
        sleeps, and wakes before it resumes). If the caller is
        cancelled the request leaves the batch at once (a step in flight finishes without it).
        """
        if self.died.is_set():
            raise EngineDeadError()
        if not self._awake and not self._paused:
            raise EngineAsleepError(self._asleep_detail())
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else self._rng.getrandbits(63))
        req = Request(
            list(prompt_ids),
            params,
            generator,
            on_token=on_token,
            adapter=adapter,
            bf16_logits=sampler_skew("generate") is FaultAction.BF16_LOGITS,
        )
        if params.max_tokens <= 0:
            req.finish("length")
        else:
            self._pending.append(req)
            self._poke()
        try:
            await req.done.wait()
        finally:
            if req.finish_reason is None:  # cancelled by the caller: leave the batch
                for queue in (self._pending, self._active):
                    if req in queue:
                        queue.remove(req)
                req.finish("abort")  # wakes a pause(mode="wait") draining it
                self._poke()
        assert req.finish_reason is not None
        if req.error is not None:
            raise req.error
        return Completion(
            req.out_ids,
            req.out_logprobs,
            req.finish_reason,
            req.prompt_ids,
            stop_reason=req.stop_reason,
            top_logprobs=req.out_top if params.top_logprobs else [],
            prompt_logprobs=req.prompt_scores or [],
        )

    async def load_weights(
        self,
        state: dict[str, torch.Tensor],
        *,
        adopt: bool = False,
        weight_version: int | None = None,
    ) -> bool:
        """Replace weights between decode steps (atomic with respect to requests).

        ``adopt``: the caller hands ``state``'s tensors over, and where every one matches its
        parameter's dtype, shape and device the parameters take them as their storage (no
        copy); the caller must not write them afterwards. Returns whether they were adopted
        (else they were copied). ``weight_version``: what :attr:`weight_version` becomes (the
        trainer's count, which a restarted engine or a resumed run does not share); None: one
        more than it was. Raises ``EngineAsleepError`` while the weights sleep (wake them
        first, as with vLLM) and ``KeyError`` for an unknown parameter name (nothing is loaded
        then).
        """
        if self._weights_asleep:
            raise EngineAsleepError("the weights are asleep; call /wake_up?tags=weights first")
        async with self._step_lock:
            adopted = await trio.to_thread.run_sync(self._load_weights_sync, state, adopt)
            self._drop_kv()  # keys and values of the old weights: recompute
            self._weights_discarded = False
            self.weight_version = (
                self.weight_version + 1 if weight_version is None else weight_version
            )
        return adopted

    async def load_adapter(self, name: str, path: str) -> Adapter:
        """Load (or reload in place) the LoRA adapter in ``path`` as ``name``, between decode
        steps; :class:`~engines.lora_answers.LoraRefusal` as vLLM refuses one. Requests already
        running keep the adapter they started with."""
        assert self.max_lora_rank is not None, "adapters need --enable-lora"
        adapter = await trio.to_thread.run_sync(
            functools.partial(read_adapter, name, path, self.model, max_rank=self.max_lora_rank)
        )
        async with self._step_lock:
            self.adapters[name] = adapter
        return adapter

    def _load_weights_sync(self, state: dict[str, torch.Tensor], adopt: bool = False) -> bool:
        return load_into(self.model, state, adopt)

    def weight_checksum(self) -> str:
        """sha256 over every parameter's name and bytes, in name order."""
        return state_checksum(dict(self.model.named_parameters()))

    def weight_checksums(self) -> dict[str, str]:
        """vLLM's ``/weight_checker`` digests (:func:`parameter_digests`)."""
        return parameter_digests(self.model)

    def begin_update(self, reason: str) -> None:
        """A weight update opened: the weights are partial (``reason`` says why) and decode
        steps wait until :meth:`end_update`."""
        self.weights_partial = reason
        self.update_open = True
        self._held_warned = False
        self._poke()

    def end_update(self, *, whole: bool) -> None:
        """The open update (if any) closed: ``whole`` (finished) makes the weights whole; else
        (it failed) they stay partial, and the next decode step ends the engine (vLLM's)."""
        self.update_open = False
        if whole:
            self.weights_partial = None
        self._poke()

    # -- scheduler ----------------------------------------------------------------------------

    def _admit(self) -> None:
        room = self.max_num_seqs - len(self._active)
        if room <= 0 or not self._pending:
            return
        if not self._paused:
            admitted = self._pending[:room]
        elif self._drain is not None:
            admitted = [r for r in self._pending if r in self._drain][:room]
        else:
            return
        self._active.extend(admitted)
        taken = set(admitted)
        self._pending = [r for r in self._pending if r not in taken]

    def _warn_held(self) -> None:
        """Say once per update that requests wait on it (real vLLM's worker would crash)."""
        if self.update_open and self.num_requests and not self._held_warned:
            self._held_warned = True
            log.warning(
                "%d request(s) wait for the open weight update to finish (%s): no decode step "
                "runs on partial weights (real vLLM's worker crashes here)",
                self.num_requests,
                self.weights_partial,
            )

    def _runnable(self) -> list[Request]:
        """The batch of the next decode step (empty while asleep, while a weight update is
        open, or paused unless draining)."""
        if not self._awake or self.update_open:
            return []
        if self._paused:
            if self._drain is None:
                return []
            return [r for r in self._active if r in self._drain]
        return list(self._active)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The scheduler loop; runs until cancelled."""
        task_status.started()
        idle = True
        while True:
            changed = self._changed
            if idle and self._pending:
                await self._gather_arrivals()
            if self._awake:
                self._admit()
            if not self._runnable():
                idle = not self._active
                self._warn_held()
                await changed.wait()
                continue
            idle = False
            async with self._step_lock:
                batch = self._runnable()  # re-read: a pause may have landed meanwhile
                if not batch:
                    continue
                if self.weights_partial is not None:
                    self._die(len(batch))
                    return
                self.batch_size_counts[len(batch)] += 1
                result = await trio.to_thread.run_sync(self._decode_step, batch)
            finished = False
            for req, tok, lp, top in zip(batch, result.tokens, result.logprobs, result.top):
                if req.finish_reason is not None or req not in self._active:
                    continue  # aborted or cancelled while the step ran
                req.out_ids.append(tok)
                req.out_logprobs.append(lp)
                if req.params.top_logprobs:
                    req.out_top.append(top)
                if req.on_token is not None:
                    req.on_token(tok, lp, top)
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    self._active.remove(req)
                    req.finish(reason)
                    finished = True
            if finished:
                self._poke()

    async def _gather_arrivals(self) -> None:
        """Let a burst of requests arrive before the first step after idling.

        A client sends a batch as many requests at once, and they reach the engine one by
        one as the server reads them; starting the first step on the first arrival would
        prefill the burst in many small steps. So, while requests keep arriving less than
        ``batch_wait_s`` apart (and at most ``4 * batch_wait_s`` in all), the scheduler
        waits; a full batch (``max_num_seqs``) starts at once. ``batch_wait_s <= 0`` never
        waits.
        """
        if self.batch_wait_s <= 0:
            return
        with trio.move_on_after(4 * self.batch_wait_s):
            while len(self._pending) < self.max_num_seqs:
                arrived = len(self._pending)
                with trio.move_on_after(self.batch_wait_s):
                    while len(self._pending) == arrived:
                        await self._changed.wait()
                if len(self._pending) == arrived:  # quiet for batch_wait_s: go
                    return

    def _stop_reason(self, req: Request, tok: int) -> FinishReason | None:
        p = req.params
        if not p.ignore_eos and tok == self.eos_token_id:
            return "stop"
        if tok in p.stop_token_ids:
            req.stop_reason = tok
            return "stop"
        if p.stop:
            # short outputs of a small vocabulary: decoding them whole costs microseconds
            text = self.tokenizer.decode(req.out_ids, skip_special_tokens=True)
            hit = first_stop(text, p.stop)
            if hit is not None:
                req.stop_reason = hit[1]
                return "stop"
        if len(req.out_ids) >= p.max_tokens:
            return "length"
        return None

    def _decode_step(self, batch: list[Request]) -> StepResult:
        if self.cpu is not None:  # torch's thread count is this thread's
            torch.set_num_threads(self.cpu.threads())
        return decode_step(
            self.model, batch, self.pad_token_id, self._lora, processed=self.processed_logprobs
        )

    def _die(self, batch_size: int) -> None:
        """What real vLLM's worker does on a forward pass over partial weights: it crashes.
        Every request fails with ``EngineDeadError``, and so does every later one."""
        log.error(
            "the engine died: a decode step of %d request(s) was due while the weights are "
            "partial (%s); real vLLM's worker crashes there (EngineDeadError). Only a "
            "complete /start_weight_update, /update_weights, /finish_weight_update makes "
            "an engine whole; resuming generation before that kills it",
            batch_size,
            self.weights_partial,
        )
        for req in (*self._active, *self._pending):
            req.error = EngineDeadError()
            req.finish("abort")
        self._active.clear()
        self._pending.clear()
        self.died.set()


@asynccontextmanager
async def open_local_engine(
    model_dir: str | Path,
    *,
    seed: int = 0,
    max_num_seqs: int = 256,
    batch_wait_s: float = DEFAULT_BATCH_WAIT_S,
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    max_lora_rank: int | None = None,
    logprobs_mode: str = "raw_logprobs",
) -> AsyncIterator[LocalEngine]:
    """Load the model (in a thread) and run the scheduler in a nursery for the block's life.

    ``device``/``dtype`` as :mod:`engines.devices` resolves them (``auto``: CUDA in bfloat16
    when this process sees a GPU, else the CPU in float32); ``ConfigError`` for CUDA where
    there is none. ``threads``: the most torch threads a decode step uses (see
    :class:`engines.cpu_share.CpuShare`); None leaves torch's count alone. ``max_lora_rank``:
    serve LoRA adapters up to that rank (``--enable-lora``); None: none. ``logprobs_mode``:
    one of :data:`~engines.local.decode.LOGPROBS_MODES` (``--logprobs-mode``).
    """
    engine = await trio.to_thread.run_sync(
        lambda: LocalEngine(
            model_dir,
            seed=seed,
            max_num_seqs=max_num_seqs,
            batch_wait_s=batch_wait_s,
            device=device,
            dtype=dtype,
            threads=threads,
            max_lora_rank=max_lora_rank,
            logprobs_mode=logprobs_mode,
        )
    )
    async with open_owner_nursery() as nursery:
        await nursery.start(engine.run)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()
