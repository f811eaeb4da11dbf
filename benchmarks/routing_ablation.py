"""The paper's §5.2 routing ablation (its Fig. 4) in miniature: with the outer sync switched off (`local`),
does random routing between pipeline stages keep the replicas' weights closer together than fixed routing,
and what does it cost in validation perplexity?

pp=2 stages x dp=4 replicas of the same tiny Llama, same data and seeds, trained with
    fixed    each replica column is an independent model (the baseline)
    sample   a fresh random replica pairing per sample (the official code's granularity)
    step     one random pairing per optimizer step (the paper's text)
Reported as ratios random / fixed, per seed, over training: replica-weight standard deviation (the official
RMS replica divergence) and pooled validation perplexity.

    python benchmarks/routing_ablation.py             # full: ~15 min on 2 cores
    python benchmarks/routing_ablation.py --quick     # smoke: seconds; checks the output's structure

Writes benchmarks/results/routing_ablation.json and routing_ablation.png (``--output`` moves both).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402

ROUTINGS = ["fixed", "sample", "step"]
RANDOM = ["sample", "step"]
COLORS = {"fixed": "black", "sample": "tab:red", "step": "tab:orange"}

SETTINGS = {
    "full": dict(
        model=common.FULL_MODEL, vocab_size=2048, block_size=64, global_batch=16, eval_batch=16, eval_blocks=128,
        max_docs=None, dp=4, pp=2, max_steps=160, warmup_steps=16, lr=2e-3, log_every=10, eval_every=20,
        seeds=[0, 1],
    ),
    "quick": dict(
        model=common.QUICK_MODEL, vocab_size=384, block_size=32, global_batch=8, eval_batch=4, eval_blocks=16,
        max_docs=40, dp=2, pp=2, max_steps=6, warmup_steps=1, lr=3e-3, log_every=2, eval_every=3, seeds=[0],
    ),
}


def ratios(runs: list[dict], routing: str, key: str, steps_key: str) -> tuple[list[int], list[list[float]]]:
    """``key`` of ``routing`` over ``key`` of fixed routing, per seed, at the steps where fixed is non-zero."""
    per_seed, steps = [], None
    for fixed in (r for r in runs if r["routing"] == "fixed"):
        other = next(r for r in runs if r["routing"] == routing and r["seed"] == fixed["seed"])
        keep = [i for i, v in enumerate(fixed[key]) if v > 0]
        steps = [fixed[steps_key][i] for i in keep]
        per_seed.append([other[key][i] / fixed[key][i] for i in keep])
    return steps, per_seed


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(runs: list[dict]) -> dict:
    """Per random routing: the std and perplexity ratios to fixed routing (final, second-half mean, max), mean
    over seeds; per routing: the final perplexity and divergence."""
    summary = {}
    for routing in RANDOM:
        div_steps, div = ratios(runs, routing, "replica_divergence", "log_steps")
        _, ppl = ratios(runs, routing, "eval_perplexity", "steps")
        half = [i for i, s in enumerate(div_steps) if s >= div_steps[-1] / 2]
        summary[routing] = {
            "divergence_ratio_final": mean([r[-1] for r in div]),
            "divergence_ratio_second_half": mean([mean([r[i] for i in half]) for r in div]),
            "divergence_ratio_final_per_seed": [r[-1] for r in div],
            "perplexity_ratio_final": mean([r[-1] for r in ppl]),
            "perplexity_ratio_max": mean([max(r[1:]) for r in ppl]),
            "perplexity_ratio_final_per_seed": [r[-1] for r in ppl],
        }
    for routing in ROUTINGS:
        mine = [r for r in runs if r["routing"] == routing]
        summary.setdefault(routing, {}).update(
            final_perplexity=mean([r["final_perplexity"] for r in mine]),
            final_divergence=mean([r["replica_divergence"][-1] for r in mine]),
            wall_s=mean([r["wall_s"] for r in mine]),
        )
    return summary


def print_table(summary: dict) -> None:
    print(f"{'routing':<8} {'final ppl':>10} {'final div':>10} {'div ratio':>10} {'2nd-half':>9} "
          f"{'ppl ratio':>10} {'max ppl r':>10}")
    for routing in ROUTINGS:
        row = summary[routing]
        extra = (f"{row['divergence_ratio_final']:>10.3f} {row['divergence_ratio_second_half']:>9.3f} "
                 f"{row['perplexity_ratio_final']:>10.3f} {row['perplexity_ratio_max']:>10.3f}"
                 if routing in RANDOM else f"{'1':>10} {'1':>9} {'1':>10} {'1':>10}")
        print(f"{routing:<8} {row['final_perplexity']:>10.2f} {row['final_divergence']:>10.3e} {extra}")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for routing in ROUTINGS:
        mine = [r for r in runs if r["routing"] == routing]
        common.plot_band(axes[0, 0], mine[0]["log_steps"], [r["replica_divergence"] for r in mine],
                         color=COLORS[routing], label=routing)
        common.plot_band(axes[0, 1], mine[0]["steps"], [r["eval_perplexity"] for r in mine],
                         color=COLORS[routing], label=routing)
    for routing in RANDOM:
        steps, div = ratios(runs, routing, "replica_divergence", "log_steps")
        common.plot_band(axes[1, 0], steps, div, color=COLORS[routing], label=f"{routing} / fixed")
        steps, ppl = ratios(runs, routing, "eval_perplexity", "steps")
        common.plot_band(axes[1, 1], steps, ppl, color=COLORS[routing], label=f"{routing} / fixed")
    axes[0, 0].set(ylabel="replica-weight std (RMS divergence)", title="replica spread, no outer sync")
    axes[0, 1].set(ylabel="validation perplexity", yscale="log", title="validation perplexity")
    finals = [r["final_perplexity"] for r in runs]
    axes[0, 1].set_ylim(min(finals) * 0.9, max(finals) * 4)
    axes[1, 0].set(ylabel="std ratio (random / fixed)", title="(a) replica-weight std ratio")
    axes[1, 1].set(ylabel="perplexity ratio (random / fixed)", title="(b) validation perplexity ratio")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.axhline(1.0, color="black", linewidth=0.8)
    s = result["settings"]
    fig.suptitle(f"{result['corpus']}: routing ablation, outer sync off, dp={s['dp']} x pp={s['pp']}, "
                 f"{s['parameters'] / 1e6:.2f}M params, seeds {result['seeds']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check(result: dict) -> None:
    """The structure the smoke test relies on; every number finite."""
    assert sorted(r["routing"] for r in result["runs"]) == sorted(ROUTINGS * len(result["seeds"]))
    for run in result["runs"]:
        assert run["method"] == "local" and run["steps"][0] == 0
        assert common.all_finite(run["eval_perplexity"] + run["replica_divergence"] + run["loss"])
        assert run["replica_divergence"][-1] > 0  # no sync: the replicas drift apart
    for routing in RANDOM:
        row = result["summary"][routing]
        assert common.all_finite([row["divergence_ratio_final"], row["perplexity_ratio_final"]])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke mode: a tiny model, a few steps")
    parser.add_argument("--corpus", default=common.BUILTIN, help="a text file, or builtin:python-docs (default)")
    parser.add_argument("--output", help="JSON path (default benchmarks/results/routing_ablation.json)")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the mode's)")
    parser.add_argument("--dp", type=int, help="replicas per stage (default: the mode's)")
    parser.add_argument("--steps", type=int, help="override max_steps (warm-up stays 10%%)")
    args = parser.parse_args(argv)

    mode = "quick" if args.quick else "full"
    s = dict(SETTINGS[mode])
    if args.steps:
        s.update(max_steps=args.steps, warmup_steps=max(1, args.steps // 10))
    if args.seeds:
        s["seeds"] = [int(x) for x in args.seeds.split(",")]
    if args.dp:
        s["dp"] = args.dp
    output = args.output or os.path.join(common.RESULTS_DIR, "routing_ablation.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    name = common.corpus_name(args.corpus)

    start = time.monotonic()
    train, eval_, _ = common.load_corpus(args.corpus, s["block_size"], s["vocab_size"], s["eval_blocks"], s["max_docs"])
    print(f"{name}: {len(train)} train blocks, {len(eval_)} eval blocks of {s['block_size']} tokens", flush=True)
    runs = []
    for seed in s["seeds"]:
        for routing in ROUTINGS:
            spec = dict(model=s["model"], dp=s["dp"], pp=s["pp"], method="local", routing=routing, seed=seed,
                        global_batch=s["global_batch"], microbatch_size=None, eval_batch=s["eval_batch"],
                        lr=s["lr"], warmup_steps=s["warmup_steps"], max_steps=s["max_steps"],
                        log_every=s["log_every"], eval_every=s["eval_every"], inner_steps=None,
                        block_size=s["block_size"])
            record = common.train_run(spec, train, eval_)
            runs.append({"routing": routing, "seed": seed, "method": "local", **record})
            print(f"seed {seed} {routing:<6} final ppl {record['final_perplexity']:8.2f}  "
                  f"divergence {record['replica_divergence'][-1]:.3e}  {record['wall_s']:.0f} s", flush=True)

    result = {
        "benchmark": "routing_ablation", "mode": mode, "corpus": name, "corpus_arg": args.corpus,
        "command": "python benchmarks/routing_ablation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": common.machine(),
        "settings": {
            "model": s["model"], "parameters": common.count_parameters(s["model"]), "dp": s["dp"], "pp": s["pp"],
            "outer_optimizer": "local", "block_size": s["block_size"], "global_batch": s["global_batch"],
            "tokens_per_step": s["global_batch"] * s["block_size"], "max_steps": s["max_steps"], "lr": s["lr"],
            "lr_schedule": f"linear warm-up {s['warmup_steps']} steps, cosine to 0.1x peak",
            "optimizer": "AdamW (weight decay 0.01), grad clip 1.0", "log_every": s["log_every"],
            "eval_every": s["eval_every"], "eval_blocks": len(eval_),
        },
        "seeds": s["seeds"],
        "runs": runs,
    }
    result["summary"] = summarize(runs)
    result["wall_s"] = time.monotonic() - start
    check(result)
    print_table(result["summary"])
    with open(output, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(output)[0] + ".png"
    plot(result, png)
    print("wrote", png)
    print("wrote", output, f"in {result['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
