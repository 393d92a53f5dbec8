"""``workers.backend=ray`` set up: the config that asks for it, the cluster start's error, the
rows each rank gets, the GPUs and bundles its actors are placed with."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from tests.e2e.helpers import run_in_own_ray_cluster
from trainer.config import load_config
from trainer.errors import ConfigError, RayClusterStartError
from trainer.workers.ray_cluster import require_token
from trainer.workers.ray_placement import bundles, gpus_for, shards


def test_local_backend_with_two_workers_is_a_config_error_saying_why():
    with pytest.raises(ConfigError, match=r"backend='local' runs exactly 1 policy worker"):
        load_config(None, ["workers.num_policy_workers=2"])
    cfg = load_config(None, ["workers.backend=ray", "workers.num_policy_workers=2"])
    assert (cfg.workers.backend, cfg.workers.num_policy_workers) == ("ray", 2)


def test_cluster_start_error_is_picklable_and_names_every_attempt():
    err = RayClusterStartError(None, 2, ["Exception: node timed out", "Exception: again"])
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err)
    assert "attempt 1: Exception: node timed out; attempt 2: Exception: again" in str(err)


def test_shards_cover_every_row_once():
    assert shards(5, 2) == [slice(0, 3), slice(3, 5)]
    assert shards(1, 3) == [slice(0, 1), slice(1, 1), slice(1, 1)]


def test_gpus_per_worker_follows_the_key_then_the_device():
    assert gpus_for(0.5, "cpu") == 0.5
    assert gpus_for(None, "cuda") == 1.0
    assert gpus_for(None, "cpu") == 0.0


def test_a_reference_model_on_gpus_has_its_own_bundle_in_the_group():
    """Placed with the policy or not at all: never a policy whose reference waits for a GPU."""
    assert bundles(2, 1.0, True) == [{"CPU": 1.0, "GPU": 1.0}] * 2 + [{"GPU": 1.0}]
    assert bundles(2, 0.5, False) == [{"CPU": 1.0, "GPU": 0.5}] * 2
    assert bundles(2, 0.0, True) == [{"CPU": 1.0}] * 2  # on the CPU it needs no bundle


#: A cluster of its own with 3 logical GPUs: 2 policy ranks and the reference, one GPU each.
_GPU_GROUP = """
import json, os, sys, trio, ray
from trainer.workers.ray_cluster import actor_env, init_kwargs, prepare_env
from trainer.workers.ray_group import RayWorkerGroup

prepare_env()
ray.init(**init_kwargs(None, num_cpus=4), num_gpus=3)
def visible(model):
    return os.environ.get("CUDA_VISIBLE_DEVICES")
async def main():
    kwargs = {"lr": 1e-3, "seed": 0, "device": "cpu"}
    group = await RayWorkerGroup.create(
        sys.argv[1], policy_kwargs=kwargs, with_ref=True, num_workers=2, gpus_per_worker=1.0
    )
    try:
        rank0 = await group.run_on_rank0(visible)
        print("RESULT " + json.dumps({"names": sorted(group.pids), "rank0": rank0,
              "free_gpus": ray.available_resources().get("GPU", 0)}))
    finally:
        await group.shutdown()

trio.run(main)
ray.shutdown()
"""


def test_policy_ranks_and_the_reference_are_placed_on_their_gpus_together(model_dir):
    """Logical GPUs (Ray assigns them on a CPU machine as on a GPU one): the three actors are
    placed from one placement group, rank 0 sees its one GPU, none is left over."""
    result = run_in_own_ray_cluster(_GPU_GROUP, str(model_dir), timeout_s=300)
    assert result["names"] == ["policy:0", "policy:1", "ref:0"]
    assert result["rank0"] is not None and len(result["rank0"].split(",")) == 1
    assert result["free_gpus"] == 0


def _ask_gcs(address: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Another process asks the cluster's GCS for its nodes (one gRPC call: a driver's
    ``ray.init`` would retry a refusal for 20 s); prints ``nodes N`` if it was answered."""
    code = (
        "from ray._raylet import GcsClient\n"
        f"print('nodes', len(GcsClient(address={address!r}).get_all_node_info(timeout=30)))"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_the_cluster_the_trainer_starts_turns_away_a_caller_without_its_token(ray_cluster):
    """Ray's ports listen on every interface: the cluster start_cluster makes asks for the
    process's token (RAY_AUTH_MODE=token); a caller that sends none, or another token, is
    refused by the GCS; one with the token is answered."""
    assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN"]
    stranger = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    for auth in (
        {"RAY_AUTH_MODE": "disabled"},
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "x" * 43},
    ):
        refused = _ask_gcs(ray_cluster, {**stranger, **auth})
        assert refused.returncode != 0 and "nodes" not in refused.stdout
        assert "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]
    assert _ask_gcs(ray_cluster, dict(os.environ)).stdout.split()[0] == "nodes"


def test_an_operators_own_ray_auth_mode_wins(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    require_token()
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in os.environ
