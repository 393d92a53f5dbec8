# Recipes; `bash setup.sh` first creates .venv (the README's commands do it for you).
set positional-arguments

py := ".venv/bin/python"

# Create or update .venv (idempotent).
setup:
    bash setup.sh

# Train: `just run trainer.max_steps=10 ...` (same arguments as `python -m trainer`).
run *ARGS: setup
    {{py}} -m trainer "$@"

# The whole test suite (what CI runs): test files on two worker processes, each file on one
# (`just test -n 0` runs in this process; `-n 4` on four workers). The end lists the 25 slowest
# tests, the 15 slowest test files and every test over the 60 s per-test budget (tests/conftest.py),
# so every CI log says where the suite's time goes. The slowest files start first
# (tests/conftest.py HEAVY_FIRST; xdist's own reorder, by test count, is off).
test *ARGS: setup
    {{py}} -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not vllm and not tinker" --durations=25 "$@"

# The fast tests of every package (marker `quick`: every test not marked `slow` or `vllm` and not
# in a file of tests/conftest.py SLOW_FILES), as `just test` runs the suite: under 2 minutes here.
test-quick *ARGS: setup
    {{py}} -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m quick --durations=10 "$@"

# The real-vLLM tier (marker `vllm`): vLLM's CPU build in .venv-vllm, its servers shared (conftest.py).
test-vllm *ARGS: setup
    bash setup.sh --vllm
    {{py}} -m pytest -q -m vllm --durations=10 tests/engines/vllm "$@"

# The Tinker tier (marker `tinker`): the official SDK in .venv-tinker drives `python -m trainer serve`
# (tests/tinker: one service per module, about 15 s).
test-tinker *ARGS: setup
    bash setup.sh --tinker
    {{py}} -m pytest -q -m tinker --durations=10 tests/tinker "$@"

# Format check, lint, the import contracts (.importlinter) and type check.
lint: setup
    {{py}} -m ruff format --check .
    {{py}} -m ruff check .
    .venv/bin/lint-imports
    {{py}} -m pyright

# Measured comparisons (never part of the tests).
bench: setup
    for b in benchmarks/*.py; do [ "$b" = benchmarks/gpu_check.py ] || { echo "== $b"; {{py}} "$b"; }; done

# The one-command GPU check (one NVIDIA GPU, at most about 6 minutes; see its docstring).
# GPU images often have no .venv: then the image's python3, with the dependencies installed.
gpu-check *ARGS:
    {{ if path_exists(".venv/bin/python") == "true" { py } else { "python3" } }} benchmarks/gpu_check.py "$@"
