"""Seeded sampling in vLLM's CPU build survives a chunked prefill.

vLLM 0.32's model runner samples a token for a request whose prompt was only partly
prefilled in a step, discards it, and rewinds the request's seeded generator by its Philox
offset (``GPUModelRunner._bookkeeping_sync``: ``gen.set_offset(gen.get_offset() - 4)``). A CPU
generator (mt19937) has no offset: ``RuntimeError: CPU Generator does not use offset`` kills
the engine core, and every request after it answers 500 "EngineCore encountered an issue".
It happens as soon as seeded prompts in flight exceed one step's token budget
(``--max-num-batched-tokens``, 2048 on the CPU): measured with SmolLM2-135M-Instruct, 80
chat prompts of 45 tokens (an eval with ``trainer.eval_n_samples_per_prompt=4``); the tiny
model's short prompts never reached it.

:func:`mend_cpu_seeded_rewind` makes the rewind exact on the CPU instead: each sampling step
first keeps the state of every CPU generator, and the rewind of a discarded sample restores
the state its generator had before that step, which is what the offset rewind does on a
GPU (the request's samples are then the same whether or not its prefill was chunked). The
plugin's weight-transfer engines apply it when vLLM constructs them in its worker (every
server the trainer starts on the CPU uses one). A vLLM without the method, or whose method
no longer has this shape, is left alone.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["mend_cpu_seeded_rewind"]


class _Rewinding:
    """A generator's stand-in inside the rewind: ``set_offset`` restores ``state``."""

    def __init__(self, generator: torch.Generator, state: torch.Tensor) -> None:
        self._generator = generator
        self._state = state

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        self._generator.set_state(self._state)


def mend_cpu_seeded_rewind() -> bool:
    """Patch vLLM's model runner (once per process); whether it is patched now."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    cls: Any = GPUModelRunner
    if getattr(cls, "_trainer_cpu_rewind", False):
        return True
    if not (hasattr(cls, "sample_tokens") and hasattr(cls, "_bookkeeping_sync")):
        return False
    sample_tokens, bookkeeping = cls.sample_tokens, cls._bookkeeping_sync

    @functools.wraps(sample_tokens)
    def sample_tokens_keeping_states(self: Any, *args: Any, **kwargs: Any) -> Any:
        gens = getattr(getattr(self, "input_batch", None), "generators", None) or {}
        self._trainer_generator_states = {
            i: g.get_state() for i, g in gens.items() if g.device.type == "cpu"
        }
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            self._trainer_generator_states = None

    @functools.wraps(bookkeeping)
    def bookkeeping_rewinding(self: Any, *args: Any, **kwargs: Any) -> Any:
        states = getattr(self, "_trainer_generator_states", None)
        if not states:
            return bookkeeping(self, *args, **kwargs)
        batch = self.input_batch
        real = batch.generators
        batch.generators = {
            i: _Rewinding(g, states[i]) if i in states else g for i, g in real.items()
        }
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            batch.generators = real

    cls.sample_tokens = sample_tokens_keeping_states
    cls._bookkeeping_sync = bookkeeping_rewinding
    cls._trainer_cpu_rewind = True
    return True
