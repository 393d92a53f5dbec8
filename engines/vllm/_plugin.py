"""The ``vllm.general_plugins`` entry point (pyproject.toml): registers the ``gloo`` engine."""

from __future__ import annotations

import os

__all__ = ["BACKEND", "BUSY_LOOP_ENV", "register"]

#: The ``--weight-transfer-config`` backend name the plugin registers.
BACKEND = "gloo"
#: Experimental: seconds vLLM's message-queue readers busy-spin after each message (vLLM's
#: ``SpinCondition(busy_loop_s=1)``); unset: vLLM's own. On a small CPU machine the spin
#: takes a core from training after every engine step.
BUSY_LOOP_ENV = "TRAINER_VLLM_BUSY_LOOP_S"


def register() -> None:
    """Register :class:`~engines.vllm.gloo_engine.GlooWeightTransferEngine` as ``gloo`` in
    vLLM's ``WeightTransferEngineFactory`` (lazily: by module path).

    vLLM may call this more than once per process; a second call is a no-op. A vLLM without
    the factory (older than weight transfer) is left alone.
    """
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "engines.vllm.gloo_engine", "GlooWeightTransferEngine"
        )
    except ValueError:
        pass  # already registered in this process
    if os.environ.get(BUSY_LOOP_ENV):
        _set_busy_loop(float(os.environ[BUSY_LOOP_ENV]))


def _set_busy_loop(seconds: float) -> None:
    """Readers of vLLM's shared-memory queues made from now on spin ``seconds`` (not 1 s)."""
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    if getattr(cls, "_trainer_busy_loop", None) is not None:
        return
    init = cls.__init__

    def __init__(self, is_reader, context, notify_address, busy_loop_s=seconds):
        init(self, is_reader, context, notify_address, busy_loop_s)

    cls.__init__ = __init__
    cls._trainer_busy_loop = seconds
