"""Workers on a device: names resolved where the model is, offload that moves exactly the
training state, and the CPU default unchanged (the CUDA side is checked on a GPU; see
docs/gpus.md for what was verified where)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.devices import cuda_unavailable_reason, resolve_device, resolve_dtype
from engines.models import resolve_model_path
from tests.trainer.helpers import random_batch
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.workers.batch import TrainBatch
from trainer.workers.device import collective_backend
from trainer.workers.offload import (
    offload_training_state,
    restore_training_state,
    tensor_bytes,
)
from trainer.workers.policy import OFFLOAD_METRICS, PolicyWorker

REPO = Path(__file__).resolve().parents[3]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_path(None)


def make_batch(model_dir: Path) -> TrainBatch:
    return random_batch(model_dir, 4, seed=0)


def test_auto_is_the_cpu_in_float32_on_a_machine_without_cuda():
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
        return
    assert resolve_device("auto") == CPU
    assert resolve_dtype("auto", CPU) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) is torch.float32


@NO_CUDA
def test_cuda_without_cuda_is_a_config_error_saying_what_to_do():
    with pytest.raises(ConfigError) as info:
        resolve_device("cuda")
    message = str(info.value)
    assert message.startswith("config: workers.device='cuda' but ")
    # each way out once, as it is typed
    assert message.endswith(
        "; or set workers.device=auto or workers.device=cpu (auto: CUDA when available)"
    )
    assert message.count("config:") == 1
    with pytest.raises(ConfigError, match=r"; or pass --device auto or --device cpu \(auto"):
        resolve_device("cuda", key="--device")


@NO_CUDA
def test_a_cpu_only_torch_is_told_where_the_install_step_is():
    reason = cuda_unavailable_reason()
    assert reason is not None and "install a CUDA build of torch" in reason
    doc, anchor = re.search(r"\((docs/gpus\.md)#([\w-]+)\)", reason).groups()  # type: ignore[union-attr]
    headings = [line for line in Path(REPO, doc).read_text().splitlines() if line[:1] == "#"]
    slugs = {"-".join(h.lstrip("#").strip().lower().split()) for h in headings}
    assert anchor in slugs
    assert "bash setup.sh" in Path(REPO, doc).read_text()


def test_unknown_device_and_dtype_names_the_allowed_values():
    with pytest.raises(ConfigError, match="choose one of 'auto', 'cpu', 'cuda'"):
        resolve_device("tpu", key="engine.device")
    with pytest.raises(ConfigError, match="--dtype float16 is not allowed"):
        resolve_dtype("float16", CPU, key="--dtype")


def test_the_collective_backend_follows_the_tensors_not_the_driver():
    assert collective_backend(CPU) == "gloo"
    assert collective_backend(torch.device("cuda")) == "nccl"
    assert collective_backend(torch.device("cuda", 3)) == "nccl"


@NO_CUDA
def test_a_policy_worker_asked_for_cuda_refuses_before_loading(model_dir):
    with pytest.raises(ConfigError, match=r"workers\.device='cuda'"):
        PolicyWorker(model_dir, lr=1e-3, device="cuda")


def _trained(model_dir: Path) -> PolicyWorker:
    worker = PolicyWorker(model_dir, lr=1e-2, seed=0)
    batch = make_batch(model_dir)
    worker.forward_backward(batch, batch.counts)
    worker.optim_step()
    worker.forward_backward(batch, batch.counts)  # gradients present, as after training
    return worker


def test_offload_moves_params_grads_and_optimizer_state_and_counts_their_bytes(model_dir):
    worker = _trained(model_dir)
    model, optimizer = worker.model, worker.optimizer
    params = list(model.parameters())
    # the step counters sit "elsewhere" (as AdamW's CPU counters do beside CUDA weights)
    steps = []
    for state in optimizer.state.values():
        state["step"] = state["step"].to("meta")
        steps.append(state["step"])
    before = {
        "params": [p.detach().clone() for p in params],
        "grads": [p.grad.clone() for p in params if p.grad is not None],
        "ptrs": [p.data_ptr() for p in params],
        "state": [
            (k, v.clone()) for s in optimizer.state.values() for k, v in s.items() if k != "step"
        ],
    }
    expected = sum(tensor_bytes(p) for p in params)
    expected += sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
    expected += sum(t.numel() * t.element_size() for _, t in before["state"])

    record = offload_training_state(model, optimizer, CPU, CPU)

    assert record.nbytes == expected
    assert len(record.params) == len(params)
    assert {k for _, k in record.optimizer_entries} == {"exp_avg", "exp_avg_sq"}
    assert all(a is b for a, b in zip(model.parameters(), params))  # same Parameter objects
    assert all(p.data_ptr() != ptr for p, ptr in zip(params, before["ptrs"]))  # new storage
    assert [s["step"] for s in optimizer.state.values()] == steps  # left where they were
    for p, value in zip(params, before["params"]):
        assert torch.equal(p.detach(), value)
    assert restore_training_state(record) == expected
    for p, value in zip(params, before["params"]):
        assert torch.equal(p.detach(), value)
    grads = [p.grad for p in params if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(grads, before["grads"]))
    state_after = [(k, v) for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(state_after, before["state"]))


def test_training_goes_on_identically_after_an_offload_round_trip(model_dir):
    moved, twin = _trained(model_dir), _trained(model_dir)
    record = offload_training_state(moved.model, moved.optimizer, CPU, CPU)
    restore_training_state(record)
    for worker in (moved, twin):
        worker.optim_step()
    for (name, a), (_, b) in zip(moved.model.named_parameters(), twin.model.named_parameters()):
        assert torch.equal(a, b), name


def test_on_the_cpu_offload_and_backload_are_no_ops_reporting_zero_bytes(model_dir):
    worker = PolicyWorker(model_dir, lr=1e-3, offload=True)
    ptrs = [p.data_ptr() for p in worker.model.parameters()]
    assert worker.offload_to_cpu() == {OFFLOAD_METRICS[0]: 0.0}
    assert worker.backload_to_gpu() == {OFFLOAD_METRICS[1]: 0.0}
    assert [p.data_ptr() for p in worker.model.parameters()] == ptrs


def test_gradient_checkpointing_gives_the_same_gradients(model_dir):
    batch = make_batch(model_dir)
    grads = []
    for checkpointing in (False, True):
        worker = PolicyWorker(model_dir, lr=1e-3, seed=0, gradient_checkpointing=checkpointing)
        layers = worker.model.get_submodule("model.layers")
        assert [getattr(m, "gradient_checkpointing", False) for m in layers.children()] == [
            checkpointing
        ] * 2
        worker.forward_backward(batch, batch.counts)
        grads.append([p.grad for p in worker.model.parameters()])
    for a, b in zip(*grads):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_bfloat16_policy_holds_bf16_weights_and_returns_float32_logprobs(model_dir):
    worker = PolicyWorker(model_dir, lr=1e-3, dtype="bfloat16")
    assert {p.dtype for p in worker.model.parameters()} == {torch.bfloat16}
    fp32 = PolicyWorker(model_dir, lr=1e-3)
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    batch = make_batch(model_dir)
    logprobs = worker.compute_logprobs(batch)
    assert (logprobs.dtype, logprobs.device) == (torch.float32, CPU)
    torch.testing.assert_close(logprobs, fp32.compute_logprobs(batch), rtol=0.05, atol=0.1)


def test_train_batch_to_moves_every_set_tensor():
    batch = make_batch(resolve_model_path(None))
    assert batch.to(CPU) is batch
    moved = batch.to(torch.device("meta"))
    assert moved.input_ids.device.type == "meta" and moved.advantages is not None
    assert moved.advantages.device.type == "meta" and moved.ref_logprobs is None


@NO_CUDA
def test_the_reference_engine_refuses_device_cuda_without_cuda():
    done = subprocess.run(
        [sys.executable, "-m", "engines.local", "serve", "--device", "cuda", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ConfigError: --device cuda but ")
    assert "--device auto" in last and "ENGINE_READY" not in done.stdout


@NO_CUDA
def test_engine_device_cuda_is_refused_at_load():
    """The run plan resolves the reference engines' devices, so a device this machine lacks
    is refused before anything starts."""
    with pytest.raises(ConfigError, match=r"config: engine.device='cuda:0' but "):
        load_config(None, ["engine.device=cuda", "engine.gpu_ids=[0,1]"])


def test_the_device_keys_default_to_auto_and_validate_their_values():
    cfg = load_config(None, [])
    w = cfg.workers
    assert (w.device, w.dtype, w.gradient_checkpointing) == ("auto", "auto", False)
    assert (w.gpus_per_worker, w.data_parallel, cfg.engine.device) == (None, "auto", "auto")
    with pytest.raises(ConfigError, match="choose one of 'auto', 'cpu', 'cuda'"):
        load_config(None, ["workers.device=gpu"])
    with pytest.raises(ConfigError, match=r"workers\.gpus_per_worker=-1\.0 is out of range"):
        load_config(None, ["workers.gpus_per_worker=-1"])


def test_fsdp2_with_checkpoints_is_refused_until_sharded_checkpoints_exist():
    ray = ["workers.backend=ray", "workers.num_policy_workers=2", "workers.data_parallel=fsdp2"]
    with pytest.raises(ConfigError, match=r"workers\.data_parallel='fsdp2' cannot save or resume"):
        load_config(None, [*ray, "trainer.ckpt_interval=2"])
    cfg = load_config(None, ray)
    assert cfg.workers.data_parallel == "fsdp2" and cfg.plan.sharded
    # one rank (or local workers) shards nothing: its checkpoints work
    assert not load_config(
        None, ["workers.data_parallel=fsdp2", "trainer.ckpt_interval=2"]
    ).plan.sharded
