#!/usr/bin/env bash
# The GPU-only paths, on a machine with CUDA: one line per check (PASS / FAIL / SKIP).
#   bash benchmarks/gpu_check.sh               # from the repository root
# Writes benchmarks/results/gpu_check.json. Exits non-zero if a check failed.
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
python3 benchmarks/gpu_check.py "$@"
