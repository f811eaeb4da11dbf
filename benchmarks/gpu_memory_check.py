"""GPU checks of the memory work: a stage trained on one GPU, its tokens/s and peak memory against
hf_noloco.estimate.memory's prediction. One line per check.

Each check trains one stage as its rank would (benchmarks/memory.py's StageRun: its schedule's order of
microbatches, clipping, fused AdamW, DiLoCo's outer step for the outer-state check), three steps untimed then
``--steps`` timed, and prints the median tokens/s, ``torch.cuda.max_memory_allocated`` (what the model
predicts: live tensors) and ``max_memory_reserved`` (what the caching allocator held), with the ratio of the
prediction to the allocated peak.

    python benchmarks/gpu_memory_check.py                  # on a GPU (a few minutes on one H100/H200)
    python benchmarks/gpu_memory_check.py --device cpu --quick   # smoke: tiny models on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.dirname(BENCH_DIR))

import memory as bench  # noqa: E402 - benchmarks/memory.py: the cases' configurations and StageRun

GIB = 2**30
_check = bench._case
BF16 = {"dtype": "bfloat16"}
L1B, L8B = bench.LLAMA_32_1B, bench.LLAMA_31_8B_4L

CHECKS = [
    # pp=1: the whole Llama-3.2-1B (tied) on one GPU, bf16 weights, activation checkpointing
    _check("1b-pp1-bf16-ckpt", L1B, 1, 0, **BF16, ckpt=True, seq=2048, num_micro=4),
    _check("1b-pp1-bf16", L1B, 1, 0, **BF16, seq=2048, num_micro=4),
    _check("1b-pp1-fp32-autocast-ckpt", L1B, 1, 0, autocast=True, ckpt=True, seq=2048, num_micro=4),
    _check(
        "1b-pp1-bf16-ckpt-outer-state", L1B, 1, 0, **BF16, ckpt=True, seq=2048, num_micro=4, outer="diloco"
    ),
    # a middle and the last stage of Llama-3.2-1B over 4 stages, plain and chunked loss
    _check("1b-pp4-s1-bf16-ckpt", L1B, 4, 1, **BF16, ckpt=True, seq=4096, num_micro=8),
    _check("1b-pp4-s3-bf16-plain-loss", L1B, 4, 3, **BF16, seq=4096, num_micro=8),
    _check("1b-pp4-s3-bf16-chunked-loss", L1B, 4, 3, **BF16, seq=4096, num_micro=8, chunk=1024),
    # a middle stage of Llama-3.2-1B over 4 stages, 1F1B and zb-h1 (which holds up to pp microbatches, and
    # defers each one's weight gradients)
    _check("1b-pp4-s2-bf16-1f1b", L1B, 4, 2, **BF16, seq=4096, num_micro=8),
    _check("1b-pp4-s2-bf16-zbh1", L1B, 4, 2, **BF16, seq=4096, num_micro=8, schedule="zb-h1"),
    # one Llama-3.1-8B stage of 1 layer (of 4 over 4 stages) at a long sequence
    _check("8b-s1-bf16-ckpt-seq8192", L8B, 4, 1, **BF16, ckpt=True, seq=8192),
]
QUICK_CHECKS = [
    bench._case("tiny-pp1-bf16-ckpt", bench.TINY, 1, 0, dtype="bfloat16", ckpt=True, seq=64),
    bench._case("tiny-pp2-s1-fp32-outer", bench.TINY, 2, 1, seq=64, outer="diloco", chunk=32),
    bench._case("tiny-pp2-s1-fp32-zbh1", bench.TINY, 2, 1, seq=64, num_micro=4, schedule="zb-h1"),
]


def run_check(case: dict, device: str, steps: int) -> dict:
    import torch

    cuda = device.startswith("cuda")
    predicted = bench.predict(case)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    run = bench.StageRun(case, device)
    times, tokens = [], 0
    for i in range(3 + steps):  # optimizer state, outer step, one more warm-up; then timed
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = run.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    allocated = torch.cuda.max_memory_allocated() if cuda else None
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    run.close()
    del run
    return {
        "name": case["name"],
        "tokens_per_s": tokens / statistics.median(times),
        "peak_allocated": allocated,
        "peak_reserved": reserved,
        "predicted_peak": predicted["peak"],
        "predicted_over_allocated": predicted["peak"] / allocated if allocated else None,
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_memory_check: no GPU here (run it with --device cpu --quick for a smoke test)")
        sys.exit(1)
    results = []
    for case in QUICK_CHECKS if args.quick else CHECKS:
        try:
            result = run_check(case, args.device, 1 if args.quick else args.steps)
        except torch.OutOfMemoryError as exc:
            result = {"name": case["name"], "error": f"out of memory: {str(exc).splitlines()[0]}"}
        results.append(result)
        if args.out:  # after every case: a run cut short at a timeout still reports the cases it measured
            with open(args.out, "w") as f:
                json.dump({"device": args.device, "torch": torch.__version__, "checks": results}, f, indent=1)
        if "error" in result:
            print(f"{result['name']}: {result['error']}", flush=True)
        elif result["peak_allocated"] is None:
            print(
                f"{result['name']}: {result['tokens_per_s']:.0f} tokens/s (CPU: no allocator stats)",
                flush=True,
            )
        else:
            print(
                f"{result['name']}: {result['tokens_per_s']:.0f} tokens/s, peak allocated "
                f"{result['peak_allocated'] / GIB:.2f} GiB (reserved {result['peak_reserved'] / GIB:.2f}), "
                f"predicted {result['predicted_peak'] / GIB:.2f} GiB "
                f"(x{result['predicted_over_allocated']:.2f} of allocated)",
                flush=True,
            )


if __name__ == "__main__":
    main()
