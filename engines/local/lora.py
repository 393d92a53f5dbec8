"""LoRA adapters on the reference engine, served the way vLLM serves them (``--enable-lora``).

An adapter is a peft directory (``adapter_config.json``, ``adapter_model.safetensors``) loaded
under a name (``POST /v1/load_lora_adapter``); a request whose ``model`` is that name samples
through it, any other request through the base weights, in the same decode steps. Each
adapted linear layer gets ``(alpha / r) B A x`` added to its output for the rows of its adapter
(:class:`LoraLayers`: a forward hook per linear layer, as vLLM's punica kernels add each row's
adapter); the base weights never change. Reading a directory needs safetensors only, not peft.

What vLLM checks, this checks too, with its words (:class:`LoraRefusal`): a rank above
``--max-lora-rank``, a directory that is not an adapter, a layer the model lacks or of
another shape. An ``adapter_config.json`` over :data:`~engines.lora_answers.MAX_ADAPTER_CONFIG_BYTES`
(checked by its size, before reading), not JSON, or whose ``r`` is not a positive integer or
``lora_alpha`` not a finite number is a 400 (:func:`~engines.lora_answers.bad_adapter`).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs
import torch

from engines.lora_answers import MAX_ADAPTER_CONFIG_BYTES, LoraRefusal, bad_adapter

__all__ = ["Adapter", "LoraLayers", "read_adapter"]

_PREFIX = "base_model.model."


@attrs.frozen(eq=False)
class Adapter:
    """One loaded adapter: per adapted layer (by its module name), ``A`` ``[r, in]`` and
    ``B`` ``[out, r]``, and the scale of ``B A``."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, path: str, model: torch.nn.Module, *, max_rank: int) -> Adapter:
    """The adapter in ``path`` for ``model``; blocking. :class:`LoraRefusal` as vLLM answers
    a directory it cannot load (see the module docstring)."""
    from safetensors.torch import load_file

    directory = Path(path)
    config_file, weights_file = (
        directory / "adapter_config.json",
        directory / "adapter_model.safetensors",
    )
    if not config_file.is_file() or not weights_file.is_file():
        raise LoraRefusal(
            404,
            "NotFoundError",
            f"Loading lora {name} failed: No adapter found for {path}",
        )
    rank, alpha, rslora = _read_config(config_file)
    if rank > max_rank:  # vLLM's worker raises it, and the route wraps it as a failed call
        raise LoraRefusal(
            500,
            "InternalServerError",
            "Call to add_lora method failed: Worker failed with error 'LoRA rank "
            f"{rank} is greater than max_lora_rank {max_rank}.', please check the stack trace "
            "above for the root cause",
        )
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    try:
        tensors = load_file(str(weights_file), device="cpu")
    except Exception as exc:  # safetensors' own errors: a corrupt header, a short file
        raise bad_adapter(f"adapter_model.safetensors cannot be read: {exc}") from None
    modules = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix(_PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in stem:
                pairs.setdefault(stem.split(marker)[0], {})[part] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module_name, pair in pairs.items():
        layer = modules.get(module_name)
        if not isinstance(layer, torch.nn.Linear) or set(pair) != {"lora_A", "lora_B"}:
            raise LoraRefusal(
                500,
                "InternalServerError",
                f"Loading lora {name} failed: the model has no linear layer {module_name!r}",
            )
        a, b = pair["lora_A"], pair["lora_B"]
        if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
            raise LoraRefusal(
                500,
                "InternalServerError",
                f"Loading lora {name} failed: {module_name} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, the layer is [{layer.out_features}, {layer.in_features}]",
            )
        weight = layer.weight
        weights[module_name] = (
            a.to(weight.device, weight.dtype),
            b.to(weight.device, weight.dtype),
        )
    return Adapter(name, str(path), rank, scale, weights)


def _read_config(config_file: Path) -> tuple[int, float, bool]:
    """``adapter_config.json``'s rank, alpha (default: the rank) and ``use_rslora``; blocking.
    :func:`bad_adapter` for a file too large, not a JSON object, or values of the wrong kind."""
    too_large = bad_adapter(
        f"adapter_config.json is over the {MAX_ADAPTER_CONFIG_BYTES} bytes a load reads"
    )
    if config_file.stat().st_size > MAX_ADAPTER_CONFIG_BYTES:
        raise too_large
    with config_file.open("rb") as f:  # bounded even if the file grew since the stat
        data = f.read(MAX_ADAPTER_CONFIG_BYTES + 1)
    if len(data) > MAX_ADAPTER_CONFIG_BYTES:
        raise too_large
    try:
        config = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise bad_adapter(f"adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise bad_adapter("adapter_config.json is not a JSON object")
    if "r" not in config:
        raise bad_adapter("Missing required configuration fields: ['r']")
    rank = config["r"]
    if type(rank) is not int or rank <= 0:
        raise bad_adapter(f"LoRA rank `r` must be a positive integer, got {rank!r:.80}.")
    alpha = config.get("lora_alpha", rank)
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise bad_adapter(f"lora_alpha must be a finite number, got {alpha!r:.80}")
    return rank, float(alpha), config.get("use_rslora") is True


class LoraLayers:
    """A forward hook on each of ``model``'s linear layers that adds, to the output rows of a
    request with an adapter, that adapter's ``scale * B A x`` (its own layers only). The rows'
    adapters are set around each forward pass with :meth:`rows`, in the thread that runs it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._local = threading.local()
        head = getattr(model, "get_output_embeddings", lambda: None)()
        for module_name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.register_forward_hook(self._hook(module_name))

    @contextmanager
    def rows(self, adapters: Sequence[Adapter | None]) -> Iterator[None]:
        """Within it, forward passes in this thread add ``adapters[i]`` to row ``i``."""
        self._local.rows = adapters if any(a is not None for a in adapters) else None
        try:
            yield
        finally:
            self._local.rows = None

    def _hook(self, module_name: str):
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor):
            rows: Sequence[Adapter | None] | None = getattr(self._local, "rows", None)
            if rows is None:
                return None
            x = args[0]
            out = out.clone()
            for adapter in {id(a): a for a in rows if a is not None}.values():
                pair = adapter.weights.get(module_name)
                if pair is None:
                    continue
                a, b = pair
                index = torch.tensor(
                    [i for i, r in enumerate(rows) if r is adapter], device=out.device
                )
                delta = (x.index_select(0, index) @ a.T) @ b.T
                out.index_add_(0, index, delta * adapter.scale)
            return out

        return hook
