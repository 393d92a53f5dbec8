"""Write ``vllm_weight_transfer.json``: the fields of vLLM's ``nccl`` and ``ipc`` weight-transfer messages.

``tests/engines/test_weight_transfer_messages.py`` checks the bodies this project sends
against this file, so it runs where vLLM is not importable (CI, CPU machines). Regenerate it
whenever the vLLM we target changes.

How it was run (vLLM 0.33.0, the same ``/tmp/vllm_site`` as ``dump_vllm_shapes.py``, which
lists what was pip-installed there; only the modules below are imported, which works
without a GPU)::

    PYTHONPATH=/tmp/vllm_site .venv/bin/python tests/engines/vllm_recorded/dump_vllm_weight_transfer.py

For each dataclass: its module, and each field's type (as written in the source), whether
it is required, and its default. Also the server's backend choice
(``WeightTransferConfig.backend``) and the packed-transfer defaults.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("vllm_weight_transfer.json")


def _fields(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out[f.name] = {
            "type": f.type
            if isinstance(f.type, str)
            else (f.type.__name__ if isinstance(f.type, type) else repr(f.type)),
            "required": not has_default,
            "default": default,
        }
    return out


def vllm_weight_transfer() -> dict[str, Any]:
    """The message fields of the installed vLLM, as written to ``vllm_weight_transfer.json``."""
    import vllm
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import ipc_engine, nccl_common, nccl_engine, packed_tensor

    classes = {
        "nccl.init_info": nccl_common.NCCLWeightTransferInitInfo,
        "nccl.update_info": nccl_engine.NCCLWeightTransferUpdateInfo,
        "nccl.trainer_init_info": nccl_engine.NCCLTrainerInitInfo,
        "ipc.init_info": ipc_engine.IPCWeightTransferInitInfo,
        "ipc.update_info": ipc_engine.IPCWeightTransferUpdateInfo,
        "ipc.trainer_init_info": ipc_engine.IPCTrainerInitInfo,
    }
    return {
        "vllm_version": vllm.__version__,
        "messages": {
            key: {"qualname": f"{cls.__module__}.{cls.__qualname__}", "fields": _fields(cls)}
            for key, cls in classes.items()
        },
        "server_backend": _fields(WeightTransferConfig)["backend"],
        "DEFAULT_PACKED_BUFFER_SIZE_BYTES": packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        "DEFAULT_PACKED_NUM_BUFFERS": packed_tensor.DEFAULT_PACKED_NUM_BUFFERS,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(vllm_weight_transfer(), indent=1) + "\n")
    print(f"wrote {OUT}")
