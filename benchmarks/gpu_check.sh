#!/usr/bin/env bash
# The GPU-only paths, on a machine with CUDA: one line per check (PASS / FAIL / SKIP). On one GPU,
# benchmarks/gpu_probe.sh is the fuller probe (a one-rank NCCL world, the Trainer under the sync debug mode,
# the split backward, the codecs, and these checks), each step under a timeout.
#   bash benchmarks/gpu_check.sh               # from the repository root
# Writes benchmarks/results/gpu_check.json (engine checks) and benchmarks/results/gpu_memory_check.json (a
# stage's peak memory and tokens/s against the memory model's prediction). Exits non-zero if a check failed.
set -u
cd "$(dirname "$0")/.."
# The package from this copy of the tree, installed or not (a bare copy on a device machine).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
echo "gpu_check: ${gpus} GPU(s). Needs 1 GPU for the pp=1 checks (about 1 minute), 2 for pp=2 and a killed"
echo "rank (2-3 minutes), 4 for sample routing across replicas, 8 for tied DiLoCo dp 4 x pp 2;"
echo "each launched check is killed after 15 minutes."
if [ "$gpus" -lt 1 ]; then echo "SKIP: no CUDA device (python benchmarks/gpu_check.py --device cpu runs them on CPU)"; fi
if [ "$gpus" -lt 2 ]; then echo "SKIP (will be): pp=2 with 16 MiB messages, a killed rank: need 2 GPUs or more"; fi
if [ "$gpus" -lt 8 ]; then echo "SKIP (will be): tied DiLoCo dp 4 x pp 2, copies compared: need 8 GPUs"; fi
status=0
python3 benchmarks/gpu_check.py "$@" || status=1
python3 benchmarks/gpu_memory_check.py --out benchmarks/results/gpu_memory_check.json || status=1
exit $status
