#!/usr/bin/env bash
# Checks that need a GPU, one line of output per check. Run from the repository root on a machine with a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results
# Memory (issue 10): a stage on one GPU, tokens/s and peak memory against hf_noloco.memory's prediction.
if [ -f benchmarks/gpu_memory_check.py ]; then
    python benchmarks/gpu_memory_check.py --out benchmarks/results/gpu_memory_check.json
fi
