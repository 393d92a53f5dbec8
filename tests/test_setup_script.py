"""setup.sh on a GPU machine keeps the CUDA build of torch that the image's python imports.

Run for real in a copy of the checkout, with a stand-in ``nvidia-smi`` (it answers, as on a
GPU machine) and a stand-in CUDA build of torch that only the image's python sees. pip may not
reach an index here (``PIP_NO_INDEX``), so the script stops at its first install: what the
test reads is the ``.venv`` it made and what it said.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _gpu_image(tmp_path: Path, *, cuda: str | None) -> dict[str, str]:
    """A PATH with an answering ``nvidia-smi`` and a PYTHON that imports a fake torch."""
    bin_dir, site = tmp_path / "bin", tmp_path / "image-site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(
        f"__version__ = '2.9.0+cu128'\nclass version:\n    cuda = {cuda!r}\n"
    )
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    python = bin_dir / "image-python"
    # the image's interpreter: the fake torch on its path, a real python under it
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    for f in (smi, python):
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    return env | {
        "PATH": f"{bin_dir}:{env['PATH']}",
        "PYTHON": str(python),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(tmp_path / "no-wheels"),
    }


def _setup(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("setup.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, checkout / name)
    return subprocess.run(
        ["bash", "setup.sh"], cwd=checkout, env=env, capture_output=True, text=True, timeout=300
    )


def _sees_image_packages(tmp_path: Path) -> bool:
    cfg = (tmp_path / "checkout" / ".venv" / "pyvenv.cfg").read_text()
    return "include-system-site-packages = true" in cfg


def test_on_a_gpu_image_the_new_venv_keeps_the_images_cuda_torch(tmp_path):
    proc = _setup(tmp_path, _gpu_image(tmp_path, cuda="12.8"))
    assert "keeping the CUDA build of torch that" in proc.stderr and "2.9.0+cu128" in proc.stderr
    assert _sees_image_packages(tmp_path)


def test_an_image_whose_torch_is_a_cpu_build_gets_a_venv_of_its_own(tmp_path):
    proc = _setup(tmp_path, _gpu_image(tmp_path, cuda=None))
    assert "keeping the CUDA build" not in proc.stderr
    assert not _sees_image_packages(tmp_path)
    # and it asks for the pinned CUDA build of torch (which this index-less pip cannot find)
    assert proc.returncode != 0 and "torch==2.13.0" in proc.stderr
