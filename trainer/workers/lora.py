"""LoRA (``model.lora.*``): the policy as a frozen model plus a trainable low-rank adapter.

peft does the adapter (:func:`add_adapter`: ``get_peft_model`` with a ``LoraConfig``): each
targeted linear layer ``W`` computes ``W x + (alpha / r) B A x``, ``B`` starting at zero, so the
step-0 policy is the base model. Only ``A`` and ``B`` have gradients; the optimizer is built over
them alone (:func:`trainer.workers.training.trainable_parameters`).

The engines serve full weights: :class:`MergedWeights` is what a weight transport reads, the
base model's parameters by their own names (what the engines hold), with every adapted layer's
weight replaced by ``W + (alpha / r) B A`` (peft's ``get_delta_weight``) in a tensor of its
own, refreshed in place before a sync reads it after the adapter changed. The policy is never
merged in place (TRL's merge-then-unmerge): a merge and an unmerge round ``W`` a little each
time, and the base must stay bit-identical for an adapter-only checkpoint to resume exactly.
The cost is one copy of the adapted layers' weights, held for the run.

The reference model (KL) is the base model itself: a LoRA policy starts there.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from trainer.checkpoint.format import (
    ADAPTER_WEIGHTS,
    check_adapter_shape,
    read_base,
    weights_digest,
    write_base,
)
from trainer.errors import CheckpointError
from trainer.workers.fsdp import is_dtensor

__all__ = [
    "ADAPTER_NAME",
    "AdapterCopy",
    "LoraSpec",
    "MergedWeights",
    "add_adapter",
    "base_parameters",
    "is_adapter_parameter",
    "merged_copy",
]

#: The adapter's name inside the peft model (peft's default).
ADAPTER_NAME = "default"


@attrs.frozen
class LoraSpec:
    """The adapter a policy trains (``model.lora``)."""

    rank: int
    alpha: int = 16
    dropout: float = 0.0
    #: Module names, or ``("all-linear",)``: every linear layer but the LM head.
    target_modules: tuple[str, ...] = ("all-linear",)
    #: The weight transports read the merged weights (``sync.lora=merged``); False: the
    #: policy itself, whose adapter the engines load (``sync.lora=adapter``).
    merged: bool = True


def add_adapter(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """``model`` frozen, with a fresh LoRA adapter of ``spec`` (a peft ``PeftModel``).

    ``ValueError`` naming the model's linear layers when ``spec.target_modules`` matches none.
    """
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = (
        "all-linear" if spec.target_modules == ("all-linear",) else list(spec.target_modules)
    )
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers' old names
            return get_peft_model(model, config)  # type: ignore[arg-type]
    except ValueError as exc:
        linear = sorted(
            {
                n.rsplit(".", 1)[-1]
                for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear)
            }
        )
        raise ValueError(
            f"model.lora.target_modules={list(spec.target_modules)} does not fit "
            f"{type(model).__name__} ({exc}); its linear layers are named {linear}"
        ) from None


def base_parameters(peft_model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The base model's own parameters by their own names (no adapter, no peft prefix):
    adapted layers' ``...q_proj.base_layer.weight`` as ``...q_proj.weight``."""
    base = peft_model.get_base_model()  # type: ignore[operator]
    for name, p in base.named_parameters():
        if ".lora_" not in name:
            yield name.replace(".base_layer.", "."), p


class MergedWeights(torch.nn.Module):
    """The policy's full weights, adapter merged, by the base model's names (see the module
    docstring): what a weight transport reads (``named_parameters``) and what the sync check
    scores (a call runs the policy itself: same logits, to float rounding). Read-only."""

    def __init__(self, peft_model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_policy", peft_model)  # not a submodule: no parameters of its own
        self.config = getattr(peft_model.get_base_model(), "config", None)  # type: ignore[operator]
        base = peft_model.get_base_model()  # type: ignore[operator]
        self._params: dict[str, torch.nn.Parameter] = {}
        #: (merged tensor, its adapted layer) for each adapted weight.
        self._merged: list[tuple[torch.nn.Parameter, Any]] = []
        for name, p in base_parameters(peft_model):
            layer = _adapted_layer(base, name)
            if layer is None:
                self._params[name] = p
                continue
            merged = torch.nn.Parameter(torch.empty_like(p), requires_grad=False)
            self._params[name] = merged
            self._merged.append((merged, layer))
        self.stale = True

    @torch.no_grad()
    def refresh(self) -> None:
        """Recompute every merged weight from the adapter now (in place: the tensors a
        transport keeps a layout of stay where they are)."""
        for merged, layer in self._merged:
            merged.copy_(_merged_weight(layer, merged.dtype))
        self.stale = False

    def fresh(self) -> MergedWeights:
        """Itself, refreshed if the adapter changed since the last refresh."""
        if self.stale:
            self.refresh()
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._policy(*args, **kwargs)  # type: ignore[operator]

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for name, p in self._params.items():
            yield prefix + name, p

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:  # type: ignore[override]
        yield from self._params.values()


def _merged_weight(layer: Any, dtype: torch.dtype) -> torch.Tensor:
    """``W + (alpha / r) B A`` of a peft LoRA layer (peft's ``get_delta_weight``), in ``dtype``."""
    return layer.base_layer.weight + layer.get_delta_weight(ADAPTER_NAME).to(dtype)


@torch.no_grad()
def merged_copy(peft_model: torch.nn.Module, done: Container[str] = ()) -> dict[str, torch.Tensor]:
    """The merged weights by the base model's names, every one a tensor of its own: what
    :class:`MergedWeights` holds, for a policy whose parameters are FSDP2 shards: those whose
    module is unsharded now (:func:`trainer.workers.fsdp.unsharded_in_turn`, whose full
    tensors go when the next module's turn comes), leaving out the shards (DTensors) and the
    names in ``done``."""
    base = peft_model.get_base_model()  # type: ignore[operator]
    out: dict[str, torch.Tensor] = {}
    for name, p in base_parameters(peft_model):
        if name in done or is_dtensor(p):
            continue
        layer = _adapted_layer(base, name)
        out[name] = p.detach().clone() if layer is None else _merged_weight(layer, p.dtype)
    return out


def is_adapter_parameter(name: str) -> bool:
    """Whether ``name`` (a peft model's parameter name) is one of the adapter's tensors."""
    return ".lora_" in name


class AdapterCopy(torch.nn.Module):
    """A LoRA policy's adapter copied out (peft's adapter state dict and its config), saved as
    peft's ``save_pretrained`` saves it: what ``sync.lora=adapter`` reads of a policy whose
    parameters are FSDP2 shards, from ``params``: the adapter's tensors gathered
    (:func:`~trainer.workers.fsdp.gathered_model` with :func:`is_adapter_parameter`; the base
    stays sharded). No parameters of its own."""

    def __init__(self, peft_model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
        from peft import get_peft_model_state_dict

        super().__init__()
        with torch.no_grad():
            # the gathered parameters, not its state_dict: FSDP2 hooks that to answer the shards
            state = get_peft_model_state_dict(peft_model, state_dict=params)
            self.state = {k: v.detach().clone().contiguous() for k, v in state.items()}
        self.peft_config: Any = copy.deepcopy(peft_model.peft_config[ADAPTER_NAME])  # type: ignore[index]
        self.peft_config.inference_mode = True  # as peft writes it

    def save_pretrained(self, directory: str) -> None:
        """``adapter_model.safetensors`` and ``adapter_config.json`` into ``directory``."""
        from safetensors.torch import save_file

        Path(directory).mkdir(parents=True, exist_ok=True)
        save_file(self.state, str(Path(directory) / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        self.peft_config.save_pretrained(directory)


def _adapted_layer(base: torch.nn.Module, name: str) -> Any:
    """The peft LoRA layer whose frozen weight ``name`` (a base-model name) is, or None."""
    from peft.tuners.lora import LoraLayer

    module_name, _, leaf = name.rpartition(".")
    if leaf != "weight":
        return None
    try:
        module = base.get_submodule(module_name)
    except AttributeError:
        return None
    if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
        return module
    return None


class LoraCheckpoint:
    """Writes and reads a LoRA policy's ``policy/`` (see :mod:`trainer.checkpoint._lora`)."""

    def __init__(self, peft_model: torch.nn.Module, model_dir: str | Path) -> None:
        self.model = peft_model
        self.model_dir = str(model_dir)
        self._digest: str | None = None

    def base_digest(self) -> str:
        """The frozen base weights' digest (computed once: they never change)."""
        if self._digest is None:
            self._digest = weights_digest(base_parameters(self.model))
        return self._digest

    def save(self, directory: Path) -> None:
        """The adapter (peft's files) and its base's identity into ``directory``."""
        self.model.save_pretrained(str(directory))  # type: ignore[operator]
        write_base(directory, self.model_dir, self.base_digest())

    def load(self, directory: Path) -> None:
        """The adapter of ``directory`` into the policy, after checking that it was trained on
        this base (its digest) and has this run's shape; ``CheckpointError`` otherwise."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        base = read_base(directory)
        if base.get("digest") != self.base_digest():
            raise CheckpointError(
                f"the LoRA adapter in {directory} was trained on the model in "
                f"{base.get('model_dir')!r}, whose weights differ from this run's base "
                f"({self.model_dir!r}): resume with that model.path"
            )
        config: Any = self.model.peft_config[ADAPTER_NAME]  # type: ignore[index]
        check_adapter_shape(
            directory,
            {
                "r": config.r,
                "lora_alpha": config.lora_alpha,
                "target_modules": config.target_modules,
            },
        )
        weights = load_file(str(Path(directory) / ADAPTER_WEIGHTS), device="cpu")
        result = set_peft_model_state_dict(self.model, weights, adapter_name=ADAPTER_NAME)
        missing = [k for k in result.missing_keys if ".lora_" in k]
        if result.unexpected_keys or missing:
            raise CheckpointError(
                f"the adapter in {directory} does not match the policy's: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}"
            )
