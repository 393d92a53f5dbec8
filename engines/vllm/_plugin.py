"""The ``vllm.general_plugins`` entry point (pyproject.toml): registers the ``gloo`` engine."""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

#: The ``--weight-transfer-config`` backend name the plugin registers.
BACKEND = "gloo"


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
