#!/usr/bin/env bash
# Run the benchmark scripts on a GPU, each timing a kernel beside its peers in one run, and store
# their results under book/data/ where the chapters' speed sections read them. Run this before
# scripts/gpu_pipeline.sh so the executed notebooks show the fresh results.
#   usage: bash scripts/gpu_benchmarks.sh [linear_scan selective_scan ssd ssd_variants bidirectional attention attention_features decoding gated_norm host_cost models]
#   (attention_features: bench_attention.py --features, windows, soft-capping and ALiBi; ssd_variants:
#   bench_ssd.py --variants, chunks 64 and 128 and packed sequences)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# mamba_ssm's compiled selective scan, where built (benchmarks/build_selective_scan_cuda.py)
[ -n "${SELECTIVE_SCAN_CUDA_DIR:-}" ] && export PYTHONPATH=$SELECTIVE_SCAN_CUDA_DIR:$PYTHONPATH
topics=("$@")
[ ${#topics[@]} -gt 0 ] || topics=(linear_scan selective_scan selective_scan_cuda ssd ssd_variants bidirectional attention attention_features decoding gated_norm host_cost models)
mkdir -p book/data
failed=0
for topic in "${topics[@]}"; do
  echo "=== $topic ==="
  case $topic in
    attention_features) command=(benchmarks/bench_attention.py --features) ;;
    ssd_variants) command=(benchmarks/bench_ssd.py --variants) ;;
    *) command=("benchmarks/bench_$topic.py") ;;
  esac
  python3 "${command[@]}" --json "book/data/${topic}_bench.json" || { echo "$topic failed"; failed=1; }
done
exit $failed
