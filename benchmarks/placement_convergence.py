"""What node-local routing and overlapped outer syncs do to training, in the convergence study's setup.

Two studies, each on local gloo processes with `NoLoCoTrainer` (the same tiny Llama, data, schedule and
outer hyperparameters as benchmarks/RESULTS.md's convergence study: hidden 128, 4 layers, 1.25M parameters,
160 steps of 1024 tokens, H = 10, built-in corpus):

- **routing** (the paper's §5.2 ablation, dp=4 x pp=2, no outer sync): the replicas' weight spread (the
  official RMS replica divergence) and validation perplexity under `fixed` routing, `sample` routing drawn
  among all replicas (`routing_domain: global`) and `sample` routing drawn within groups of 2 replicas, as two
  nodes of 4 processes would (`routing_domain: node`, `routing_group_size: 2`). Ratios to fixed routing, per
  seed, as in the routing ablation.
- **overlap** (dp=4 x pp=1): NoLoCo and DiLoCo with the outer exchange overlapping tau = 0, 1 and 5 inner
  steps (`outer_overlap_steps`); final perplexity and its ratio to tau = 0 with the same seed.

    python benchmarks/placement_convergence.py                   # both studies, 3 seeds: ~1-2 h on 2 cores
    python benchmarks/placement_convergence.py --study routing   # one of them
    python benchmarks/placement_convergence.py --quick           # smoke: seconds; checks the output
    python benchmarks/placement_convergence.py --replot benchmarks/results/placement_convergence.json

Writes benchmarks/results/placement_convergence.json and placement_convergence.png (``--output`` moves both).
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

RESULTS = os.path.join(common.RESULTS_DIR, "placement_convergence.json")

# The convergence study's model (benchmarks/RESULTS.md), and the smoke mode's.
MODEL = dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
QUICK_MODEL = dict(
    vocab_size=384,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)

SETTINGS = {
    "full": dict(
        model=MODEL, vocab_size=2048, block_size=64, global_batch=16, eval_batch=16, eval_blocks=128,
        max_docs=None, max_steps=160, warmup_steps=16, lr=2e-3, log_every=10, eval_every=20, inner_steps=10,
        seeds=[0, 1, 2], routing_mesh=(4, 2), overlap_mesh=(4, 1), taus=[0, 1, 5], group_size=2,
    ),
    "quick": dict(
        model=QUICK_MODEL, vocab_size=384, block_size=32, global_batch=8, eval_batch=4, eval_blocks=16,
        max_docs=40, max_steps=8, warmup_steps=1, lr=3e-3, log_every=2, eval_every=4, inner_steps=2,
        seeds=[0], routing_mesh=(4, 2), overlap_mesh=(2, 1), taus=[0, 1], group_size=2,
    ),
}  # fmt: skip

ROUTING_ARMS = {  # name: (routing, routing_domain, routing_group_size)
    "fixed": ("fixed", "global", None),
    "sample global": ("sample", "global", None),
    "sample node": ("sample", "node", "group_size"),
}


def _train_worker(spec: dict, train, eval_, out_dir: str):
    """One NoLoCoTrainer run on every rank; rank 0 returns the log history and the training wall time."""
    import torch.distributed as dist
    import transformers
    from transformers import LlamaConfig
    from transformers.trainer_callback import PrinterCallback

    from hf_noloco.config import NoLoCoConfig
    from hf_noloco.trainer import NoLoCoTrainer

    outer = {}
    if spec["method"] in ("noloco", "diloco"):
        outer = dict(inner_steps=spec["inner_steps"], outer_overlap_steps=spec["tau"])
    args = NoLoCoConfig(
        output_dir=out_dir, pipeline_stages=spec["pp"], outer_optimizer=spec["method"],
        routing=spec["routing"], routing_domain=spec["routing_domain"],
        routing_group_size=spec["routing_group_size"],
        per_device_train_batch_size=spec["global_batch"] // spec["dp"],
        per_device_eval_batch_size=spec["eval_batch"], learning_rate=spec["lr"], weight_decay=0.01,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=spec["warmup_steps"], max_grad_norm=1.0, max_steps=spec["max_steps"],
        logging_steps=spec["log_every"], divergence_steps=spec["log_every"], eval_strategy="steps",
        eval_steps=spec["eval_every"], eval_on_start=True, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=spec["seed"], data_seed=spec["seed"], p2p_timeout=300, **outer,
    )  # fmt: skip
    config = LlamaConfig(**spec["model"], tie_word_embeddings=False)
    transformers.logging.set_verbosity_error()
    trainer = NoLoCoTrainer(config, args, train_dataset=train, eval_dataset=eval_)
    trainer.remove_callback(PrinterCallback)
    dist.barrier()
    start = time.monotonic()
    trainer.train()
    wall = time.monotonic() - start
    history = list(trainer.state.log_history)
    rank = dist.get_rank()
    trainer.end()
    return (history, wall) if rank == 0 else None


def train_run(spec: dict, train, eval_) -> dict:
    from hf_noloco.launch.local_launch import run_distributed

    os.environ.setdefault("WANDB_MODE", "disabled")
    with tempfile.TemporaryDirectory() as out_dir:
        results = run_distributed(
            _train_worker, spec["dp"] * spec["pp"], spec, train, eval_, out_dir, timeout_s=900
        )
    history, wall = results[0]
    evals = [h for h in history if "eval_perplexity" in h]
    logs = [h for h in history if "loss" in h and "replica_divergence" in h]
    return {
        "steps": [h["step"] for h in evals],
        "eval_perplexity": [h["eval_perplexity"] for h in evals],
        "log_steps": [h["step"] for h in logs],
        "replica_divergence": [h["replica_divergence"] for h in logs],
        "final_perplexity": evals[-1]["eval_perplexity"],
        "wall_s": wall,
    }


def specs(setting: dict, studies: list[str]) -> list[dict]:
    keys = ("model", "block_size", "global_batch", "eval_batch", "max_steps", "warmup_steps", "lr",
            "log_every", "eval_every", "inner_steps")  # fmt: skip
    base = {k: setting[k] for k in keys}
    out = []
    for seed in setting["seeds"]:
        if "routing" in studies:
            dp, pp = setting["routing_mesh"]
            for arm, (routing, domain, group) in ROUTING_ARMS.items():
                out.append(dict(base, study="routing", arm=arm, seed=seed, dp=dp, pp=pp, method="local",
                                tau=0, routing=routing, routing_domain=domain,
                                routing_group_size=setting[group] if group else None))  # fmt: skip
        if "overlap" in studies:
            dp, pp = setting["overlap_mesh"]
            for method in ("noloco", "diloco"):
                for tau in setting["taus"]:
                    out.append(dict(base, study="overlap", arm=f"{method} tau={tau}", seed=seed, dp=dp, pp=pp,
                                    method=method, tau=tau, routing="sample", routing_domain="global",
                                    routing_group_size=None))  # fmt: skip
    return out


def _mean(values):
    return sum(values) / len(values)


def summarize(runs: list[dict]) -> dict:
    summary = {"routing": {}, "overlap": {}}
    routing = [r for r in runs if r["study"] == "routing"]
    for arm in dict.fromkeys(r["arm"] for r in routing):
        per_seed = []
        for run in (r for r in routing if r["arm"] == arm):
            fixed = next(r for r in routing if r["arm"] == "fixed" and r["seed"] == run["seed"])
            keep = [i for i, v in enumerate(fixed["replica_divergence"]) if v > 0]
            steps = [fixed["log_steps"][i] for i in keep]
            std = [run["replica_divergence"][i] / fixed["replica_divergence"][i] for i in keep]
            half = [x for s, x in zip(steps, std) if s >= steps[-1] / 2]
            per_seed.append(
                dict(
                    seed=run["seed"],
                    final_perplexity=run["final_perplexity"],
                    final_replica_std=run["replica_divergence"][-1],
                    std_ratio_final=std[-1],
                    std_ratio_second_half=_mean(half),
                    perplexity_ratio_final=run["final_perplexity"] / fixed["final_perplexity"],
                )
            )
        summary["routing"][arm] = dict(
            per_seed=per_seed,
            **{k: _mean([p[k] for p in per_seed]) for k in per_seed[0] if k != "seed"},
        )
    overlap = [r for r in runs if r["study"] == "overlap"]
    for arm in dict.fromkeys(r["arm"] for r in overlap):
        per_seed = []
        for run in (r for r in overlap if r["arm"] == arm):
            base = next(
                r
                for r in overlap
                if r["method"] == run["method"] and r["tau"] == 0 and r["seed"] == run["seed"]
            )
            per_seed.append(
                dict(
                    seed=run["seed"],
                    final_perplexity=run["final_perplexity"],
                    perplexity_ratio_to_tau0=run["final_perplexity"] / base["final_perplexity"],
                    late_replica_divergence=_mean(run["replica_divergence"][-4:]),
                )
            )
        ratios = [p["perplexity_ratio_to_tau0"] for p in per_seed]
        summary["overlap"][arm] = dict(
            per_seed=per_seed,
            final_perplexity=_mean([p["final_perplexity"] for p in per_seed]),
            perplexity_ratio_to_tau0=_mean(ratios),
            perplexity_ratio_to_tau0_range=[min(ratios), max(ratios)],
            late_replica_divergence=_mean([p["late_replica_divergence"] for p in per_seed]),
        )
    return summary


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    colors = {"fixed": "black", "sample global": "tab:red", "sample node": "tab:blue"}
    for arm, color in colors.items():
        mine = [r for r in runs if r["study"] == "routing" and r["arm"] == arm]
        for i, run in enumerate(mine):
            axes[0].plot(run["log_steps"], run["replica_divergence"], color=color, alpha=0.7,
                         label=arm if i == 0 else None)  # fmt: skip
            axes[1].plot(run["steps"], run["eval_perplexity"], color=color, alpha=0.7,
                         label=arm if i == 0 else None)  # fmt: skip
    axes[0].set(
        title="routing, no outer sync (dp4 x pp2): replica std", xlabel="step", ylabel="RMS divergence"
    )
    axes[1].set(title="routing: validation perplexity", xlabel="step", ylabel="perplexity", yscale="log")
    styles = {0: "-", 1: "--", 5: ":"}
    for run in (r for r in runs if r["study"] == "overlap"):
        color = "tab:green" if run["method"] == "noloco" else "tab:purple"
        axes[2].plot(run["steps"], run["eval_perplexity"], styles.get(run["tau"], "-."), color=color,
                     alpha=0.7, label=run["arm"] if run["seed"] == runs[-1]["seed"] else None)  # fmt: skip
    axes[2].set(title="overlap tau (dp4): validation perplexity", xlabel="step", ylabel="perplexity",
                yscale="log")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--study", choices=["routing", "overlap", "both"], default="both")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--output", default=None)
    parser.add_argument("--replot", default=None)
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
        plot(result, os.path.splitext(args.replot)[0] + ".png")
        return 0
    mode = "quick" if args.quick else "full"
    setting = dict(SETTINGS[mode])
    if args.seeds:
        setting["seeds"] = [int(s) for s in args.seeds.split(",")]
    studies = ["routing", "overlap"] if args.study == "both" else [args.study]
    train, eval_, _ = common.load_corpus(
        common.BUILTIN,
        setting["block_size"],
        setting["vocab_size"],
        setting["eval_blocks"],
        setting["max_docs"],
    )
    started, runs = time.time(), []
    for spec in specs(setting, studies):
        record = train_run(spec, train, eval_)
        record.update({k: spec[k] for k in ("study", "arm", "seed", "method", "tau", "dp", "pp")})
        with open("/proc/loadavg") as f:
            record["load_after"] = float(f.read().split()[0])
        runs.append(record)
        print(f"{spec['study']:>8} {spec['arm']:<16} seed {spec['seed']}: final perplexity "
              f"{record['final_perplexity']:.2f} ({record['wall_s']:.0f} s)", flush=True)  # fmt: skip
        if not all(math.isfinite(v) for v in record["eval_perplexity"]):
            raise FloatingPointError(f"{spec['arm']}: non-finite perplexity")
    result = dict(
        mode=mode, setting=setting, machine=common.machine(), wall_s=time.time() - started,
        summary=summarize(runs), runs=runs,
    )  # fmt: skip
    for study, arms in result["summary"].items():
        for arm, row in arms.items():
            shown = {k: round(v, 4) for k, v in row.items() if isinstance(v, float)}
            print(f"{study:>8} {arm:<16} {shown}")
    output = args.output or (RESULTS if not args.quick else None)
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.splitext(output)[0] + ".png")
        print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
