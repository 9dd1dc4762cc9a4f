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

# The pages load MathJax from the build itself (scripts/fetch_mathjax.sh: the npm registry's tarball, sha256-pinned).
bash scripts/fetch_mathjax.sh
# The browser check in scripts/test.sh (scripts/check_pages.py) drives Debian's chromium.
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && [ -z "${CHROMIUM:-}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's chromium for the browser check (scripts/check_pages.py)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    echo "setup: no chromium found; the browser check (scripts/check_pages.py) needs it:" \
         "sudo apt-get install chromium (Debian/Ubuntu), or set CHROMIUM to a Chromium/Chrome binary" >&2
  fi
fi
