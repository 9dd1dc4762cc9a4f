#!/usr/bin/env bash
# Issue 14's reliability run on a CUDA GPU: every public op proven where races and out-of-bounds
# accesses do not hide (the tests mostly run in Triton's interpreter). Steps (python in
# scripts/reliability/, each writes $REPORTS/<step>_<op>.json):
#   sweep         random cases per op vs the float64 references, forward and every gradient, autotuner on
#   sanitize      compute-sanitizer memcheck, racecheck, initcheck, synccheck over each op's forward and backward
#   reproducible  outputs and gradients bitwise equal across calls
#   large         linear_scan > 2^31 elements; SSD and bidirectional at 2^20 tokens; attention at N = 131072
#   nonfinite     a NaN/inf at position t never reaches outputs before t; after t non-finite, never garbage
#   leaks         10,000 calls leave memory_allocated unchanged; CUDA-graph replay equals eager
#   summary       the table over every report in $REPORTS, also as JSON ($SUMMARY_JSON); runs last
#   usage: STEPS="sweep" OPS="ssd_chunk_scan" JOBS=6 bash scripts/gpu_reliability.sh
# Every (step, op) pair is one process (large: one per check), its output in $REPORTS/logs/. JOBS of
# them run at once: they check values, not speed, and most of their time is Triton compiling kernels
# on the CPU (every new shape key tunes every configuration), so a 16-core GPU box runs several
# side by side. The large step runs alone after the others (it needs most of the GPU's memory).
# Measured on an H100 (STEPS=sweep SHARDS=4 JOBS=24, 470 s per process): the three scans ran
# 1,000 cases each, attention about 200, SSD and the bidirectional op about 50 each (compiling
# every new specialization of a dozen kernels): those need several calls, each with its own SEED.
# A device call is capped at 10 minutes: run a few steps per call; the reports accumulate in
# $REPORTS, and STEPS=summary prints the table at the end.
# Environment: STEPS (default: all, in the order above), OPS (default: all twelve), JOBS (default 1),
# CASES (sweep cases per op, default 1000), SHARDS (sweep processes per op, splitting CASES;
# default 1), TIME_BUDGET (seconds per sweep or reproducible process, default 540), SHRINK_BUDGET
# (seconds of shrinking per sweep failure; default: the rest of TIME_BUDGET),
# SANITIZE_TIMEOUT (seconds per sanitized run, default 900), SEED (default 0),
# REPORTS (default /tmp/reliability), SUMMARY_JSON (default book/data/reliability.json), ABOUT (what the
# JSON says the reports come from; default: the GPU's name, torch and Triton versions).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_reliability: no CUDA device')" || exit 1
steps=${STEPS:-sweep sanitize reproducible large nonfinite leaks summary}
ops=${OPS:-linear_scan sequential_scan selective_scan ssd_chunk_scan bidirectional_chunk_scan attention
attention_varlen attention_with_kvcache ssd_state_update selective_state_update rmsnorm_fn depthwise_conv1d}
reports=${REPORTS:-/tmp/reliability}
budget=${TIME_BUDGET:-540}
shards=${SHARDS:-1}
mkdir -p "$reports/logs"
here=scripts/reliability

# one line per process: "<name> <command...>"
parallel=() serial=()
for step in $steps; do
  for op in $ops; do
    case $step in
      sweep)  # SHARDS processes per op, each its own run of consecutive seeds
        per_shard=$(( (${CASES:-1000} + shards - 1) / shards ))
        for (( k = 0; k < shards; k++ )); do
          seed=$(( ${SEED:-0} + k * per_shard ))
          parallel+=("sweep_${op}_seed$seed python3 $here/sweep.py --ops $op --cases $per_shard --seed $seed \
--time-budget $budget ${SHRINK_BUDGET:+--shrink-budget $SHRINK_BUDGET} --json $reports/sweep_${op}_seed$seed.json")
        done ;;
      sanitize) parallel+=("sanitize_$op python3 $here/sanitize.py --ops $op --log-dir $reports/sanitizer_logs \
--timeout ${SANITIZE_TIMEOUT:-900} --json $reports/sanitize_$op.json") ;;
      reproducible) parallel+=("reproducible_$op python3 $here/reproducible.py --ops $op --time-budget $budget \
--json $reports/reproducible_$op.json") ;;
      nonfinite) parallel+=("nonfinite_$op python3 $here/nonfinite.py --ops $op --json $reports/nonfinite_$op.json") ;;
      leaks) parallel+=("leaks_$op python3 $here/leaks.py --ops $op --json $reports/leaks_$op.json") ;;
      # no large check of their own:
      large) case $op in sequential_scan|selective_scan|attention_varlen|attention_with_kvcache|ssd_state_update|\
selective_state_update|rmsnorm_fn|depthwise_conv1d) ;;
               *) serial+=("large_$op python3 $here/large.py --checks $op --json $reports/large_$op.json") ;; esac ;;
      summary) ;;
      *) echo "gpu_reliability: unknown step $step"; exit 2 ;;
    esac
  done
done

status=0
launch() {  # name command...: run in the background, output and exit code in $reports/logs/
  local name=$1; shift
  echo "--- $(date +%T) start $name: $*"
  ( "$@" > "$reports/logs/$name.log" 2>&1; echo $? > "$reports/logs/$name.rc" ) &
}
finish() {  # name: its log, then its exit code into $status
  local name=$1 rc
  rc=$(cat "$reports/logs/$name.rc" 2>/dev/null || echo missing)
  echo "--- $(date +%T) done $name (exit $rc)"; cat "$reports/logs/$name.log"
  [ "$rc" = 0 ] || status=1
}
run_all() {  # entries..., at most $1 at once
  local jobs=$1 entry names=(); shift
  for entry in "$@"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    # shellcheck disable=SC2086
    launch $entry; names+=("${entry%% *}")
  done
  wait
  for name in "${names[@]}"; do finish "$name"; done
}
run_all "${JOBS:-1}" "${parallel[@]}"
run_all 1 "${serial[@]}"
if [[ " $steps " == *" summary "* ]]; then
  about=${ABOUT:-$(python3 -c 'import torch, triton; print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")')}
  python3 $here/summary.py "$reports"/*.json --json "${SUMMARY_JSON:-book/data/reliability.json}" --about "$about" || status=1
fi
exit $status
