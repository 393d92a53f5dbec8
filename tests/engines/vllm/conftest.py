"""The real-vLLM tier: real vLLM servers on the CPU, from ``.venv-vllm``, shared by the whole
tier, and trainer runs that start their own vLLM.

- **Shared servers** (:data:`~tests.engines.vllm.tier.SHARED`): one per model and weight-transfer backend for the whole
  tier (``vllm_server``, ``vllm_disk_server``, ``smollm2_server``, ...), each stopped after
  the last selected test that uses it. They start in the background, in the order the tests
  first need them, one at a time, at most :data:`~tests.engines.vllm.tier.PRESTART` ahead: a start costs 30-90 s of
  CPU, and the tests leave one of two cores idle most of the time. ``fresh_vllm_disk_server`` is one
  test's own (``test_differential.py``: it compares vLLM as started, and ends it); that
  test runs last (:data:`LAST`), its server started in the background meanwhile.
- **Trainer runs** (marker ``trainer_run``, ``test_vllm_backend.py``): the ``python -m
  trainer`` run a test checks, started in the background at the tier's start, one after
  another in the tests' order; the test waits for its run and asserts on it.

Skipped, with one line saying how to get it, where ``.venv-vllm`` is missing (``bash setup.sh
--vllm``); run it alone with ``pytest -m vllm``. The tests themselves may run in either
environment: the server runs in ``.venv-vllm``'s Python, the trainer's side (client, policy,
gloo group) in the test's own. At the end the tier prints its budget: the servers it started,
their start-up seconds (and how many of them its tests waited for), and its tests' seconds.

Here: the hooks and fixtures that drive the tier. A server itself (start, health, stop):
:mod:`tests.engines.vllm.servers`; the plan (which servers, started when; the trainer runs):
:mod:`tests.engines.vllm.tier`.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.engines.vllm.servers import VLLM_PYTHON, RealServer
from tests.engines.vllm.tier import Tier, TrainerRun

#: Test files run last in the tier: ``test_differential.py`` has a server of its own
#: (``tiny-disk-fresh``), which it ends; first in the tier, every test waited for its start.
LAST = frozenset({"test_differential.py"})
#: The fixtures that hand out a server: fixture -> its key (``{param}``: the fixture's
#: parameter), so that collection knows the order the servers are needed in and each one's
#: last test.
FIXTURE_KEYS = {
    "vllm_server": "tiny-gloo",
    "vllm_server_as_left": "tiny-gloo",
    "vllm_disk_server": "tiny-disk",
    "fresh_vllm_disk_server": "tiny-disk-fresh",
    "tied_server": "tiny-tied-gloo",
    "smollm2_server": "smollm2-{param}",
    "trained_policy_server": "trained-policy",
    "vllm_lora_server": "tiny-lora",
}

TIER = pytest.StashKey[Tier]()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "trainer_run(*overrides): the test's `python -m trainer` run in .venv-vllm, started in "
        "the background by the real-vLLM tier (`{param}`: the test's parameter); fixture "
        "`trainer_run`",
    )


def pytest_collection_modifyitems(config, items):
    """The tests of :data:`LAST` run after the rest of the tier, so that their own server
    starts in the background while the others run instead of before the first test. Without
    ``.venv-vllm`` every test of the tier (marker ``vllm``) is skipped, saying how to get it."""
    items.sort(key=lambda item: item.path.name in LAST)  # stable: the order otherwise kept
    if VLLM_PYTHON.exists():
        return
    skip = pytest.mark.skip(reason="needs real vLLM: run `bash setup.sh --vllm`")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """The tier's plan, from the selected tests in their order: which servers, in which order,
    the last test of each, and the trainer runs."""
    order: list[str] = []
    last_user: dict[str, str] = {}
    runs: dict[str, TrainerRun] = {}
    for item in session.items:
        if item.get_closest_marker("vllm") is None or _skipped(item):
            continue
        params = getattr(item, "callspec", None)
        params = params.params if params is not None else {}
        for name in item.fixturenames:
            if name in FIXTURE_KEYS:
                key = FIXTURE_KEYS[name].format(param=params.get(name))
                order += [key] if key not in order else []
                last_user[key] = item.nodeid
        marker = item.get_closest_marker("trainer_run")
        if marker is not None:
            overrides = tuple(arg.format(**params) for arg in marker.args)
            runs[item.nodeid] = TrainerRun(overrides, Path())
    session.config.stash[TIER] = Tier(order, last_user, runs)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test of the tier adds its seconds to the budget; after it, the servers it was the
    last test of are stopped and the next ones started."""
    started = time.monotonic()
    try:
        return (yield)
    finally:
        tier = item.config.stash.get(TIER, None)
        if tier is not None and item.get_closest_marker("vllm") is not None:
            tier.after(item.nodeid)
            tier.tests_s += time.monotonic() - started


def pytest_sessionfinish(session):
    tier = session.config.stash.get(TIER, None)
    if tier is not None:
        tier.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tier = config.stash.get(TIER, None)
    if tier is not None and tier.tests_s > 0:
        terminalreporter.write_line(tier.budget())


@pytest.fixture(scope="session", autouse=True)
def tier(request, tmp_path_factory) -> Tier:
    """The tier (its background work started on the first test here)."""
    tier = request.config.stash[TIER]
    if tier.order or tier.runs:
        base = tmp_path_factory.mktemp("vllm-tier")
        for nodeid, run in tier.runs.items():
            name = nodeid.rsplit("::", 1)[-1].replace("/", "-")[:60]
            run.run_dir = base / "runs" / name / "run"
            run.run_dir.parent.mkdir(parents=True)
            run.overrides = (*run.overrides, f"trainer.run_dir={run.run_dir}")
        tier.start(base)
    return tier


@pytest.fixture
def vllm_server(tier) -> RealServer:
    """The tier's ``gloo`` server of the built-in tiny model, in a good state."""
    return tier.shared("tiny-gloo")


@pytest.fixture
def vllm_server_as_left(tier) -> RealServer:
    """The same server as the test before left it: for a test that may leave it broken on
    purpose, and for one that mends what such a test left (``test_real_vllm.py``'s broken
    transfers, in the file's order)."""
    return tier.shared("tiny-gloo", as_left=True)


@pytest.fixture
def vllm_disk_server(tier) -> RealServer:
    """The tier's ``disk`` server of the built-in tiny model."""
    return tier.shared("tiny-disk")


@pytest.fixture
def fresh_vllm_disk_server(tier) -> RealServer:
    """A ``disk`` server of the built-in tiny model that no other test uses: for one that
    needs it as started and ends it."""
    return tier.shared("tiny-disk-fresh")


@pytest.fixture
def vllm_lora_server(tier) -> RealServer:
    """A server of the built-in tiny model that serves LoRA adapters (``--max-lora-rank 8``)."""
    return tier.shared("tiny-lora")


@pytest.fixture
def trained_policy_server(tier) -> RealServer:
    """A ``disk`` server of a trained checkpoint's ``policy/`` directory, as it is."""
    return tier.shared("trained-policy")


@pytest.fixture(params=["gloo", "disk"])
def smollm2_server(tier, request) -> RealServer:
    """The tier's server of SmolLM2-135M-Instruct, one per weight-transfer backend."""
    return tier.shared(f"smollm2-{request.param}")


@pytest.fixture
def trainer_run(tier, request) -> TrainerRun:
    """The test's trainer run (marker ``trainer_run``), started in the background."""
    return tier.runs[request.node.nodeid]


def _skipped(item: pytest.Item) -> bool:
    """Whether a ``skip`` mark, or a ``skipif`` with a true (not string) condition, skips it."""
    if item.get_closest_marker("skip") is not None:
        return True
    return any(
        mark.args and not isinstance(mark.args[0], str) and bool(mark.args[0])
        for mark in item.iter_markers("skipif")
    )
