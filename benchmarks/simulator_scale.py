"""NoLoCo's pair gossip against DiLoCo's all-reduce from 8 to 1,024 replicas of an 8-stage 8B model, on the
simulator (`hf_noloco/estimate/simulator.py`): step time and the time blocked per outer step. Pure: no
processes, no network; 12 minutes on one core (most of it the 1,024-replica rings; --quick: 30 s).

The model (every number a stated assumption, none measured here):

- **Model and mesh**: Llama-3-8B (`estimate/traffic.py`'s LLAMA_3_8B), 8 pipeline stages split by layers as
  training splits it (4 layers each; the output head on the last stage), one replica column per node (8 GPUs),
  so the pipeline's messages stay inside the node (NVLink-class: 100 GB/s, 5 us) and only the outer exchange
  crosses the network. 8 samples of 4096 tokens per replica and step, microbatches of one sample, 1F1B.
- **Compute**: FLOPs per token from `estimate/flops.py` (6 N + attention), the head's 6 d V on the last stage
  and the rest evenly over the layers; forward a third, backward two thirds; at 40% of an H100's dense bf16
  peak (989 TFLOP/s) per GPU. Every replica's step time carries a seeded log-normal straggler factor of mean 1
  and sigma 0.05, drawn per replica and step.
- **Network**: each node has one uplink of the given rate (shared by its 8 stages, FIFO) and a latency with a
  log-normal jitter (mean the given latency, sigma 0.5) per message. The 8 stages of a node exchange at the
  same moment over the same uplink, so a node's outer exchange is simulated as one message of the 8 stages'
  summed bytes per peer (what the shared FIFO uplink would deliver last).
- **Outer step**: H = 50 for both methods (the paper's NoLoCo default; DiLoCo's default of 100 halves its
  per-step share, not its blocked time). NoLoCo sends each replica's stage to one gossip partner
  (`outer/gossip.py`'s pairs, gamma = beta: one copy) in float32, bfloat16, int8 or int4
  (`outer/compression.py`'s packet bytes, scales included). DiLoCo all-reduces over a ring (as gloo does) or
  a pipelined binary tree (8 segments; one tree, not NCCL's two, not what gloo runs) in float32 or bfloat16;
  with int8/int4 the package all-gathers packets (`outer/diloco.py`: each rank sends n - 1 packets on), and a
  compressed ring all-reduce (a reduce-scatter that re-quantizes partial sums) is shown as a hypothetical the
  package does not have. The outer update's own compute is left out (the same for both methods).
- **Blocking vs overlapped**: tau = 0 (the exchange blocks) and tau = H (it runs during the next H inner
  steps; two periods are simulated and the first outer step's wait reported: the second is the run's last,
  applied at its end).

    python benchmarks/simulator_scale.py            # benchmarks/results/simulator_scale.json and .png
    python benchmarks/simulator_scale.py --quick    # 8 and 64 replicas only (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

from hf_noloco.engine.schedule import BACKWARD, FORWARD
from hf_noloco.estimate.flops import PEAK_BF16_TFLOPS, training_flops_per_token
from hf_noloco.estimate.simulator import Network, simulate_outer_periods, simulate_step
from hf_noloco.estimate.traffic import LLAMA_3_8B, record_bytes_per_row, stage_parameter_counts
from hf_noloco.outer.compression import wire_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "simulator_scale.json")

STAGES, SEQ_LEN, ROWS, MICRO = 8, 4096, 8, 1
INNER_STEPS = 50
MFU, GPU = 0.4, "H100"
INTRA_BANDWIDTH, INTRA_LATENCY = 100e9, 5e-6
LATENCY_JITTER, STRAGGLER = 0.5, 0.05
NETWORKS = {  # name: (bits/s, mean latency s)
    "10 Gbit/s, 1 ms": (10e9, 1e-3),
    "1 Gbit/s, 20 ms": (1e9, 20e-3),
    "100 Mbit/s, 100 ms": (100e6, 100e-3),
}
REPLICAS = [8, 16, 32, 64, 128, 256, 512, 1024]
# (label, method, outer dtype, collective); "ring-compressed" is a hypothetical (see the docstring)
ARMS = [
    ("NoLoCo float32", "noloco", "float32", None),
    ("NoLoCo bfloat16", "noloco", "bfloat16", None),
    ("NoLoCo int8", "noloco", "int8", None),
    ("NoLoCo int4", "noloco", "int4", None),
    ("DiLoCo ring float32", "diloco", "float32", "ring"),
    ("DiLoCo ring bfloat16", "diloco", "bfloat16", "ring"),
    ("DiLoCo tree float32", "diloco", "float32", "tree"),
    ("DiLoCo tree bfloat16", "diloco", "bfloat16", "tree"),
    ("DiLoCo int8 (all-gather, as implemented)", "diloco", "int8", "gather"),
    ("DiLoCo int4 (all-gather, as implemented)", "diloco", "int4", "gather"),
    ("DiLoCo ring int8 (hypothetical)", "diloco", "int8", "ring"),
    ("DiLoCo ring int4 (hypothetical)", "diloco", "int4", "ring"),
]


def stage_times() -> tuple[list[float], list[float]]:
    """Per stage, forward and backward seconds of one microbatch (see the docstring)."""
    config = SimpleNamespace(**{k: v for k, v in LLAMA_3_8B.items() if k != "model_type"})
    per_token = training_flops_per_token(config, SEQ_LEN)
    head = 6.0 * config.hidden_size * config.vocab_size
    per_layer = (per_token - head) / config.num_hidden_layers
    layers = config.num_hidden_layers // STAGES
    flops = [layers * per_layer + (head if s == STAGES - 1 else 0.0) for s in range(STAGES)]
    rate = PEAK_BF16_TFLOPS[GPU] * 1e12 * MFU
    total = [f * SEQ_LEN * MICRO / rate for f in flops]
    return [t / 3 for t in total], [2 * t / 3 for t in total]


def inner_step_seconds() -> float:
    forward, backward = stage_times()
    row = SEQ_LEN * LLAMA_3_8B["hidden_size"] * 2  # bfloat16 activations and their gradients
    sizes = {FORWARD: row + record_bytes_per_row(SEQ_LEN), BACKWARD: row}
    network = Network(INTRA_BANDWIDTH, INTRA_LATENCY)
    plan = simulate_step("1f1b", STAGES, ROWS // MICRO, forward, backward, network, sizes, micro=MICRO)
    return plan.step_time


def node_bytes(params: list[int], dtype: str) -> float:
    """One replica's 8 stages on the wire: one copy (NoLoCo), the all-reduced buffer, or one packet."""
    return float(sum(wire_bytes(p, dtype) for p in params))


def run(replicas: list[int], seed: int = 0) -> dict:
    params = stage_parameter_counts(LLAMA_3_8B, STAGES)
    step = inner_step_seconds()
    rows = []
    for net_name, (bits, latency) in NETWORKS.items():
        for n in replicas:
            for label, method, dtype, collective in ARMS:
                row = dict(network=net_name, replicas=n, arm=label, method=method, outer_dtype=dtype)
                row["collective"] = collective or "pairs"
                row["bytes_per_node_message"] = node_bytes(params, dtype)
                for tau, periods in ((0, 1), (INNER_STEPS, 2)):
                    network = Network(bits / 8, latency, LATENCY_JITTER, seed=seed, procs_per_node=1)
                    started = time.perf_counter()
                    result = simulate_outer_periods(
                        method,
                        n,
                        1,
                        step,
                        [row["bytes_per_node_message"]],
                        network,
                        INNER_STEPS,
                        overlap_steps=tau,
                        periods=periods,
                        seed=seed,
                        collective=collective or "ring",
                        straggler=STRAGGLER,
                    )
                    key = "blocking" if tau == 0 else "overlap_H"
                    row[key] = dict(
                        blocked_mean=result.blocked[0],
                        blocked_max=result.blocked_max[0],
                        exchange=result.exchange[0],
                        step_time=(INNER_STEPS * step + result.blocked_max[0]) / INNER_STEPS
                        if tau
                        else result.step_time,
                        node_bytes_sent=max(result.bytes_per_uplink.values()) / periods,
                        simulated_s=time.perf_counter() - started,
                    )
                rows.append(row)
                b = row["blocking"]
                print(
                    f"{net_name:<19} n={n:<5} {label:<42} blocked {b['blocked_mean']:10.1f} s "
                    f"(tau=H: {row['overlap_H']['blocked_mean']:9.1f} s)  step {b['step_time']:7.2f} s",
                    flush=True,
                )
    return dict(inner_step_seconds=step, stage_params=params, rows=rows)


def goal(result: dict) -> list[dict]:
    """NoLoCo's blocked time over DiLoCo's at the largest replica count, per network and wire pairing."""
    rows = {(r["network"], r["replicas"], r["arm"]): r for r in result["rows"]}
    n = max(r["replicas"] for r in result["rows"])
    pairs = [
        ("NoLoCo float32", "DiLoCo ring float32"),
        ("NoLoCo float32", "DiLoCo tree float32"),
        ("NoLoCo bfloat16", "DiLoCo ring bfloat16"),
        ("NoLoCo bfloat16", "DiLoCo tree bfloat16"),
        ("NoLoCo int8", "DiLoCo int8 (all-gather, as implemented)"),
        ("NoLoCo int8", "DiLoCo ring int8 (hypothetical)"),
        ("NoLoCo int4", "DiLoCo int4 (all-gather, as implemented)"),
        ("NoLoCo int4", "DiLoCo ring int4 (hypothetical)"),
        ("NoLoCo int4", "DiLoCo tree bfloat16"),
    ]
    out = []
    for net in NETWORKS:
        for a, b in pairs + [("NoLoCo int4", "best DiLoCo"), ("NoLoCo float32", "best DiLoCo float32")]:
            for mode in ("blocking", "overlap_H"):
                x = rows[net, n, a][mode]["blocked_mean"]
                if b.startswith("best DiLoCo"):  # the least blocked DiLoCo arm (of that wire, or of any)
                    arms = [arm for arm, method, dtype, _ in ARMS if method == "diloco"]
                    if b != "best DiLoCo":
                        arms = [arm for arm in arms if "float32" in arm]
                    best = min(arms, key=lambda arm: rows[net, n, arm][mode]["blocked_mean"])
                    y, label = rows[net, n, best][mode]["blocked_mean"], f"{b} ({best})"
                else:
                    y, label = rows[net, n, b][mode]["blocked_mean"], b
                ratio = x / y if y > 0 else (0.0 if x == 0 else None)
                out.append(dict(network=net, replicas=n, noloco=a, diloco=label, mode=mode, noloco_blocked=x,
                                diloco_blocked=y, ratio=ratio))  # fmt: skip
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [
        ("NoLoCo float32", "C0", "-"),
        ("NoLoCo int4", "C0", "--"),
        ("DiLoCo ring float32", "C3", "-"),
        ("DiLoCo tree float32", "C1", "-"),
        ("DiLoCo ring int4 (hypothetical)", "C3", ":"),
        ("DiLoCo int4 (all-gather, as implemented)", "C3", "--"),
    ]
    fig, axes = plt.subplots(1, len(NETWORKS), figsize=(15, 4.8), sharey=False)
    for ax, net in zip(axes, NETWORKS):
        for arm, color, style in shown:
            points = sorted(
                (r["replicas"], r["blocking"]["blocked_mean"])
                for r in result["rows"]
                if r["network"] == net and r["arm"] == arm
            )
            if points:
                ax.plot(*zip(*points), style, color=color, marker="o", markersize=3, label=arm)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(net)
        ax.set_xlabel("replicas (nodes of 8 GPUs)")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("time blocked per outer step, blocking (s)")
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"Llama-3-8B, 8 stages per node, H = {INNER_STEPS}, inner step "
        f"{result['inner_step_seconds']:.2f} s (simulated)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


TABLE_ARMS = [
    "NoLoCo float32",
    "NoLoCo int4",
    "DiLoCo ring float32",
    "DiLoCo tree float32",
    "DiLoCo int4 (all-gather, as implemented)",
    "DiLoCo ring int4 (hypothetical)",
]


def table(result: dict, mode: str = "blocking", replicas=(8, 64, 1024)) -> str:
    """Markdown: seconds blocked per outer step (mean over replicas) per network, arm and replica count."""
    rows = {(r["network"], r["replicas"], r["arm"]): r for r in result["rows"]}
    head = "| network | arm | " + " | ".join(f"n = {n}" for n in replicas) + " | step at n = 1024 |"
    lines = [head, "|---|---|" + "---:|" * (len(replicas) + 1)]
    for net in NETWORKS:
        for arm in TABLE_ARMS:
            cells = [
                f"{rows[net, n, arm][mode]['blocked_mean']:,.1f}" for n in replicas if (net, n, arm) in rows
            ]
            last = rows.get((net, max(replicas), arm))
            step = f"{last[mode]['step_time']:,.2f}" if last else ""
            lines.append(f"| {net} | {arm} | " + " | ".join(cells) + f" | {step} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 and 64 replicas, not saved")
    parser.add_argument("--output", default=RESULTS)
    parser.add_argument("--replot", default=None, help="tables and plot of a result JSON, nothing simulated")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
        for mode in ("blocking", "overlap_H"):
            print(f"\n{mode}: seconds blocked per outer step\n\n{table(result, mode)}")
        plot(result, os.path.splitext(args.replot)[0] + ".png")
        return 0
    started = time.time()
    replicas = [8, 64] if args.quick else REPLICAS
    result = run(replicas)
    result["goal"] = goal(result)
    result["assumptions"] = dict(
        model="Llama-3-8B", stages=STAGES, seq_len=SEQ_LEN, rows=ROWS, microbatch=MICRO,
        inner_steps=INNER_STEPS, gpu=GPU, mfu=MFU, intra_bandwidth=INTRA_BANDWIDTH,
        intra_latency=INTRA_LATENCY,
        latency_jitter_sigma=LATENCY_JITTER, straggler_sigma=STRAGGLER, networks=NETWORKS,
    )  # fmt: skip
    result["wall_s"] = time.time() - started
    for g in result["goal"]:
        ratio = "n/a" if g["ratio"] is None else f"{g['ratio']:.3f}"
        print(f"{g['network']:<19} {g['mode']:<9} {g['noloco']:<16} / {g['diloco']:<42} {ratio}")
    if not args.quick:
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.splitext(args.output)[0] + ".png")
        print(f"wrote {args.output} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
