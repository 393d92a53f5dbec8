"""A tied LM head refreshed after each weight update, where vLLM's CPU build keeps it stale.

On the CPU, vLLM prepares each linear layer's kernel once its weights are loaded
(``UnquantizedEmbeddingMethod.process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm``:
a prepacked copy of the weight, oneDNN's or sgl-kernel's, held by ``layer.cpu_linear``). A
head tied to the embeddings (``tie_word_embeddings``: SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B)
shares the embeddings' parameter and gets no weights of its own in a reload, so vLLM's
layerwise reload (``finalize_layerwise_processing``) puts its tensors back without preparing
it again: the new embeddings are copied into the shared parameter, and the logits keep
coming from the old prepacked copy. Measured on vLLM 0.32 (CPU): after a sync the engine's
logprobs stay the old policy's.

:func:`refresh_tied_heads` prepares such a head again, from the parameter it shares, after
the reload is finalised; both of the plugin's engines call it at the end of every
``finish_weight_update``. On a GPU the head reads its weight directly (no prepacked copy), so
nothing is done there. Only unquantised heads are prepared again (the method is idempotent
for them; a quantised head's is not, and no quantised model is synced here).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["refresh_tied_heads"]

log = logging.getLogger(__name__)


def refresh_tied_heads(model: torch.nn.Module) -> list[str]:
    """Prepare again the kernel of every unquantised LM head of ``model`` whose weight is an
    embedding's (on the CPU platform only); the names of the heads prepared."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    modules: dict[str, Any] = dict(model.named_modules())  # vLLM's layers: attributes untyped
    embeddings = {
        m.weight.data_ptr()
        for m in modules.values()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    }
    refreshed = []
    for name, m in modules.items():
        if (
            isinstance(m, ParallelLMHead)
            and isinstance(m.quant_method, UnquantizedEmbeddingMethod)
            and m.weight.data_ptr() in embeddings
        ):
            m.quant_method.process_weights_after_loading(m)
            refreshed.append(name)
    if refreshed:
        log.debug("tied LM heads prepared again after the weight update: %s", refreshed)
    return refreshed
