"""Quality of the compressed outer exchanges: each `outer_dtype` against float32, paired by seed.

The runs are the convergence study's machinery (`benchmarks/convergence.py`: the factorial study's 1.25M
Llama, corpus and schedule) with one arm per wire format:

    NL=noloco,H=8,alpha=0.3,beta=0.7,gamma=0.7
    A="--arm nl-fp32=$NL --arm nl-bf16=$NL,dtype=bfloat16 --arm nl-int8=$NL,dtype=int8"
    A="$A --arm nl-fp8=$NL,dtype=float8_e4m3 --arm nl-int4=$NL,dtype=int4"
    A="$A --arm dl-fp32=diloco,H=8,alpha=0.3,beta=0.7 --arm dl-int8=diloco,H=8,alpha=0.3,beta=0.7,dtype=int8"
    python benchmarks/convergence.py $A --arms nl-fp32,nl-bf16,nl-int8,nl-fp8,nl-int4,dl-fp32,dl-int8 \\
        --meshes 4x1 --seeds 0,1,2 --part compressed-dp4 --output-dir benchmarks/results/compressed
    # dp 8: the same with --meshes 8x1 --part compressed-dp8 (1.2 h under nice -n 19 on 2 shared cores)
    python benchmarks/compressed_gossip.py   # this summary

Reads every ``benchmarks/results/compressed/part-*.json``; prints, per mesh, each arm's final validation
perplexity and replica divergence against its method's float32 arm (geometric-mean ratio over the paired
seeds, 95% Student-t interval), and writes ``benchmarks/results/compressed/summary.json``.
"""

from __future__ import annotations

import glob
import json
import os

from _stats import paired_log_ratio

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "compressed")
BASELINES = {"noloco": "nl-fp32", "diloco": "dl-fp32"}


def last(history: list[dict], key: str) -> float | None:
    return next((entry[key] for entry in reversed(history) if key in entry), None)


def main() -> None:
    runs = []
    for path in sorted(glob.glob(os.path.join(FOLDER, "part-*.json"))):
        with open(path) as f:
            runs += json.load(f)["runs"]
    table: dict[tuple[str, str], dict[int, dict]] = {}
    for run in runs:
        history = run["log_history"]
        table.setdefault((run["mesh"], run["arm"]), {})[run["seed"]] = {
            "perplexity": last(history, "eval_perplexity"),
            "divergence": last(history, "replica_divergence"),
            "outer_bytes_per_rank": last(history, "outer_bytes_sent_per_rank"),
            "method": run["arm_settings"]["method"],
        }
    summary = []
    for (mesh, arm), by_seed in sorted(table.items()):
        method = next(iter(by_seed.values()))["method"]
        base = table.get((mesh, BASELINES[method]), {})
        seeds = sorted(set(by_seed) & set(base))
        row = {"mesh": mesh, "arm": arm, "seeds": seeds}
        row["outer_bytes_per_rank"] = next(iter(by_seed.values()))["outer_bytes_per_rank"]
        for key in ("perplexity", "divergence"):
            values = [by_seed[s][key] for s in seeds]
            reference = [base[s][key] for s in seeds]
            row[key] = values
            # DiLoCo's replicas are equal at the end (divergence 0 at dp 4, 2.5e-9 at dp 8): no ratio
            comparable = all(reference) and not (key == "divergence" and method == "diloco")
            if arm != BASELINES[method] and seeds and None not in values + reference and comparable:
                row[f"{key}_vs_fp32"] = paired_log_ratio(values, reference)
        summary.append(row)
        ppl = row.get("perplexity_vs_fp32")
        div = row.get("divergence_vs_fp32")
        text = (
            "baseline"
            if ppl is None
            else f"{ppl['pct']:+.2f}% [{ppl['pct_low']:+.2f}, {ppl['pct_high']:+.2f}]"
        )
        spread = (
            ""
            if div is None
            else f"; divergence {div['pct']:+.1f}% [{div['pct_low']:+.1f}, {div['pct_high']:+.1f}]"
        )
        mean_ppl = sum(row["perplexity"]) / len(row["perplexity"]) if row["perplexity"] else float("nan")
        sent = (row["outer_bytes_per_rank"] or 0) / 2**20
        print(
            f"{mesh} {arm:8s} {sent:6.1f} MiB sent, perplexity {mean_ppl:7.2f} (n={len(seeds)}): "
            f"{text}{spread}"
        )
    with open(os.path.join(FOLDER, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {os.path.join(FOLDER, 'summary.json')}")


if __name__ == "__main__":
    main()
