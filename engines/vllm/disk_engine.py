"""The project's ``disk`` weight transfer inside real vLLM: safetensors files the trainer wrote.

Started by ``--weight-transfer-config '{"backend": "disk"}'`` once the project is installed in
vLLM's environment (the entry point registers it: :mod:`engines.vllm`). The trainer's sender
(``sync.transport=disk``, :mod:`sync.transports.disk`) is unchanged: it speaks to this engine
exactly as to the reference server (``engines/local/weight_routes.py``, backend ``disk``).

- ``init_info`` is ``{"backend": "disk"}``: nothing to join (the files are the channel).
- Each ``update_info`` is vLLM's ``nccl`` one (``names``, ``dtype_names``, ``shapes``) plus
  ``path``, a safetensors file on a filesystem this server sees; the file must hold exactly
  those tensors with those dtypes and shapes, or the update fails naming the first mismatch.
- Only regular files under ``TRAINER_WEIGHT_DIR`` (the run's ``weight_sync/``, which the
  trainer sets for the servers it starts) are read, opened without following links
  (:mod:`engines.weight_access`); unset, the init is refused saying so. A path outside gets the
  same sentence whether or not it exists (vLLM answers it as any failed call: a 500 in its
  frame, which a plugin cannot change).
- Start and finish are the ``nccl`` engine's: vLLM's layerwise reload, so the weights are
  loaded with the model's own ``load_weights`` (fused projections, repacking, as at start-up),
  and after the finish a tied LM head prepared again (:mod:`engines.vllm.tied_head`).
  A failed update leaves the layers half-loaded (vLLM's behaviour, not this engine's).
- Chosen over vLLM's ``/collective_rpc reload_weights`` (a whole checkpoint directory per
  call): this keeps the trainer's four-phase protocol, its buckets and its per-route
  deadlines the same for every engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from engines.vllm.cpu_sampling import mend_cpu_seeded_rewind
from engines.vllm.tied_head import refresh_tied_heads
from engines.weight_access import (
    WEIGHT_DIR_ENV,
    load_weight_file,
    require_weight_dir,
    weight_dir_from_env,
)

__all__ = ["DiskInitInfo", "DiskUpdateInfo", "DiskWeightTransferEngine"]


@dataclass
class DiskInitInfo(WeightTransferInitInfo):
    """``{"backend": "disk"}``: the trainer names its transport; nothing else is needed."""

    backend: str = "disk"

    def __post_init__(self) -> None:
        if self.backend != "disk":
            raise ValueError(f"init_info backend {self.backend!r} is not 'disk'")


@dataclass
class DiskUpdateInfo(NCCLWeightTransferUpdateInfo):
    """vLLM's ``nccl`` update info plus the safetensors file that holds the tensors."""

    path: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.path:
            raise ValueError("update_info needs 'path': the safetensors file of this bucket")


class DiskWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's layerwise reload fed from safetensors files (see the module docstring)."""

    init_info_cls = DiskInitInfo  # type: ignore[assignment]
    update_info_cls = DiskUpdateInfo

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        mend_cpu_seeded_rewind()  # vLLM constructs this in its worker: engines.vllm.cpu_sampling

    def init_transfer_engine(self, init_info: object) -> None:
        """Nothing to join: the trainer writes files this server reads. Refused (ValueError)
        without ``TRAINER_WEIGHT_DIR``, the only folder updates may read."""
        require_weight_dir(weight_dir_from_env(), setting=WEIGHT_DIR_ENV)

    def finish_weight_update(self) -> None:
        """vLLM's finish (the layerwise reload finalised), then a tied LM head prepared again
        where vLLM's CPU build would keep it stale (:mod:`engines.vllm.tied_head`)."""
        super().finish_weight_update()
        refresh_tied_heads(self.model)

    def update_weights(self, update_info: dict[str, object]) -> None:
        """The base's, without its ``torch.accelerator.synchronize()`` (a CPU server has no
        accelerator; a GPU's copies are synchronous from a CPU tensor)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DiskUpdateInfo) -> None:  # type: ignore[override]
        """Read the bucket's file, check it is what ``update_info`` announces, load it."""
        tensors = load_weight_file(update_info.path, weight_dir_from_env(), setting=WEIGHT_DIR_ENV)
        announced = zip(update_info.names, update_info.dtype_names, update_info.shapes)
        for name, dtype, shape in announced:
            tensor = tensors.get(name)
            if tensor is None:
                raise ValueError(f"{update_info.path} has no tensor {name!r}")
            got = (str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
            if got != (dtype, [int(x) for x in shape]):
                raise ValueError(
                    f"{update_info.path}: {name!r} is {got[0]} {got[1]}, announced "
                    f"{dtype} {list(shape)}"
                )
        self.model.load_weights([(name, tensors[name]) for name in update_info.names])

    def shutdown(self) -> None:
        """Nothing held between updates."""
