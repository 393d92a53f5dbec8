#!/usr/bin/env bash
# Idempotent set-up: a .venv in the checkout with everything the trainer and its tests need.
# On a machine without CUDA it asks PyTorch's CPU index for torch 2.13.0 and falls back to the
# default index (on Linux, the CUDA build) when that index cannot be reached within seconds;
# where `nvidia-smi` works, a torch already importable is kept, else pip picks one.
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "--vllm" ]; then
    exec bash .setup-vllm.sh  # real vLLM in its own environment, .venv-vllm (docs/vllm.md)
fi
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
        # torch alone from the CPU index (it mirrors few of torch's deps, some at old versions):
        # one try, 10 s timeout, so an unreachable index fails fast instead of after minutes.
        cpu_index=https://download.pytorch.org/whl/cpu
        pip install --no-deps --index-url "$cpu_index" --timeout 10 --retries 0 "torch==2.13.0" ||
            echo "setup.sh: no torch from $cpu_index; taking torch 2.13.0 from the default index" >&2
        pip install "torch==2.13.0"  # torch's deps; torch itself too after a fallback
    fi
fi
pip install -e ".[dev,plot,tensorboard,wandb,mlflow]"
echo "$want" > "$stamp"
