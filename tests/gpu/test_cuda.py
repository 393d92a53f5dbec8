"""CUDA-only checks: skipped (with the reason) on a machine without a GPU; ``just gpu-check``
runs them first (``benchmarks/gpu_check.py``).

Each checks a thing no CPU test can: a device as tensors report it, offload really freeing
GPU memory, a policy training on the GPU in bfloat16, the reference engine generating there.
"""

from __future__ import annotations

import pytest
import torch
import trio

from engines.devices import resolve_device
from engines.local.engine import open_local_engine
from engines.models import build_tiny_model
from engines.types import SamplingParams
from trainer.workers.offload import offload_training_state, restore_training_state
from trainer.workers.policy import PolicyWorker

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (runs in just gpu-check)"
)


def test_a_cuda_device_resolves_to_what_its_tensors_report():
    for name in ("auto", "cuda"):
        device = resolve_device(name)
        assert torch.empty(1, device=device).device == device, name


def test_offload_frees_gpu_memory_and_restore_brings_back_the_same_values():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    optimizer.step()  # optimizer state on the GPU too
    before = [p.detach().clone() for p in model.parameters()]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    device = resolve_device("cuda")
    offloaded = offload_training_state(model, optimizer, device, torch.device("cpu"))
    torch.cuda.synchronize()
    # parameters, gradients and two AdamW moments: 4 copies of 2 x (1024^2 + 1024) floats
    assert offloaded.nbytes >= 4 * 2 * (1024 * 1024 + 1024) * 4
    assert torch.cuda.memory_allocated() <= allocated - offloaded.nbytes // 2
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert restore_training_state(offloaded) == offloaded.nbytes
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.device == device for p in model.parameters())


def test_a_policy_trains_on_the_gpu_in_bfloat16_and_offloads():
    worker = PolicyWorker(build_tiny_model(), lr=1e-3, device="cuda", offload=True)
    assert next(worker.model.parameters()).dtype == torch.bfloat16
    assert next(worker.model.parameters()).device == resolve_device("cuda")
    metrics = worker.offload_to_cpu()
    assert metrics["workers/offload_bytes"] > 0
    assert next(worker.model.parameters()).device.type == "cpu"
    assert worker.optim_step()["policy/lr"] > 0  # brought back before it computes
    assert next(worker.model.parameters()).device == resolve_device("cuda")


async def test_the_reference_engine_generates_on_the_gpu():
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=0)
    async with open_local_engine(build_tiny_model(), device="cuda") as engine:
        assert next(engine.model.parameters()).device.type == "cuda"
        with trio.fail_after(60):
            completion = await engine.generate([5, 6, 7], params)
    assert len(completion.token_ids) == 8
