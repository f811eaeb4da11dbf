#!/usr/bin/env bash
# The GPU-only paths, on a machine with CUDA: one line per check (PASS / FAIL / SKIP).
#   bash benchmarks/gpu_check.sh               # from the repository root
# Writes benchmarks/results/gpu_check.json (engine checks) and benchmarks/results/gpu_memory_check.json (a
# stage's peak memory and tokens/s against hf_noloco.memory's prediction). Exits non-zero if a check failed.
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
status=0
python3 benchmarks/gpu_check.py "$@" || status=1
python3 benchmarks/gpu_memory_check.py --out benchmarks/results/gpu_memory_check.json || status=1
exit $status
