#!/usr/bin/env bash
# torch 2.11 compatibility subset: what our GPU machines run.
#
#   tools/compat_check.sh                 # creates .venv-torch-2.11.0/ on first use (several GB)
#   COMPAT_VENV=/path/to/venv tools/compat_check.sh
#   COMPAT_TORCH=2.12.0 tools/compat_check.sh   # another release
#
# The registry's torch 2.11 for Linux is a CUDA build of several GB (it runs on the CPU too), so
# this is not part of the default test suite or CI. It installs the project into a separate
# virtual environment next to the pinned torch release and runs, on 2 gloo ranks: AutoSP parity
# against one device on aot_eager and Inductor in fp32 (tests/compiler/test_autosp.py), and the
# bf16 matrix of every strategy on Inductor (tests/training/test_bf16.py). Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="${COMPAT_TORCH:-2.11.0}"
VENV="${COMPAT_VENV:-.venv-torch-$TORCH}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [ "$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$TORCH" ]; then
    "$PY" -m pip install -q "torch==$TORCH"
fi
# the project and its other requirements; torch>=2.11 in setup.cfg keeps the installed release
"$PY" -m pip install -q -e ".[test]"
"$PY" -c 'import torch, sys; print(f"compat check: torch {torch.__version__}, python {sys.version.split()[0]}")'
exec "$PY" -m pytest -q -p no:cacheprovider -m "" \
    "tests/compiler/test_autosp.py::test_parity_2_ranks" \
    "tests/compiler/test_autosp.py::test_parity_inductor" tests/training/test_bf16.py "$@"
