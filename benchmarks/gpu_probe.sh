#!/usr/bin/env bash
# One GPU probe (benchmarks/gpu_probe.py says what each step checks): every step a process of its own under
# `timeout`, then one JSON file and a short table.
#   bash benchmarks/gpu_probe.sh [--device cuda|cpu] [--out DIR]
# --device cpu is the dry mode (the test suite runs it). DIR defaults to $OUT when set (a device machine's
# output folder), else benchmarks/results/gpu_probe; it receives gpu_probe.json, gpu_probe.txt and steps/.
# Exits non-zero if a check failed or a step timed out.
set -u
cd "$(dirname "$0")/.."
# The package from this copy of the tree, installed or not (a bare copy on a device machine).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
device=cuda
out="${OUT:-benchmarks/results/gpu_probe}"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "gpu_probe.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out/steps"
start=$(date +%s)
python3 benchmarks/gpu_probe.py list --device "$device" > "$out/steps/list.txt" || exit 1
while read -r name seconds; do
  began=$(date +%s)
  timeout --kill-after=10 "$seconds" python3 benchmarks/gpu_probe.py step "$name" --device "$device" --out "$out" \
    > "$out/steps/$name.log" 2>&1 < /dev/null
  echo $? > "$out/steps/$name.rc"
  echo "gpu_probe: step $name: exit $(cat "$out/steps/$name.rc") after $(( $(date +%s) - began )) s (limit ${seconds} s)"
  grep -E '^(PASS|FAIL|SKIP) ' "$out/steps/$name.log" | cut -c1-200
  python3 benchmarks/_probe_report.py "$out" "$device" > /dev/null  # kept current: a call cut short leaves it
done < "$out/steps/list.txt"
echo "gpu_probe: $(( $(date +%s) - start )) s"
python3 benchmarks/_probe_report.py "$out" "$device"
