"""NoLoCo, DiLoCo and no sync from 4 to 1,024 replicas, in one process: final perplexity against the replica
count, with the global batch held fixed and with the per-replica batch held fixed (issue 41).

Every replica is a slice of stacked parameters trained with ``torch.func.vmap`` (``_replica_stack.py``: the
package's model, initialisation, loss, clipping, the Trainer's AdamW and schedule, Accelerate's per-replica
data order, and the package's outer-step functions and gossip draws). pp = 1.

    python benchmarks/replica_scale_quality.py --reproduce   # the factorial's dp4xpp1 and dp8xpp1, 3 seeds
    python benchmarks/replica_scale_quality.py --curve       # the curve (the small model of CURVE)
    python benchmarks/replica_scale_quality.py --report      # tables and the plot from the saved JSON
    python benchmarks/replica_scale_quality.py --quick       # smoke: seconds, in a temporary folder

``--reproduce`` reruns the factorial's setup (``benchmarks/studies/factorial.yaml``: model, data, batch,
schedule, seeds 0-2, arms diloco-H8-a0.3, noloco-H8-a0.3, local) and compares each final perplexity with the
multi-process runs in ``benchmarks/results/factorial/part-dp{4,8}xpp1.json``. Both evaluations are recorded:
the factorial's (replica ``r`` scores eval batches ``r, r + R, ...``; the losses pooled over the replicas) and
``full`` (every evaluated replica scores the whole eval set, pooled), which the curve uses.

Results (saved after every (series, R, seed) group; a rerun skips the groups a file holds):
``benchmarks/results/replica_scale_quality/{reproduction,curve}.json``, ``summary.md`` and
``replica_scale_quality.png`` (``--output-dir`` moves them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common
import _stats as stats
import _study as study_io
import torch
from _replica_stack import ReplicaStack, replica_rows

FACTORIAL = os.path.join(common.BENCH_DIR, "studies", "factorial.yaml")
FACTORIAL_RESULTS = os.path.join(common.RESULTS_DIR, "factorial")
RESULTS = os.path.join(common.RESULTS_DIR, "replica_scale_quality")
ARMS = ["diloco-H8-a0.3", "noloco-H8-a0.3", "local"]
REFERENCE = "diloco-H8-a0.3"

# The curve's small model and schedule (the factorial's 1.25M-parameter model at 1,024 replicas does not fit
# 2 CPU cores in an hour): 4x fewer hidden units, 2 layers, a 512-word BPE of the same corpus, 32-token
# blocks, 48 steps (6 outer steps at H = 8). Global-batch series: 1,024 rows every step at every R (1 row per
# replica at R = 1,024); the per-replica series: 1 row per replica (so the two meet at R = 1,024, run once).
CURVE = {
    "model": dict(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=86,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    ),
    "data": dict(block_size=32, eval_blocks=128, max_docs=None),
    "train": dict(max_steps=48, warmup_steps=5, lr=3.0e-3, eval_batch=16),
    "attn": "eager",
    "replicas": [4, 8, 16, 64, 256, 1024],
    "global_batch": 1024,
    "per_replica_batch": 1,
    "eval_replicas": 32,  # the full evaluation scores at most this many replicas per arm, evenly spaced
    "seeds": [0, 1, 2],
}
QUICK = {
    "model": dict(CURVE["model"], vocab_size=384),
    "data": dict(block_size=32, eval_blocks=16, max_docs=40),
    "train": dict(max_steps=8, warmup_steps=1, lr=3.0e-3, eval_batch=4),
    "attn": "eager",
    "replicas": [2, 4],
    "global_batch": 8,
    "per_replica_batch": 1,
    "eval_replicas": 4,
    "seeds": [0, 1],
}


def factorial_setup() -> dict:
    study = study_io.load_study(FACTORIAL)
    return {
        "model": study["model"],
        "data": study["data"],
        "train": {
            k: study["train"][k] for k in ("max_steps", "warmup_steps", "lr", "eval_batch", "eval_every")
        },
        "attn": None,  # transformers' default (sdpa), as the factorial ran
        "global_batch": study["train"]["global_batch"],
        "eval_replicas": 8,
        "arms": {name: study["arms"][name] for name in ARMS},
    }


def curve_arms() -> dict:
    study = study_io.load_study(FACTORIAL)
    return {name: study["arms"][name] for name in ARMS}


# ----------------------------------------------------------------------------------------------- one group


def as_tensors(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(dataset["input_ids"]), torch.tensor(dataset["labels"])


def sharded_eval_rows(num_rows: int, batch: int, replicas: int) -> torch.Tensor | None:
    """The factorial's evaluation: Accelerate deals eval batch ``k`` (of ``batch`` rows, in order) to replica
    ``k % replicas``; ``(replicas, rows each)`` when every replica gets as many rows, else ``None``."""
    batches = [list(range(k, min(k + batch, num_rows))) for k in range(0, num_rows, batch)]
    mine = [[i for k, b in enumerate(batches) if k % replicas == r for i in b] for r in range(replicas)]
    if len({len(m) for m in mine}) != 1 or not mine[0]:
        return None
    return torch.tensor(mine)


def evaluate(stack: ReplicaStack, eval_ids, eval_labels, setup: dict, mode: str) -> dict[int, float]:
    """Perplexity per arm: ``sharded`` (the factorial's pooling) or ``full`` (each of at most
    ``eval_replicas`` evenly spaced replicas on the whole eval set, pooled)."""
    R, arms = stack.R, len(stack.arms)
    if mode == "sharded":
        rows = sharded_eval_rows(len(eval_ids), setup["train"]["eval_batch"], R)
        if rows is None:
            return {}
        slices = [a * R + r for a in range(arms) for r in range(R)]
        rows = rows.repeat(arms, 1)
        totals = stack.eval_totals(eval_ids[rows], eval_labels[rows], slices)
        per_arm = totals.view(arms, R, 2).sum(1)
    else:
        count = min(R, setup["eval_replicas"])
        chosen = [round(i * R / count) for i in range(count)]
        slices = [a * R + r for a in range(arms) for r in chosen]
        n = len(slices)
        ids = eval_ids.unsqueeze(0).expand(n, -1, -1)
        labels = eval_labels.unsqueeze(0).expand(n, -1, -1)
        totals = stack.eval_totals(ids, labels, slices)
        per_arm = totals.view(arms, count, 2).sum(1)
    return {a: math.exp(per_arm[a, 0].item() / per_arm[a, 1].item()) for a in range(arms)}


def run_group(setup: dict, data, replicas: int, per_replica: int, seed: int, arm_names: list[str]) -> dict:
    """One seed at one replica count: every arm of ``arm_names`` from the same weights on the same batches."""
    from transformers import LlamaConfig

    from hf_noloco.engine.loading import build_stage

    train_ids, train_labels, eval_ids, eval_labels = data
    t = setup["train"]
    config = LlamaConfig(**setup["model"], tie_word_embeddings=False)
    stage = build_stage(config, 0, 1, seed=seed, attn_implementation=setup["attn"])
    arms = [setup["arms"][name] for name in arm_names]
    stack = ReplicaStack(stage, arms, replicas, seed, t["lr"], 0.01, t["warmup_steps"], t["max_steps"])
    rows = replica_rows(len(train_ids), replicas, per_replica, seed, t["max_steps"])
    eval_every = t.get("eval_every")
    curves = {name: [] for name in arm_names}

    def log_eval(step):
        for a, ppl in evaluate(stack, eval_ids, eval_labels, setup, "sharded").items():
            curves[arm_names[a]].append([step, ppl])

    if eval_every:
        log_eval(0)
    start = time.perf_counter()
    eval_s = 0.0
    losses = []
    for step in range(t["max_steps"]):
        index = rows[step]
        loss = stack.train_step(train_ids[index], train_labels[index])
        losses.append(loss.view(len(arms), replicas).mean(1))
        if eval_every and (step + 1) % eval_every == 0:
            e = time.perf_counter()
            log_eval(step + 1)
            eval_s += time.perf_counter() - e
    train_s = time.perf_counter() - start - eval_s
    e = time.perf_counter()
    sharded = evaluate(stack, eval_ids, eval_labels, setup, "sharded")
    full = evaluate(stack, eval_ids, eval_labels, setup, "full")
    eval_s += time.perf_counter() - e
    last = torch.stack(losses[-8:]).mean(0)
    out = {
        "replicas": replicas,
        "per_replica_batch": per_replica,
        "global_batch": replicas * per_replica,
        "seed": seed,
        "train_s": train_s,
        "eval_s": eval_s,
        "step_s": train_s / t["max_steps"],
        "arms": {},
    }
    for a, name in enumerate(arm_names):
        out["arms"][name] = {
            "final_perplexity": full[a],
            "final_perplexity_sharded": sharded.get(a),
            "train_loss_last8": last[a].item(),
            "divergence": stack.divergence(a),
            "sharded_curve": curves[name],
        }
    return out


# ------------------------------------------------------------------------------------------------ files


def load(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def save(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def load_data(setup: dict):
    d = setup["data"]
    train, eval_, _ = common.load_corpus(
        common.BUILTIN, d["block_size"], setup["model"]["vocab_size"], d["eval_blocks"], d.get("max_docs")
    )
    return (*as_tensors(train), *as_tensors(eval_))


def run_groups(path: str, setup: dict, groups: list[tuple[str, int, int, int]], record: dict) -> dict:
    """Runs every ``(series, R, per_replica, seed)`` group the file at ``path`` does not hold yet."""
    old = load(path)

    def shape(setup):  # what must agree for groups to be merged (the replica counts and seeds may grow)
        return {k: v for k, v in setup.items() if k not in ("replicas", "seeds")}

    if old and shape(old["setup"]) != shape(record["setup"]):
        raise SystemExit(f"{path} was made with another setup: move it away")
    record["groups"] = old.get("groups", [])
    done = {(g["series"], g["replicas"], g["per_replica_batch"], g["seed"]) for g in record["groups"]}
    data = load_data(setup)
    print(f"{len(data[0])} train rows, {len(data[2])} eval rows; {len(groups)} groups -> {path}", flush=True)
    for series, R, b, seed in groups:
        if (series, R, b, seed) in done:
            continue
        group = run_group(setup, data, R, b, seed, list(setup["arms"]))
        group["series"] = series
        record["groups"].append(group)
        record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        save(path, record)
        ppl = "  ".join(f"{n} {v['final_perplexity']:8.2f}" for n, v in group["arms"].items())
        print(
            f"[{series} R={R:>4} b={b:>3} seed {seed}] {ppl}   {group['step_s']:.3f} s/step "
            f"({group['train_s']:.0f} s train, {group['eval_s']:.0f} s eval)",
            flush=True,
        )
    return record


def setup_record(setup: dict, command: str) -> dict:
    return {
        "benchmark": "replica_scale_quality",
        "setup": setup,
        "command": command,
        "machine": common.machine(),
    }


# ----------------------------------------------------------------------------------------------- reports


def factorial_finals(mesh: str) -> dict[str, dict[int, float]]:
    """The multi-process factorial's final (sharded-pooled) perplexity per arm and seed."""
    with open(os.path.join(FACTORIAL_RESULTS, f"part-dp{mesh}xpp1.json")) as f:
        part = json.load(f)
    out: dict[str, dict[int, float]] = {}
    for run in part["runs"]:
        evals = [h["eval_perplexity"] for h in run["log_history"] if "eval_perplexity" in h]
        out.setdefault(run["arm"], {})[run["seed"]] = evals[-1]
    return out


def _ci(values: list[float]) -> str:
    m, low, high = stats.interval(values)
    return f"{m:.1f} [{low:.1f}, {high:.1f}]" if not math.isnan(low) else f"{m:.1f}"


def _pct(c: dict) -> str:
    if math.isnan(c["pct_low"]):
        return f"{c['pct']:+.1f}%"
    return f"{c['pct']:+.1f}% [{c['pct_low']:+.1f}, {c['pct_high']:+.1f}]"


def reproduction_report(record: dict) -> tuple[str, dict]:
    lines = [
        "| R | arm | factorial, per seed | this study, per seed | factorial mean [95% CI] | "
        "this study mean | in the CI |",
        "|---|---|---|---|---|---|---|",
    ]
    checks = {}
    for R in sorted({g["replicas"] for g in record["groups"]}):
        mine = {g["seed"]: g for g in record["groups"] if g["replicas"] == R}
        seeds = sorted(mine)
        theirs = factorial_finals(str(R))
        ours = {}
        for arm in ARMS:
            ref = [theirs[arm][s] for s in seeds]
            got = [mine[s]["arms"][arm]["final_perplexity_sharded"] for s in seeds]
            ours[arm] = got
            m, low, high = stats.interval(ref)
            inside = low <= stats.mean(got) <= high
            checks[f"{R}/{arm}"] = {"factorial": ref, "study": got, "ci": [low, high], "inside": inside}
            lines.append(
                f"| {R} | {arm} | {', '.join(f'{v:.1f}' for v in ref)} | "
                f"{', '.join(f'{v:.1f}' for v in got)} | {_ci(ref)} | {stats.mean(got):.1f} | "
                f"{'yes' if inside else 'no'} |"
            )
        ref_ratio = stats.paired_log_ratio(
            [theirs["noloco-H8-a0.3"][s] for s in seeds], [theirs[REFERENCE][s] for s in seeds]
        )
        got_ratio = stats.paired_log_ratio(ours["noloco-H8-a0.3"], ours[REFERENCE])
        inside = ref_ratio["low"] <= got_ratio["ratio"] <= ref_ratio["high"]
        checks[f"{R}/noloco-vs-diloco"] = {"factorial": ref_ratio, "study": got_ratio, "inside": inside}
        lines.append(
            f"| {R} | NoLoCo / DiLoCo | | {', '.join(f'{v:.4f}' for v in got_ratio['per_seed'])} | "
            f"{_pct(ref_ratio)} | {got_ratio['pct']:+.1f}% | {'yes' if inside else 'no'} |"
        )
    return "\n".join(lines) + "\n", checks


def curve_table(record: dict) -> tuple[str, dict]:
    """Per series and R: each arm's final perplexity (mean, 95% CI over seeds) and the paired ratios."""
    rows, summary = [], {}
    for series in ("global", "per_replica"):
        groups = [g for g in record["groups"] if g["series"] in (series, "both")]
        if not groups:
            continue
        rows += [
            f"\n**{series.replace('_', '-')} batch fixed**\n",
            "| R | rows/replica | global rows | DiLoCo ppl | NoLoCo ppl | no sync ppl | NoLoCo / DiLoCo | "
            "no sync / DiLoCo | NoLoCo divergence | s/step |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for R in sorted({g["replicas"] for g in groups}):
            mine = sorted((g for g in groups if g["replicas"] == R), key=lambda g: g["seed"])
            ppl = {arm: [g["arms"][arm]["final_perplexity"] for g in mine] for arm in ARMS}
            nl = stats.paired_log_ratio(ppl["noloco-H8-a0.3"], ppl[REFERENCE])
            lo = stats.paired_log_ratio(ppl["local"], ppl[REFERENCE])
            div = stats.mean([g["arms"]["noloco-H8-a0.3"]["divergence"] for g in mine])
            step_s = stats.mean([g["step_s"] for g in mine])
            summary[f"{series}/{R}"] = {
                "seeds": [g["seed"] for g in mine],
                "per_replica_batch": mine[0]["per_replica_batch"],
                "global_batch": mine[0]["global_batch"],
                "perplexity": {
                    arm: dict(zip(("mean", "low", "high"), stats.interval(v))) for arm, v in ppl.items()
                },
                "noloco_vs_diloco": nl,
                "local_vs_diloco": lo,
                "noloco_divergence": div,
                "step_s": step_s,
            }
            rows.append(
                f"| {R} | {mine[0]['per_replica_batch']} | {mine[0]['global_batch']} | "
                f"{_ci(ppl[REFERENCE])} | {_ci(ppl['noloco-H8-a0.3'])} | {_ci(ppl['local'])} | "
                f"{_pct(nl)} | {_pct(lo)} | "
                f"{div:.2e} | {step_s:.2f} |"
            )
    return "\n".join(rows) + "\n", summary


def plot(summary: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, series in zip(axes, ("global", "per_replica")):
        keys = sorted((k for k in summary if k.startswith(series + "/")), key=lambda k: int(k.split("/")[1]))
        if not keys:
            continue
        xs = [int(k.split("/")[1]) for k in keys]
        for which, color, label in (
            ("noloco_vs_diloco", "tab:red", "NoLoCo"),
            ("local_vs_diloco", "tab:gray", "no sync"),
        ):
            mid = [summary[k][which]["pct"] for k in keys]
            low = [summary[k][which]["pct_low"] for k in keys]
            high = [summary[k][which]["pct_high"] for k in keys]
            ax.plot(xs, mid, "o-", color=color, label=f"{label} / DiLoCo")
            ax.fill_between(xs, low, high, color=color, alpha=0.2)
        ax.axhline(0, color="tab:blue", lw=1, label="DiLoCo")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel("final perplexity vs DiLoCo (%)")
        title = "global batch fixed" if series == "global" else "per-replica batch fixed"
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(results_dir: str) -> dict:
    out, text = {}, []
    repro = load(os.path.join(results_dir, "reproduction.json"))
    if repro.get("groups"):
        table, checks = reproduction_report(repro)
        text += ["## Reproduction of the factorial (dp4xpp1, dp8xpp1)\n", table]
        out["reproduction"] = checks
    curve = load(os.path.join(results_dir, "curve.json"))
    if curve.get("groups"):
        table, summary = curve_table(curve)
        text += ["## The curve\n", table]
        out["curve"] = summary
        png = plot(summary, os.path.join(results_dir, "replica_scale_quality.png"))
        if png:
            print("wrote", png)
    md = "\n".join(text)
    print(md)
    with open(os.path.join(results_dir, "summary.md"), "w") as f:
        f.write(md)
    save(os.path.join(results_dir, "summary.json"), out)
    return out


# -------------------------------------------------------------------------------------------------- main


def curve_groups(setup: dict) -> list[tuple[str, int, int, int]]:
    """The groups of the curve, cheapest first: per-replica series (``b`` rows each), then the global series
    (``global_batch`` rows); the point where the two coincide runs once, as ``both``."""
    groups = []
    G, b = setup["global_batch"], setup["per_replica_batch"]
    for seed in setup["seeds"]:
        for R in setup["replicas"]:
            if R * b != G:
                groups.append(("per_replica", R, b, seed))
    # The global series' groups cost the same at every R: the largest R first (the point the study is for),
    # then the factorial's 4 and 8 (the check against it), then the rest.
    order = sorted(setup["replicas"], key=lambda R: (max(setup["replicas"]) != R, R not in (4, 8), -R))
    for R in order:
        for seed in setup["seeds"]:
            groups.append(("both" if R * b == G else "global", R, G // R, seed))
    return groups


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reproduce", action="store_true", help="the factorial's dp4xpp1 and dp8xpp1")
    parser.add_argument("--curve", action="store_true", help="the curve, on the small model")
    parser.add_argument("--report", action="store_true", help="tables and the plot from the saved files")
    parser.add_argument("--quick", action="store_true", help="smoke: a tiny curve and reproduction-style run")
    parser.add_argument("--replicas", help="comma-separated replica counts (overrides the setup's)")
    parser.add_argument("--seeds", help="comma-separated seeds (overrides the setup's)")
    parser.add_argument(
        "--output-dir", help="results folder (default benchmarks/results/replica_scale_quality)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results_dir = args.output_dir or (tempfile.mkdtemp(prefix="rsq-quick-") if args.quick else RESULTS)
    os.makedirs(results_dir, exist_ok=True)
    command = "python benchmarks/replica_scale_quality.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    replicas = [int(r) for r in args.replicas.split(",")] if args.replicas else None
    if args.reproduce:
        setup = factorial_setup()
        groups = [
            ("factorial", R, setup["global_batch"] // R, s)
            for R in replicas or [4, 8]
            for s in seeds or [0, 1, 2]
        ]
        run_groups(
            os.path.join(results_dir, "reproduction.json"), setup, groups, setup_record(setup, command)
        )
    if args.curve or args.quick:
        setup = dict(QUICK if args.quick else CURVE, arms=curve_arms())
        if args.quick:
            setup["arms"] = {n: dict(a, H=2) if a["H"] else a for n, a in setup["arms"].items()}
        if replicas:
            setup["replicas"] = replicas
        if seeds:
            setup["seeds"] = seeds
        run_groups(
            os.path.join(results_dir, "curve.json"), setup, curve_groups(setup), setup_record(setup, command)
        )
    result = report(results_dir)
    result["results_dir"] = results_dir
    return result


if __name__ == "__main__":
    main()
