#!/usr/bin/env bash
# Issue 14's reliability run on a CUDA GPU: every public op proven where races and out-of-bounds
# accesses do not hide (the tests mostly run in Triton's interpreter). Steps (python in
# scripts/reliability/, each writes $REPORTS/<step>*.json):
#   sweep         random cases per op vs the float64 references, forward and every gradient, autotuner on
#   sanitize      compute-sanitizer memcheck, racecheck, initcheck, synccheck over each op's forward and backward
#   reproducible  outputs and gradients bitwise equal across calls
#   large         linear_scan > 2^31 elements; SSD and bidirectional at 2^20 tokens; attention at N = 131072
#   nonfinite     a NaN/inf at position t never reaches outputs before t; after t non-finite, never garbage
#   leaks         10,000 calls leave memory_allocated unchanged; CUDA-graph replay equals eager
#   summary       the table over every report in $REPORTS, also as JSON ($SUMMARY_JSON)
#   usage: STEPS="sweep" OPS="ssd_chunk_scan" bash scripts/gpu_reliability.sh
# A device call is capped at 10 minutes: run one step (and, for the sweep, one or two ops) per call;
# the reports accumulate in $REPORTS, and STEPS=summary prints the table at the end.
# Environment: STEPS (default: all, in the order above), OPS (default: all six), CASES (sweep cases
# per op, default 1000), TIME_BUDGET (sweep seconds per op, default 540), SEED (default 0),
# REPORTS (default /tmp/reliability), SUMMARY_JSON (default book/data/reliability.json).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_reliability: no CUDA device')" || exit 1
steps=${STEPS:-sweep sanitize reproducible large nonfinite leaks summary}
ops=${OPS:-linear_scan sequential_scan selective_scan ssd_chunk_scan bidirectional_chunk_scan attention}
reports=${REPORTS:-/tmp/reliability}
mkdir -p "$reports"
ops_csv=$(echo $ops | tr ' ' ',')
tag=$(echo $ops | tr ' ' '+')
status=0
run() { echo "--- $*"; "$@" || status=1; }
for step in $steps; do
  case $step in
    sweep)
      for op in $ops; do
        run python3 scripts/reliability/sweep.py --ops "$op" --cases "${CASES:-1000}" --seed "${SEED:-0}" \
          --time-budget "${TIME_BUDGET:-540}" --json "$reports/sweep_${op}_seed${SEED:-0}.json"
      done ;;
    sanitize)
      run python3 scripts/reliability/sanitize.py --ops "$ops_csv" --log-dir "$reports/sanitizer_logs" \
        --json "$reports/sanitize_$tag.json" ;;
    reproducible)
      run python3 scripts/reliability/reproducible.py --ops "$ops_csv" --json "$reports/reproducible_$tag.json" ;;
    large)
      run python3 scripts/reliability/large.py --checks "$(echo $ops | tr ' ' '\n' | grep -v sequential_scan \
        | grep -v selective_scan | paste -sd,)" --json "$reports/large_$tag.json" ;;
    nonfinite)
      run python3 scripts/reliability/nonfinite.py --ops "$ops_csv" --json "$reports/nonfinite_$tag.json" ;;
    leaks)
      run python3 scripts/reliability/leaks.py --ops "$ops_csv" --json "$reports/leaks_$tag.json" ;;
    summary)
      run python3 scripts/reliability/summary.py "$reports"/*.json --json "${SUMMARY_JSON:-book/data/reliability.json}" ;;
    *) echo "gpu_reliability: unknown step $step"; exit 2 ;;
  esac
done
exit $status
