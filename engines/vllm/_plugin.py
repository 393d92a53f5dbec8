"""The ``vllm.general_plugins`` entry point (pyproject.toml): registers the ``gloo`` and ``disk``
engines."""

from __future__ import annotations

import os

__all__ = ["BACKENDS", "BUSY_LOOP_ENV", "register"]

#: The ``--weight-transfer-config`` backend names the plugin registers: their engine classes.
BACKENDS = {
    "gloo": ("engines.vllm.gloo_engine", "GlooWeightTransferEngine"),
    "disk": ("engines.vllm.disk_engine", "DiskWeightTransferEngine"),
}
#: Seconds vLLM's message-queue readers busy-spin after each message (vLLM's
#: ``SpinCondition(busy_loop_s=1)``); unset: vLLM's own. The trainer sets it for the vLLM it
#: starts on the CPU (``engines.vllm.serve.DEFAULT_CPU_BUSY_LOOP_S``, which says why); a
#: server a user starts gets it from its own environment.
BUSY_LOOP_ENV = "TRAINER_VLLM_BUSY_LOOP_S"


def register() -> None:
    """Register :data:`BACKENDS` in vLLM's ``WeightTransferEngineFactory`` (lazily: by module
    path, so nothing is imported until a server uses one).

    vLLM may call this more than once per process; a second call is a no-op. A vLLM without
    the factory (older than weight transfer) is left alone.
    """
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    for name, (module, cls) in BACKENDS.items():
        try:
            WeightTransferEngineFactory.register_engine(name, module, cls)
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
