"""Cost of one outer step: NoLoCo (fp32, bf16) against DiLoCo, measured on local gloo processes, plus the
paper's §5.3 latency model (tree all-reduce vs pair averaging) out to N = 1024 replicas.

    python benchmarks/outer_sync.py            # full: dp 2, 4, 8; a 16M-parameter stage
    python benchmarks/outer_sync.py --quick    # seconds: dp 2, 4; a 1M-parameter stage

Writes benchmarks/results/outer_sync.json and outer_sync.png. Measured times are on this machine's CPUs with
every replica a process on the same host (loopback TCP, cores shared by all replicas): they compare the
methods with each other, not with a real network. The bytes are exact for NoLoCo; for DiLoCo they are the
ring all-reduce's 2 (N-1)/N copies per replica (gloo does not report its traffic).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.launch.local_launch import run_distributed
from hf_noloco.outer.optimizer import OuterOptimizer
from hf_noloco.outer.settings import OuterSettings

METHODS = [  # label, method, outer_dtype
    ("noloco fp32", "noloco", "float32"),
    ("noloco bf16", "noloco", "bfloat16"),
    ("diloco fp32", "diloco", "float32"),
]


def _measure(numel: int, repeats: int) -> dict:
    """Runs on every rank: times ``repeats`` outer steps of each method on a ``numel``-parameter stage."""
    mesh = PipelineMesh.build(1)
    torch.manual_seed(mesh.replica)  # different weights on every replica
    # A stage shaped like a few transformer matrices (8 tensors), not one flat vector.
    params = [torch.nn.Parameter(torch.randn(numel // 8)) for _ in range(8)]
    out = {}
    for label, method, dtype in METHODS:
        opt = OuterOptimizer(
            torch.optim.SGD(params, lr=0.0),
            params,
            mesh,
            OuterSettings(method, inner_steps=1, outer_dtype=dtype, routing_seed=0),
        )
        opt.outer_step()  # warm-up: connections, allocations
        sent0, received0 = opt.bytes_sent, opt.bytes_received
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            opt.outer_step()
            times.append(time.perf_counter() - start)
        out[label] = {
            "times": times,
            "bytes_sent": (opt.bytes_sent - sent0) / repeats,
            "bytes_received": (opt.bytes_received - received0) / repeats,
        }
    return out


def measure(dps: list[int], numel: int, repeats: int) -> list[dict]:
    rows = []
    for dp in dps:
        per_rank = run_distributed(_measure, dp, numel, repeats, timeout_s=600)
        for label, _, _ in METHODS:
            # The step of the system is the slowest replica's; take the median over repeats of that.
            slowest = [max(r[label]["times"][k] for r in per_rank) for k in range(repeats)]
            rows.append(
                {
                    "dp": dp,
                    "method": label,
                    "params": numel,
                    "bytes_sent_per_replica": statistics.mean(r[label]["bytes_sent"] for r in per_rank),
                    "bytes_received_per_replica": statistics.mean(
                        r[label]["bytes_received"] for r in per_rank
                    ),
                    "stage_fp32_bytes": numel * 4,
                    "wall_s_median": statistics.median(slowest),
                    "wall_s_min": min(slowest),
                }
            )
    return rows


def latency_model(max_log2: int = 10, sigmas: tuple[float, ...] = (0.5, 1.0), samples: int = 2000) -> dict:
    """§5.3 in units of the mean message latency t_c.

    Deterministic: a tree all-reduce (reduce up a binary tree, broadcast down) takes 2 log2(N) message times,
    pair averaging 2 (one message each way, as in the paper). Log-normal: each message's latency is drawn from
    a log-normal of mean t_c; a tree level waits for its slowest message, so the all-reduce pays the expected
    maximum of N/2, N/4, ... draws at each level, twice. A NoLoCo replica only waits for its own partner
    (2 draws); we also give the slowest of the N/2 pairs, the cost if something waited for every pair.
    """
    gen = torch.Generator().manual_seed(0)
    ns = [2**k for k in range(1, max_log2 + 1)]
    result = {"N": ns, "tree_allreduce": [2 * math.log2(n) for n in ns], "pair_averaging": [2.0 for _ in ns]}
    for sigma in sigmas:
        mu = -(sigma**2) / 2  # mean exp(mu + sigma^2/2) = 1 = t_c

        def draw(*shape, mu=mu, sigma=sigma):
            return torch.exp(mu + sigma * torch.randn(*shape, generator=gen, dtype=torch.float64))

        tree, pair_own, pair_slowest = [], [], []
        for n in ns:
            total = torch.zeros(samples, dtype=torch.float64)
            for level in range(1, int(math.log2(n)) + 1):
                messages = n // 2**level
                for _ in range(2):  # reduce, then broadcast
                    total += draw(samples, messages).max(dim=1).values
            tree.append(total.mean().item())
            rounds = draw(samples, 2, n // 2)  # two messages per pair, N/2 pairs
            pair_own.append(rounds[:, :, 0].sum(1).mean().item())
            pair_slowest.append(rounds.sum(1).max(dim=1).values.mean().item())
        result[f"tree_allreduce_lognormal_sigma{sigma}"] = tree
        result[f"pair_averaging_lognormal_sigma{sigma}"] = pair_own
        result[f"pair_averaging_slowest_pair_lognormal_sigma{sigma}"] = pair_slowest
    return result


def plot(rows: list[dict], model: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    dps = sorted({r["dp"] for r in rows})
    width = 0.8 / len(METHODS)
    for k, (label, _, _) in enumerate(METHODS):
        sel = [next(r for r in rows if r["dp"] == dp and r["method"] == label) for dp in dps]
        xs = [i + (k - 1) * width for i in range(len(dps))]
        ax1.bar(xs, [r["bytes_sent_per_replica"] / r["stage_fp32_bytes"] for r in sel], width, label=label)
        ax2.bar(xs, [1e3 * r["wall_s_median"] for r in sel], width, label=label)
    for ax, ylabel, title in [
        (ax1, "bytes sent per replica / fp32 stage size", "Traffic per outer step"),
        (
            ax2,
            "ms (median, slowest replica)",
            f"Wall time per outer step ({rows[0]['params'] / 1e6:.1f}M params, gloo)",
        ),
    ]:
        ax.set_xticks(range(len(dps)), [f"dp={d}" for d in dps])
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    ns = model["N"]
    ax3.plot(ns, model["tree_allreduce"], "k-", label="tree all-reduce, 2 t_c log2 N")
    ax3.plot(ns, model["pair_averaging"], "k--", label="pair averaging, 2 t_c")
    for sigma, color in zip((0.5, 1.0), ("tab:blue", "tab:red")):
        ax3.plot(
            ns,
            model[f"tree_allreduce_lognormal_sigma{sigma}"],
            "-",
            color=color,
            label=f"tree, log-normal σ={sigma}",
        )
        ax3.plot(
            ns,
            model[f"pair_averaging_lognormal_sigma{sigma}"],
            "--",
            color=color,
            label=f"pair, log-normal σ={sigma}",
        )
        ax3.plot(
            ns,
            model[f"pair_averaging_slowest_pair_lognormal_sigma{sigma}"],
            ":",
            color=color,
            label=f"slowest pair, σ={sigma}",
        )
    ax3.set_xscale("log", base=2)
    ax3.set_xlabel("replicas N")
    ax3.set_ylabel("latency of one sync / t_c")
    ax3.set_title("§5.3 latency model")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: finishes in seconds")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    dps, numel, repeats = ([2, 4], 1 << 20, 3) if args.quick else ([2, 4, 8], 1 << 24, 5)

    rows = measure(dps, numel, repeats)
    model = latency_model(samples=200 if args.quick else 2000)

    print(
        f"\nOuter step, {numel / 1e6:.1f}M-parameter stage ({numel * 4 / 2**20:.0f} MiB fp32), gloo, "
        f"{os.cpu_count()} CPU cores shared by all replicas"
    )
    print(
        f"{'dp':>3} {'method':<12} {'sent MiB':>9} {'recv MiB':>9} {'x fp32 copy':>11} "
        f"{'median ms':>10} {'min ms':>8}"
    )
    for r in rows:
        print(
            f"{r['dp']:>3} {r['method']:<12} {r['bytes_sent_per_replica'] / 2**20:>9.2f} "
            f"{r['bytes_received_per_replica'] / 2**20:>9.2f} "
            f"{r['bytes_sent_per_replica'] / r['stage_fp32_bytes']:>11.3f} "
            f"{1e3 * r['wall_s_median']:>10.1f} {1e3 * r['wall_s_min']:>8.1f}"
        )
    print("\n§5.3 latency model (units of t_c)")
    keys = [
        "tree_allreduce",
        "pair_averaging",
        "tree_allreduce_lognormal_sigma1.0",
        "pair_averaging_lognormal_sigma1.0",
        "pair_averaging_slowest_pair_lognormal_sigma1.0",
    ]
    print(f"{'N':>5} " + " ".join(f"{k.replace('_lognormal_sigma1.0', ' LN1'):>24}" for k in keys))
    for i, n in enumerate(model["N"]):
        print(f"{n:>5} " + " ".join(f"{model[k][i]:>24.2f}" for k in keys))

    os.makedirs(args.out, exist_ok=True)
    name = "outer_sync_quick" if args.quick else "outer_sync"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(
            {
                "benchmark": "outer_sync",
                "quick": args.quick,
                "params": numel,
                "repeats": repeats,
                "machine": {
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    "torch": torch.__version__,
                },
                "measured": rows,
                "latency_model": model,
            },
            f,
            indent=1,
        )
    plot(rows, model, os.path.join(args.out, f"{name}.png"))
    print(f"\nwrote {args.out}/{name}.json and .png")


if __name__ == "__main__":
    main()
