"""Convergence of ddp, diloco, noloco and local on the same tokens: the paper's Table 2 in miniature.

The same tiny Llama is trained from the same initialisation on the same batches with each outer method, for
each (dp x pp) mesh, on local gloo processes (one thread each). Equal tokens per method: same global batch,
same steps, same learning-rate schedule (linear warm-up, cosine to 0.1x peak, as the paper); noloco and diloco
share H. Validation perplexity is pooled over the replicas (each replica column evaluated as one model with
fixed routing, as the official code); replica divergence is the official RMS distance of the replicas' weights
from their mean, logged every few steps (so both the drift between syncs and the state after one show).

    python benchmarks/convergence.py                      # full: built-in corpus, ~15 min on 2 cores
    python benchmarks/convergence.py --corpus ../shared/data/tinyshakespeare.txt
    python benchmarks/convergence.py --quick              # smoke: seconds; checks the output's structure

Writes benchmarks/results/convergence_<corpus>.json, convergence_<corpus>_perplexity.png and
convergence_<corpus>_divergence.png (``--output`` moves the JSON; the plots go beside it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common  # noqa: E402

METHODS = ["ddp", "diloco", "noloco", "local"]
COLORS = {"ddp": "black", "diloco": "tab:blue", "noloco": "tab:red", "local": "tab:gray"}

SETTINGS = {
    "full": dict(
        model=common.FULL_MODEL, vocab_size=2048, block_size=64, global_batch=16, eval_batch=16, eval_blocks=128,
        max_docs=None,
        max_steps=160, warmup_steps=16, lr=2e-3, inner_steps=10, log_every=5, eval_every=20,
        runs={"4x1": [0, 1], "2x2": [0], "4x2": [0]},  # mesh -> seeds (--meshes 4x1,2x2 to skip the 8-process one)
    ),
    "quick": dict(
        model=common.QUICK_MODEL, vocab_size=384, block_size=32, global_batch=8, eval_batch=4, eval_blocks=16,
        max_docs=40,
        max_steps=6, warmup_steps=1, lr=3e-3, inner_steps=2, log_every=1, eval_every=3,
        runs={"2x2": [0]},
    ),
}


def mesh_of(name: str) -> tuple[int, int]:
    dp, pp = name.split("x")
    return int(dp), int(pp)


def between_syncs(run: dict, inner_steps: int) -> tuple[list[int], list[float]]:
    """The divergence logged between outer steps (steps not a multiple of H): right after a diloco sync (or a
    noloco one at dp=2) the replicas are identical, so the log steps that fall on a sync show 0."""
    keep = [i for i, step in enumerate(run["log_steps"]) if step % inner_steps]
    return [run["log_steps"][i] for i in keep], [run["replica_divergence"][i] for i in keep]


def summarize(runs: list[dict], inner_steps: int) -> dict:
    """Per mesh and method: final perplexity (mean and per seed), its ratio to diloco and ddp, and the mean
    replica divergence between syncs over the last quarter of training."""
    summary = {}
    for mesh in dict.fromkeys(r["mesh"] for r in runs):
        rows = {}
        for method in METHODS:
            mine = [r for r in runs if r["mesh"] == mesh and r["method"] == method]
            if not mine:
                continue
            finals = [r["final_perplexity"] for r in mine]
            late = []
            for r in mine:
                steps, divergence = between_syncs(r, inner_steps)
                late += [d for s, d in zip(steps, divergence) if s >= 0.75 * r["log_steps"][-1]]
            rows[method] = {
                "final_perplexity": sum(finals) / len(finals),
                "final_perplexity_per_seed": finals,
                "late_divergence": sum(late) / len(late) if late else math.nan,
                "wall_s": sum(r["wall_s"] for r in mine) / len(mine),
            }
        for method, row in rows.items():
            for ref in ("diloco", "ddp"):
                if ref in rows:
                    row[f"vs_{ref}"] = row["final_perplexity"] / rows[ref]["final_perplexity"]
        summary[mesh] = rows
    return summary


def print_table(summary: dict) -> None:
    print(f"{'mesh':<6} {'method':<7} {'final ppl':>10} {'per seed':>22} {'vs diloco':>9} {'vs ddp':>7} "
          f"{'late div':>9} {'train s':>8}")
    for mesh, rows in summary.items():
        for method, row in rows.items():
            seeds = ", ".join(f"{p:.1f}" for p in row["final_perplexity_per_seed"])
            print(f"{mesh:<6} {method:<7} {row['final_perplexity']:>10.2f} {seeds:>22} "
                  f"{row.get('vs_diloco', math.nan):>9.3f} {row.get('vs_ddp', math.nan):>7.3f} "
                  f"{row['late_divergence']:>9.2e} {row['wall_s']:>8.1f}")


def plot(result: dict, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meshes = list(result["summary"])
    paths = []
    for kind in ("perplexity", "divergence"):
        fig, axes = plt.subplots(1, len(meshes), figsize=(4.5 * len(meshes), 3.6), squeeze=False)
        for ax, mesh in zip(axes[0], meshes):
            dp, pp = mesh_of(mesh)
            for method in METHODS:
                mine = [r for r in result["runs"] if r["mesh"] == mesh and r["method"] == method]
                if not mine:
                    continue
                if kind == "perplexity":
                    x = [t / 1e6 for t in mine[0]["tokens"]]
                    common.plot_band(ax, x, [r["eval_perplexity"] for r in mine], color=COLORS[method], label=method)
                elif method != "ddp":  # ddp's replicas are identical: divergence 0, nothing to draw on a log scale
                    H = result["settings"]["inner_steps"]
                    steps = between_syncs(mine[0], H)[0]
                    common.plot_band(ax, steps, [between_syncs(r, H)[1] for r in mine], color=COLORS[method],
                                     label=method, marker=".")
            ax.set_title(f"dp={dp} x pp={pp}")
            ax.set_yscale("log")
            ax.grid(alpha=0.3, which="both")
            if kind == "perplexity":
                ax.set_xlabel("training tokens (millions)")
                ax.set_ylabel("validation perplexity")
                finals = [r["final_perplexity"] for r in result["runs"] if r["mesh"] == mesh]
                ax.set_ylim(min(finals) * 0.9, max(finals) * 4)  # the end of training, not the first eval
            else:
                ax.set_xlabel("step")
                ax.set_ylabel("replica divergence (RMS)")
            ax.legend(fontsize=8)
        settings = result["settings"]
        fig.suptitle(f"{result['corpus']}: {settings['parameters'] / 1e6:.2f}M-param Llama, H={settings['inner_steps']}, "
                     f"{len(result['seeds'])} seed(s)" if kind == "perplexity" else
                     f"{result['corpus']}: replica divergence between outer steps (steps not a multiple of "
                     f"H={settings['inner_steps']}; ddp: 0)", fontsize=10)
        fig.tight_layout()
        path = f"{stem}_{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def check(result: dict) -> None:
    """The structure the smoke test relies on; every number finite."""
    assert result["runs"] and set(result["summary"]) == {r["mesh"] for r in result["runs"]}
    for run in result["runs"]:
        assert len(run["steps"]) == len(run["eval_perplexity"]) == len(run["tokens"]) >= 2, run["mesh"]
        assert len(run["log_steps"]) == len(run["replica_divergence"]) == len(run["loss"]) >= 1
        assert common.all_finite(run["eval_perplexity"] + run["replica_divergence"] + run["loss"])
        assert run["steps"][0] == 0 and run["steps"][-1] == result["settings"]["max_steps"]
    for rows in result["summary"].values():
        assert set(rows) == set(METHODS)
        assert rows["ddp"]["late_divergence"] < 1e-6  # gradients all-reduced every step: the replicas stay equal


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke mode: a tiny model, a few steps")
    parser.add_argument("--corpus", default=common.BUILTIN, help="a text file, or builtin:python-docs (default)")
    parser.add_argument("--output", help="JSON path (default benchmarks/results/convergence_<corpus>.json)")
    parser.add_argument("--meshes", help="comma-separated dpxpp meshes, e.g. 4x1,2x2 (default: the mode's)")
    parser.add_argument("--seeds", help="comma-separated seeds for every mesh (default: the mode's)")
    parser.add_argument("--steps", type=int, help="override max_steps (warm-up stays 10%%)")
    parser.add_argument("--replot", metavar="JSON", help="only redo the summary, table and plots of a result file")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
        result["summary"] = summarize(result["runs"], result["settings"]["inner_steps"])
        check(result)
        print_table(result["summary"])
        with open(args.replot, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.splitext(args.replot)[0])
        return result

    mode = "quick" if args.quick else "full"
    s = dict(SETTINGS[mode])
    if args.steps:
        s.update(max_steps=args.steps, warmup_steps=max(1, args.steps // 10))
    runs_plan = dict(s["runs"])
    if args.meshes:
        runs_plan = {m: runs_plan.get(m, [0]) for m in args.meshes.split(",")}
    if args.seeds:
        runs_plan = {m: [int(x) for x in args.seeds.split(",")] for m in runs_plan}
    name = common.corpus_name(args.corpus)
    output = args.output or os.path.join(common.RESULTS_DIR, f"convergence_{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)

    start = time.monotonic()
    train, eval_, _ = common.load_corpus(args.corpus, s["block_size"], s["vocab_size"], s["eval_blocks"], s["max_docs"])
    print(f"{name}: {len(train)} train blocks, {len(eval_)} eval blocks of {s['block_size']} tokens", flush=True)
    from dataclasses import asdict

    from hf_noloco.config import OuterSettings

    runs = []
    for mesh, seeds in runs_plan.items():
        dp, pp = mesh_of(mesh)
        for seed in seeds:
            for method in METHODS:
                spec = dict(model=s["model"], dp=dp, pp=pp, method=method, routing="sample", seed=seed,
                            global_batch=s["global_batch"], microbatch_size=None, eval_batch=s["eval_batch"],
                            lr=s["lr"], warmup_steps=s["warmup_steps"], max_steps=s["max_steps"],
                            log_every=s["log_every"], eval_every=s["eval_every"], inner_steps=s["inner_steps"],
                            block_size=s["block_size"])
                record = common.train_run(spec, train, eval_)
                runs.append({"mesh": mesh, "dp": dp, "pp": pp, "method": method, "seed": seed, **record})
                print(f"{mesh} seed {seed} {method:<7} final ppl {record['final_perplexity']:8.2f}  "
                      f"divergence {record['replica_divergence'][-1]:.2e}  {record['wall_s']:.0f} s", flush=True)

    tokens_per_step = s["global_batch"] * s["block_size"]
    result = {
        "benchmark": "convergence", "mode": mode, "corpus": name, "corpus_arg": args.corpus,
        "command": "python benchmarks/convergence.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": common.machine(),
        "settings": {
            "model": s["model"], "parameters": common.count_parameters(s["model"]), "block_size": s["block_size"],
            "global_batch": s["global_batch"], "tokens_per_step": tokens_per_step, "max_steps": s["max_steps"],
            "total_tokens": tokens_per_step * s["max_steps"], "train_blocks": len(train), "eval_blocks": len(eval_),
            "lr": s["lr"], "lr_schedule": f"linear warm-up {s['warmup_steps']} steps, cosine to 0.1x peak",
            "optimizer": "AdamW (weight decay 0.01), grad clip 1.0", "inner_steps": s["inner_steps"],
            "outer": {m: asdict(OuterSettings(m, s["inner_steps"])) for m in ("diloco", "noloco")},
            "routing": "sample", "log_every": s["log_every"], "eval_every": s["eval_every"],
        },
        "seeds": sorted({x for v in runs_plan.values() for x in v}),
        "runs": runs,
    }
    result["summary"] = summarize(runs, s["inner_steps"])
    result["wall_s"] = time.monotonic() - start
    check(result)
    print_table(result["summary"])
    with open(output, "w") as f:
        json.dump(result, f, indent=1)
    for path in plot(result, os.path.splitext(output)[0]):
        print("wrote", path)
    print("wrote", output, f"in {result['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
