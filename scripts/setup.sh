#!/usr/bin/env bash
# Set up .venv with everything the book, the chapters and the tests need. Safe to run again.
#   TORCH_SPEC  what to install for torch when none is importable (default: torch==2.13.0, which on
#               a machine without a GPU should be a CPU build: a plain `pip install torch` on Linux
#               fetches several GB of CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
quiet_pip() { python -m pip install -q "$@" 2> >(grep -v "WARNING: Location" >&2); }

[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -c "import torch" 2>/dev/null || quiet_pip "${TORCH_SPEC:-torch==2.13.0}"
quiet_pip -r requirements.txt
quiet_pip --no-deps -e .
python -c "import torch, triton; print(f'setup: torch {torch.__version__}, triton {triton.__version__}')"
