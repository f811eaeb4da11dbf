"""Quality of the compressed stage boundaries: each boundary format against the float32 wire, paired by seed.

The runs are the convergence study's machinery (`benchmarks/convergence.py`: the factorial study's 1.25M
Llama, corpus and schedule, shortened to 96 steps) with one arm per boundary format; within a mesh and seed
every arm starts from the same weights and sees the same batches:

    A="--arm b-fp32=local --arm b-int8=local,boundary=int8,boundary_grad=int8"
    A="$A --arm b-fp8=local,boundary=float8_e4m3,boundary_grad=float8_e5m2"
    A="$A --arm b-int4=local,boundary=int4,boundary_grad=int4"
    A="$A --arm b-int4b32=local,boundary=int4,boundary_grad=int4,boundary_block=32"
    NL=noloco,H=8,alpha=0.3,beta=0.7,gamma=0.7
    A="$A --arm n-fp32=$NL --arm n-int4=$NL,boundary=int4,boundary_grad=int4"
    python benchmarks/convergence.py $A --arms b-fp32,b-int4,b-int8,b-fp8,b-int4b32 --meshes 1x2 \\
        --seeds 0,1,2 --steps 96 --part boundary-pp2 --output-dir benchmarks/results/boundary_quality
    python benchmarks/convergence.py $A --arms n-fp32,n-int4 --meshes 2x2 --seeds 0,1,2 --steps 96 \\
        --part boundary-dp2pp2 --output-dir benchmarks/results/boundary_quality
    python benchmarks/boundary_quality.py   # this summary

Reads every ``benchmarks/results/boundary_quality/part-*.json``; prints, per mesh, each arm's final validation
perplexity against its mesh's float32 arm (geometric-mean ratio over the paired seeds, 95% Student-t
interval), and writes ``benchmarks/results/boundary_quality/boundary_summary.json``.
"""

from __future__ import annotations

import glob
import json
import os

from _stats import paired_log_ratio

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "boundary_quality")
BASELINES = ("b-fp32", "n-fp32")


def main() -> None:
    runs = []
    for path in sorted(glob.glob(os.path.join(FOLDER, "part-*.json"))):
        with open(path) as f:
            runs += json.load(f)["runs"]
    table: dict[tuple[str, str], dict[int, float]] = {}
    for run in runs:
        ppl = next(e["eval_perplexity"] for e in reversed(run["log_history"]) if "eval_perplexity" in e)
        table.setdefault((run["mesh"], run["arm"]), {})[run["seed"]] = ppl
    summary = []
    for (mesh, arm), by_seed in sorted(table.items()):
        base_arm = next(b for b in BASELINES if (mesh, b) in table)
        base = table[mesh, base_arm]
        seeds = sorted(set(by_seed) & set(base))
        row = dict(mesh=mesh, arm=arm, baseline=base_arm, seeds=seeds, perplexity=[by_seed[s] for s in seeds])
        text = "baseline"
        if arm != base_arm and len(seeds) >= 2:
            row["vs_fp32"] = r = paired_log_ratio(row["perplexity"], [base[s] for s in seeds])
            text = f"{r['pct']:+.2f}% [{r['pct_low']:+.2f}, {r['pct_high']:+.2f}]"
        mean = sum(row["perplexity"]) / len(seeds)
        print(f"{mesh:<5} {arm:<10} seeds {seeds}  mean ppl {mean:8.2f}  vs float32 wire {text}")
        summary.append(row)
    with open(os.path.join(FOLDER, "boundary_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
