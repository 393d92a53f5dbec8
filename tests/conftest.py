"""Suite-wide fixtures: fault isolation; one Ray cluster per test run, started only if asked.

The cluster is started the way the trainer starts it (``start_cluster``: the start-up fix
plus retries of the start only). If it still cannot start, every test that needs it errors
with :class:`RayClusterStartError` and its reasons: never a skip.
"""

from __future__ import annotations

import os

import pytest
import torch

#: Two test workers share this machine's cores: each run the suite starts (in process or as
#: a subprocess) takes one core's share, as before runs took every core in their turn
#: (``trainer.config.cpu_threads``, the run plan's ``threads``). A shell that sets it keeps its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from trainer.vocabulary import FAULTS_ENV, FAULTS_FIRED_ENV, install_faults, release_hangs
from trainer.workers.ray_cluster import start_cluster, stop_cluster


@pytest.fixture(scope="session", autouse=True)
def _fork_server_for_runs():
    """Every run of the suite, in this process or a ``python -m trainer`` started from it,
    forks its reference servers from this test process's fork server (docs/engines.md:
    about 5 s of CPU less per server), as :func:`tests.e2e.helpers.run_trainer` forks whole
    runs. Tests of the launchers' own process start call them without it."""
    from tests.e2e.helpers import fork_server

    os.environ["TRAINER_FORK_SERVER"] = fork_server()
    yield
    os.environ.pop("TRAINER_FORK_SERVER", None)


@pytest.fixture(autouse=True)
def _isolated_faults():
    """Each test starts with no faults (whatever the shell exports) and leaves none behind.

    Threads a test left blocked in a ``hang`` fault are released (``release_hangs``,
    test-only) so they do not pile up across the run.
    """
    saved = os.environ.pop(FAULTS_ENV, None)
    os.environ.pop(FAULTS_FIRED_ENV, None)
    install_faults(None)
    yield
    release_hangs()
    install_faults(None)
    os.environ.pop(FAULTS_ENV, None)
    os.environ.pop(FAULTS_FIRED_ENV, None)
    if saved is not None:
        os.environ[FAULTS_ENV] = saved


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test, like the engine servers (``--num-threads 1``): more
    threads on a busy two-core box make every small forward pass many times slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def ray_cluster() -> str:
    """The address (GCS ``host:port``) of this test run's local Ray cluster."""
    import ray

    # the actors of these tests get at most these CPUs' worth of logical resources
    start_cluster(None, retries=3, num_cpus=max(6, os.cpu_count() or 1))
    address = ray.get_runtime_context().gcs_address
    yield address
    stop_cluster()


#: The slowest test files, slowest first (their summed seconds on an idle two-core machine,
#: 2026-12-04, as the end of `just test` lists them). The suite runs them first, so that the two
#: workers (``-n 2 --dist loadfile --no-loadscope-reorder``) end with short files instead of
#: one worker finishing a two-minute file while the other waits. A file missing here only
#: runs later; refresh the list from the end of a run when it no longer matches.
HEAVY_FIRST = (
    "tests/trainer/loop/test_engine_recovery.py",  # 112-118
    "tests/e2e/test_fully_async_cli.py",  # 91-94
    "tests/trainer/run/test_ray_cli.py",  # 68-90
    "tests/test_doc_commands.py",  # 58-63
    "tests/e2e/test_weight_sync_cli.py",  # 54-55
    "tests/engines/launch/test_ray_launch.py",  # 50-52
    "tests/e2e/test_timeouts_cli.py",  # 44-48
    # test_ray_workers.py (128-145 s) split in four; timed once apart, on a busy machine
    "tests/trainer/workers/test_ray_rank0.py",  # 43
    "tests/trainer/workers/test_ray_failures.py",  # 40
    "tests/trainer/workers/test_ray_data_parallel.py",  # 39
    "tests/engines/launch/test_launch.py",  # 33-35
    "tests/e2e/test_real_model.py",  # 26-28
    "tests/e2e/test_debug_cli.py",  # 24-31 (trimmed 2026-12-04)
    "tests/e2e/test_train_cli.py",  # 22-27 (trimmed 2026-12-04)
    "tests/trainer/run/test_lora_run.py",  # 20
    "tests/trainer/workers/test_ray_setup.py",  # 18
)


#: Files ``just test-quick`` leaves out besides the tests marked ``slow`` or ``vllm``: those of
#: :data:`HEAVY_FIRST`, and these: the slowest of the rest, their summed seconds in the quick set's
#: own run (2026-12-07, two workers on two cores, load average 3 during it: 431 s of tests, 252 s
#: wall with them; 10 s and more each). Refresh from the end of a ``just test-quick`` run.
SLOW_FILES = (
    *HEAVY_FIRST,
    "tests/trainer/run/test_critic_run.py",  # 40
    "tests/trainer/data/test_reasoning_gym_learns.py",  # 28
    "tests/trainer/generators/test_openai_agent.py",  # 27
    "tests/sync/test_bracket_orders.py",  # 22
    "tests/trainer/generators/test_verifiers_env.py",  # 20
    "tests/trainer/workers/test_fsdp.py",  # 17
    "tests/engines/launch/test_parent_death.py",  # 17
    "tests/sync/test_broadcast_transport.py",  # 16
    "tests/engines/launch/test_launch_secret.py",  # 16
    "tests/engines/launch/test_fork_server.py",  # 15
    "tests/engines/test_weight_transfer_messages.py",  # 12
    "tests/sync/test_disk_transport.py",  # 10
    "tests/trainer/run/test_interrupt.py",  # 10
    "tests/trainer/run/test_distillation_run.py",  # 23-26 at load 6 (2026-12-08): one run + teacher
)


def pytest_collection_modifyitems(config, items):
    """The files of :data:`HEAVY_FIRST` first, in its order; the rest as collected. Every test
    that is not marked ``slow``, ``vllm`` or ``tinker`` and not in a file of :data:`SLOW_FILES` is marked
    ``quick`` (``just test-quick``: ``-m quick``)."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    slow_files = frozenset(SLOW_FILES)

    def key(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(HEAVY_FIRST))

    items.sort(key=key)  # stable: each file's tests keep their order
    for item in items:
        marked = any(item.get_closest_marker(m) is not None for m in ("slow", "vllm", "tinker"))
        if not marked and item.nodeid.split("::", 1)[0] not in slow_files:
            item.add_marker(pytest.mark.quick)


#: A test whose setup, call and teardown together take longer is named at the end of the run
#: (reported, never failed: wall time on a shared machine is not an assertion).
TEST_BUDGET_S = 60.0
#: How many of the slowest test files the end of the run lists.
SLOWEST_FILES = 15


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Where the run's time went: the slowest test files (setup, call and teardown of all
    their tests), and every test over :data:`TEST_BUDGET_S`."""
    per_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                per_test[report.nodeid] = per_test.get(report.nodeid, 0.0) + report.duration
    if not per_test:
        return
    per_file: dict[str, float] = {}
    for nodeid, seconds in per_test.items():
        path = nodeid.split("::", 1)[0]
        per_file[path] = per_file.get(path, 0.0) + seconds
    write = terminalreporter.write_line
    terminalreporter.section(f"slowest {SLOWEST_FILES} test files (sum of their tests)")
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
        write(f"{seconds:8.1f}s {path}")
    write(f"{sum(per_file.values()):8.1f}s in all, {len(per_file)} files")
    over = sorted(((s, n) for n, s in per_test.items() if s > TEST_BUDGET_S), reverse=True)
    if over:
        terminalreporter.section(f"tests over the {TEST_BUDGET_S:g}s per-test budget")
        for seconds, nodeid in over:
            write(f"{seconds:8.1f}s {nodeid}")
