"""Mixed-speed replicas: tokens/s of uniform against capacity-weighted routing, against the ideal.

pp 2 x dp 4 on local gloo processes (one thread each). Each rank runs in its own cgroup v1 `cpu` group and
sets its own CPU quota (`cpu.cfs_quota_us`) before each phase: the benchmark throttles, the package
never does.
Replica column r (both of its stages) runs at speed `--speeds[r]` (default 1, 1, 0.5, 0.25) times a base
quota of `--base-core` of a core. Phases, interleaved in every round:

- `equal`: every column at speed 1, uniform routing: each replica's rate at the base quota;
- `uniform`: the mixed speeds, uniform routing (every microbatch's rows split equally: the step waits for the
  slowest column);
- `capacity`: the mixed speeds, capacity routing: each rank's compute seconds per row, smoothed
  (`components/capacity_balance.py`, rebalanced every 2 steps during the phase's warm-up and after).

The ideal is the sum of each replica's rate at the base quota times its speed: `equal`'s tokens/s times
sum(speeds) / dp (2.75 / 4 for the default). Ratios are taken within a round; their median over rounds is
reported, with the machine's load average beside each round. The cgroups are removed at the end, also on
errors and Ctrl-C.

    python benchmarks/mixed_speed.py --rounds 2      # about 3 minutes on 2 quiet cores
    python benchmarks/mixed_speed.py --quick         # smoke: one short round
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CGROUP_ROOT = "/sys/fs/cgroup/cpu/hf_noloco_mixed_speed"
PERIOD_US = 10_000


def _cgroup(rank: int) -> str:
    return os.path.join(CGROUP_ROOT, f"rank{rank}")


def _set_quota(rank: int, cores: float) -> None:
    path = _cgroup(rank)
    with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
        f.write(str(PERIOD_US))
    with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
        f.write(str(max(1000, int(cores * PERIOD_US))))


def _worker(args: dict) -> dict:
    import torch
    import torch.distributed as dist

    from hf_noloco.components.capacity_balance import CapacityBalance
    from hf_noloco.engine.mesh import PipelineMesh
    from hf_noloco.engine.partition import split_model
    from hf_noloco.engine.pipeline import PipelineEngine
    from hf_noloco.engine.routing import Router
    from tests.helpers.tiny_models import make_batch, shard, tiny_model

    torch.set_num_threads(1)
    mesh = PipelineMesh.build(2)
    with open(os.path.join(_cgroup(mesh.rank), "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    dp = mesh.num_replicas
    model = tiny_model("llama", args["layers"], seed=0, hidden=args["hidden"])
    stage = split_model(model, mesh.stage, 2, None)
    optimizer = torch.optim.SGD(stage.parameters(), lr=1e-3)
    rows, seq = args["rows"], args["seq"]
    batch = shard(make_batch(rows * dp, seq, seed=1, padded=False), mesh.replica, dp)
    records = []
    for round_index in range(args["rounds"]):
        for phase in ("equal", "uniform", "capacity"):
            speed = 1.0 if phase == "equal" else args["speeds"][mesh.replica]
            _set_quota(mesh.rank, args["base_core"] * speed)
            engine = PipelineEngine(stage, mesh, Router(dp, "sample", seed=round_index), args["micro"], 300)
            balance = CapacityBalance(mesh, engine, 2, args["floor"], 300) if phase == "capacity" else None
            dist.barrier()
            start = None
            for step in range(1, args["warmup"] + args["steps"] + 1):
                if step == args["warmup"] + 1:
                    dist.barrier()
                    start = time.perf_counter()
                engine.train_step(batch)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if balance is not None:
                    balance.after_step(step)
            dist.barrier()
            seconds = time.perf_counter() - start
            records.append(
                dict(
                    round=round_index,
                    phase=phase,
                    seconds=seconds,
                    tokens_per_s=rows * dp * seq * args["steps"] / seconds,
                    load=os.getloadavg()[0],
                    shares=None if balance is None else balance.shares,
                )
            )
    _set_quota(mesh.rank, 1.0)
    return dict(rank=mesh.rank, records=records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--speeds", type=float, nargs=4, default=[1.0, 1.0, 0.5, 0.25])
    parser.add_argument("--base-core", type=float, default=0.24, help="a speed-1 rank's CPU quota, in cores")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16, help="rows per replica per step")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--floor", type=float, default=0.05)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "mixed_speed.json"))
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.hidden, args.seq = 1, 3, 4, 32, 16
    if not os.access(os.path.dirname(CGROUP_ROOT), os.W_OK):
        print(
            f"mixed_speed: no writable cgroup v1 cpu controller at {os.path.dirname(CGROUP_ROOT)}; "
            "nothing measured"
        )
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from hf_noloco.launch.local_launch import run_distributed

    os.makedirs(CGROUP_ROOT, exist_ok=True)
    for rank in range(8):
        os.makedirs(_cgroup(rank), exist_ok=True)
    try:
        spec = {k: v for k, v in vars(args).items() if k not in ("quick", "output")}
        results = run_distributed(_worker, 8, spec, timeout_s=3600)
    finally:
        _remove_cgroups()
    records = results[0]["records"]
    rounds = []
    for r in range(args.rounds):
        phase = {rec["phase"]: rec for rec in records if rec["round"] == r}
        ideal = phase["equal"]["tokens_per_s"] * sum(args.speeds) / 4
        rounds.append(
            dict(
                round=r,
                equal=phase["equal"]["tokens_per_s"],
                ideal=ideal,
                uniform=phase["uniform"]["tokens_per_s"],
                capacity=phase["capacity"]["tokens_per_s"],
                uniform_of_ideal=phase["uniform"]["tokens_per_s"] / ideal,
                capacity_of_ideal=phase["capacity"]["tokens_per_s"] / ideal,
                capacity_over_uniform=phase["capacity"]["tokens_per_s"] / phase["uniform"]["tokens_per_s"],
                load=[phase[p]["load"] for p in ("equal", "uniform", "capacity")],
                shares=phase["capacity"]["shares"],
            )
        )
    summary = {
        key: statistics.median(r[key] for r in rounds)
        for key in ("uniform_of_ideal", "capacity_of_ideal", "capacity_over_uniform")
    }
    from benchmarks._common import machine

    out = dict(config=spec, machine=machine(), rounds=rounds, median=summary)
    for r in rounds:
        print(
            f"round {r['round']}: equal {r['equal']:.0f} tok/s, ideal {r['ideal']:.0f}, "
            f"uniform {r['uniform']:.0f} ({r['uniform_of_ideal']:.3f} of ideal), "
            f"capacity {r['capacity']:.0f} ({r['capacity_of_ideal']:.3f}), "
            f"load {', '.join(f'{x:.1f}' for x in r['load'])}"
        )
    print("median over rounds:", json.dumps({k: round(v, 3) for k, v in summary.items()}))
    if not args.quick:
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
        print("saved", args.output)


def _remove_cgroups() -> None:
    """Moves any task left back to the root group and deletes the groups (rmdir: a cgroup is a directory)."""
    root = os.path.dirname(CGROUP_ROOT)
    for rank in range(8):
        path = _cgroup(rank)
        if not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = f.read().split()
            for pid in pids:
                with open(os.path.join(root, "cgroup.procs"), "w") as f:
                    f.write(pid)
        except OSError:
            pass
        os.rmdir(path)
    if os.path.isdir(CGROUP_ROOT):
        os.rmdir(CGROUP_ROOT)


if __name__ == "__main__":
    main()
