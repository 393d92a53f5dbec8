"""Suite-wide fixtures."""

from __future__ import annotations

import os

import pytest

from trainer import faults


@pytest.fixture(autouse=True)
def _isolated_faults():
    """Each test starts with no faults (whatever the shell exports) and leaves none behind.

    Threads a test left blocked in a ``hang`` fault are released (``faults.release_hangs``,
    test-only) so they do not pile up across the run.
    """
    saved = os.environ.pop(faults.ENV_VAR, None)
    faults.install(None)
    yield
    faults.release_hangs()
    faults.install(None)
    os.environ.pop(faults.ENV_VAR, None)
    if saved is not None:
        os.environ[faults.ENV_VAR] = saved
