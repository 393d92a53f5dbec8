"""The worker tests' model: a module may define its own ``model_dir`` instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.models import resolve_model_path


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_path(None)
