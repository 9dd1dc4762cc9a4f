#!/usr/bin/env bash
# The GPU pipeline: on a machine with a CUDA GPU, (1) run the tests with compiled kernels,
# (2) execute every notebook in place, (3) re-run them all with strict `pytest --nbval` against the
# outputs just stored, then print a summary. Commit the executed notebooks afterwards.
#   usage: bash scripts/gpu_pipeline.sh [book/NN_topic.ipynb ...]     (default: every chapter)
#   STEPS="tests execute nbval" (the default) picks steps, e.g. to split the work over two sessions;
#   the optional step "reliability" (run only when named) runs scripts/gpu_reliability.sh (issue 14).
# Needs torch, triton, pytest, nbval, nbclient, ipykernel and jupytext importable (scripts/setup.sh
# provides them; on the offline GPU box, .device/activate.sh does).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# mamba_ssm's compiled selective scan, where built (benchmarks/build_selective_scan_cuda.py): the
# Mamba-1 module test compares against it
[ -n "${SELECTIVE_SCAN_CUDA_DIR:-}" ] && export PYTHONPATH=$SELECTIVE_SCAN_CUDA_DIR:$PYTHONPATH
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_pipeline: no CUDA device')" || exit 1
notebooks=("$@")
[ ${#notebooks[@]} -gt 0 ] || notebooks=(book/[0-9][0-9]_*.ipynb)

# With pytest-xdist, tests and the nbval re-run spread over processes (compiling kernels is CPU-bound;
# nbval's timing cells are not compared). The notebooks themselves execute one at a time, so their
# stored timings see a quiet GPU.
tests_parallel=() nbval_parallel=()
if python3 -c "import xdist" 2>/dev/null; then
  tests_parallel=(-n 12) nbval_parallel=(-n 4 --dist loadfile)
fi
steps=${STEPS:-tests execute nbval}
tests=skipped executed=skipped nbval=skipped reliability=skipped
if [[ " $steps " == *" tests "* ]]; then
  # tests past 2^31 elements need tens of GiB each: with a dozen workers sharing the GPU they ran
  # out of memory (H100, -n 12), so they run after the parallel pass, one at a time
  python3 -m pytest -q -p no:cacheprovider "${tests_parallel[@]}" -m "not large_memory" tests; tests=$?
  python3 -m pytest -q -p no:cacheprovider -m large_memory tests; large=$?
  [ "$tests" = 0 ] && tests=$large
fi
if [[ " $steps " == *" execute "* ]]; then
  python3 scripts/execute_notebooks.py "${notebooks[@]}"; executed=$?
fi
if [[ " $steps " == *" nbval "* ]]; then
  python3 -m pytest -q --nbval --nbval-current-env --nbval-sanitize-with book/nbval_sanitize.cfg -p no:cacheprovider "${nbval_parallel[@]}" "${notebooks[@]}"; nbval=$?
fi
if [[ " $steps " == *" reliability "* ]]; then
  STEPS="${RELIABILITY_STEPS:-}" bash scripts/gpu_reliability.sh; reliability=$?
fi

status() { case $1 in 0) echo PASS ;; skipped) echo "not run (STEPS)" ;; *) echo "FAIL ($1)" ;; esac; }
echo "=== GPU pipeline on $(python3 -c 'import torch; print(torch.cuda.get_device_name())') ==="
echo "tests (compiled kernels):   $(status $tests)"
echo "notebooks executed:         $(status $executed)"
echo "pytest --nbval (strict):    $(status $nbval)"
echo "reliability (issue 14):     $(status $reliability)"
for rc in $tests $executed $nbval $reliability; do [ "$rc" = 0 ] || [ "$rc" = skipped ] || exit 1; done
