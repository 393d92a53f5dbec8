#!/usr/bin/env bash
# Idempotent set-up: a .venv in the checkout with everything the trainer and its tests need.
# On a machine without CUDA it installs the CPU build of torch 2.13.0 (never a multi-GB CUDA
# download); where `nvidia-smi` works, a torch already importable is kept, else pip picks one.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv
stamp="$VENV/.setup-stamp"
want="$(cat pyproject.toml setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/just" ]; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip >/dev/null
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
        pip install torch
    else
        pip install "torch==2.13.0"
    fi
fi
pip install -e ".[dev]"
echo "$want" > "$stamp"
