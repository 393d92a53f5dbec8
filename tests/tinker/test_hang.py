"""A forward_backward that really hangs (the fault point ``forward_backward:hang@2`` blocks
its thread for good) is answered to the SDK as a failed request naming the operation within
``serve.request_timeout_s``; its model is broken, another model is not; and the service still
exits promptly on SIGTERM with that thread blocked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.tinker.conftest import Service, open_service, stop

TIMEOUT_S = 10.0  # create_model must fit in it too, on a loaded 2-core machine


@pytest.fixture(scope="module")
def hanging(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, dict]]:
    workdir = tmp_path_factory.mktemp("hang")
    overrides = (f"serve.request_timeout_s={TIMEOUT_S:g}", "faults=forward_backward:hang@2")
    with open_service(workdir, *overrides) as service:
        yield service, service.sdk("hang")


def test_a_hung_forward_backward_fails_within_its_deadline_naming_it(
    hanging: tuple[Service, dict],
) -> None:
    _, seen = hanging
    assert seen["hung"]["message"].startswith(
        f"Request failed: forward_backward did not finish within serve.request_timeout_s="
        f"{TIMEOUT_S:g}s (model {seen['model_id']})"
    )
    assert seen["hung"]["category"] == "server"
    # the deadline, plus the SDK's poll and the answer's way back
    assert TIMEOUT_S <= seen["seconds"] < TIMEOUT_S + 5


def test_the_model_is_then_broken_and_another_is_not(hanging: tuple[Service, dict]) -> None:
    _, seen = hanging
    assert (
        f"model {seen['model_id']} is broken: its forward_backward did not finish"
        in (seen["after"]["message"])
    )
    assert len(seen["other"]["losses"]) == 1  # a new model trains: its step 1 does not hang


def test_the_service_exits_promptly_with_the_thread_still_hung(
    hanging: tuple[Service, dict],
) -> None:
    service, _ = hanging
    seconds = stop(service.process, timeout_s=30)
    assert service.process.returncode == 0, service.log.read_text()[-2000:]
    # the graceful 2 s and unwinding (6.2 s measured at load 9 on 2 cores); 30 s: a SIGKILL
    assert seconds < 20
