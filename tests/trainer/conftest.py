"""Fixtures for the trainer tests: one Ray cluster per test run, started only if a test asks.

The cluster is started the way the trainer starts it (``start_cluster``: the start-up fix
plus retries of the start only). If it still cannot start, every test that needs it errors
with :class:`RayClusterStartError` and its reasons: never a skip.
"""

from __future__ import annotations

import os

import pytest

from trainer.workers.ray_cluster import start_cluster, stop_cluster


@pytest.fixture(scope="session")
def ray_cluster() -> str:
    """The address (GCS ``host:port``) of this test run's local Ray cluster."""
    import ray

    # the actors of these tests get at most these CPUs' worth of logical resources
    start_cluster(None, retries=3, num_cpus=max(4, os.cpu_count() or 1))
    address = ray.get_runtime_context().gcs_address
    yield address
    stop_cluster()
