"""The simulator (`hf_noloco/estimate/simulator.py`) against real gloo runs across emulated nodes: predicted
vs measured step time and bytes per node uplink.

Linux, as root. One network namespace per node, each joined to a bridge (in a hub namespace of its own) by a
veth pair; each node's egress is rate-limited with `tc tbf` (the helpers of `benchmarks/slow_link.py`). A node
holds one replica column (pp ranks, `routing_domain: node`, so the pipeline's messages stay on the node's
loopback and only the outer exchange crosses its uplink). Meshes dp2 x pp2, dp4 x pp2 and dp8 x pp2 (4, 8 and
16 processes on this machine's cores, one thread each); per mesh NoLoCo and DiLoCo, blocking (tau = 0) and
overlapped (tau = H/2), at two link rates: 8 configurations per mesh. A window runs H inner steps from just
after one outer step was applied to just after the next one was (its exchange inside the window).

What the simulator is given, from the same run (a benchmark-only trace: `torch.autograd.backward` timed in the
worker process, the engine's own `wait_seconds`; nothing in the package changes):

- per stage, a microbatch's backward (the timed autograd call) and forward (the step's time in `train_step`
  less its waits and its backwards, over the microbatches), means over the stage's replicas: *wall* time per
  compute under this machine's load, with 4-16 processes time-sharing its cores (so a compute already carries
  the slowdown of the others running beside it; with 16 processes on 2 cores that is most of it);
- per replica, its compute against the mean (a slow factor: DiLoCo waits for the slowest);
- per step, the time outside `train_step` (optimizer, zero_grad, the batch), the slowest stage's mean;
- the outer step's own compute (encode, update, decode): measured at the unlimited link for the same method
  and tau (calibration windows, not among the compared ones), the least over ranks (see `_outer_compute`);
- the latency of a message inside a node (gloo over loopback under this load: a few ms with 4-16 processes
  on 2 cores), fitted so that the simulated inner step matches the calibration windows' (`fit_hop_latency`).

It predicts the window's time (``simulate_outer_periods``: the engine's 1F1B plan per step, the gossip pairs
or the gloo ring over shared node uplinks at the tbf rate) and each node's uplink bytes, compared with the
window's wall time and the veth's tx_bytes (headers included). Addresses (a private /24) exist only inside
the namespaces made here; all are deleted at the end, on errors and on Ctrl-C.

    sudo flock /tmp/hf_noloco_bench.lock python benchmarks/simulator_validation.py --rounds 3  # 5.6 min
    python benchmarks/simulator_validation.py --replot benchmarks/results/simulator_validation.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from slow_link import (
    MTU,
    _run,
    _stop,
    _tail,
    cpu_seconds,
    link_counters,
    load_average,
    namespace_problem,
    set_link_rate,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "simulator_validation.json")
SUBNET = "10.213.9"  # a private /24, only inside the namespaces made here
PREFIX = "hfsv"
HEADER_BYTES = 66  # per frame: Ethernet 14, IPv4 20, TCP 20 with the 12-byte timestamp option

SETTING = dict(
    model=dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
    rows=4,
    seq_len=32,
    microbatch_size=1,
    inner_steps=16,
    overlap_steps=8,
    rounds=2,
    mbits=[10, 40],  # link rates (Mbit/s per node uplink)
    queue="100ms",  # tbf's queue (its latency bound), as slow_link.py's
)
MESHES = [(2, 2), (4, 2), (8, 2)]  # (dp, pp)


def configurations(setting: dict) -> list[dict]:
    runs = []
    for method in ("noloco", "diloco"):
        for tau in (0, setting["overlap_steps"]):
            runs.append(dict(name=f"{method} tau={tau}", method=method, tau=tau))
    return runs


# ------------------------------------------------------------------------------------- namespaces


class Nodes(contextlib.AbstractContextManager):
    """``n`` node namespaces joined to a bridge in a hub namespace; deleted on exit, whatever happened."""

    def __init__(self, n: int):
        tag = str(os.getpid() % 100000)
        self.hub = f"{PREFIX}{tag}h"
        self.namespaces = [f"{PREFIX}{tag}n{k}" for k in range(n)]
        self.devices = [f"{PREFIX}{tag}v{k}" for k in range(n)]
        self.addresses = [f"{SUBNET}.{k + 1}" for k in range(n)]
        self.made: list[str] = []

    def __enter__(self):
        try:
            _run("ip", "netns", "add", self.hub)
            self.made.append(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "mtu", str(MTU))
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for ns, dev, address in zip(self.namespaces, self.devices, self.addresses):
                _run("ip", "netns", "add", ns)
                self.made.append(ns)
                peer = f"{dev}p"
                _run("ip", "link", "add", dev, "type", "veth", "peer", "name", peer)
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "link", "set", peer, "netns", self.hub)
                _run("ip", "-n", self.hub, "link", "set", peer, "mtu", str(MTU))
                _run("ip", "-n", self.hub, "link", "set", peer, "master", "br0")
                _run("ip", "-n", self.hub, "link", "set", peer, "up")
                _run("ip", "-n", ns, "link", "set", dev, "mtu", str(MTU))
                _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for ns in reversed(
            self.made
        ):  # a namespace's deletion deletes its veth ends, and with them the pairs
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []
        return False


def _remove_stale_namespaces() -> None:
    """Namespaces of an earlier run of this script that was killed (SIGKILL skips every clean-up)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        if name.startswith(PREFIX):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


# ------------------------------------------------------------------------------------------ worker


def _worker(plan_path: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from hf_noloco.engine.loading import build_stage
    from hf_noloco.engine.mesh import PipelineMesh
    from hf_noloco.engine.pipeline import PipelineEngine
    from hf_noloco.engine.routing import Router
    from hf_noloco.outer.optimizer import OuterOptimizer
    from hf_noloco.outer.settings import OuterSettings

    with open(plan_path) as f:
        plan = json.load(f)
    setting, pp = plan["setting"], plan["pp"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = PipelineMesh.build(pp)
    local_rank = int(os.environ["LOCAL_RANK"])
    device = os.environ["GLOO_SOCKET_IFNAME"]
    values = dict(setting["model"])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config._attn_implementation = "sdpa"
    stage = build_stage(config, mesh.stage, pp, seed=0)
    params = list(stage.parameters())
    inner = torch.optim.AdamW(params, lr=1e-5)

    # The trace (this process only): every autograd backward of a step, timed.
    backward_seconds = [0.0]
    original_backward = torch.autograd.backward

    def timed_backward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original_backward(*args, **kwargs)
        finally:
            backward_seconds[0] += time.perf_counter() - start

    torch.autograd.backward = timed_backward

    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(step * 1000 + mesh.replica)
        shape = (setting["rows"], setting["seq_len"])
        return {"input_ids": torch.randint(0, config.vocab_size, shape, generator=g)}

    runs, h = plan["runs"], setting["inner_steps"]
    engines, optimizers, counts = {}, {}, {}
    for run in runs:
        router = Router(mesh.num_replicas, "sample", seed=0, group_size=1)  # routing_domain: node
        engines[run["name"]] = PipelineEngine(stage, mesh, router, setting["microbatch_size"])
        outer = OuterSettings(run["method"], h, outer_overlap_steps=run["tau"], routing_seed=0)
        optimizers[run["name"]] = OuterOptimizer(inner, params, mesh, outer)
        counts[run["name"]] = 0

    def train(name: str, steps: int, trace: list | None = None) -> None:
        engine, opt = engines[name], optimizers[name]
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            data = batch(counts[name])
            backward_seconds[0] = 0.0
            t1 = time.perf_counter()
            engine.train_step(data)
            t2 = time.perf_counter()
            outer_before = opt.outer_step_count
            opt.reduce_gradients()
            opt.step()
            t3 = time.perf_counter()
            counts[name] += 1
            if trace is not None:
                trace.append(
                    dict(
                        train_step=t2 - t1,
                        wait=engine.wait_seconds,
                        backward=backward_seconds[0],
                        other=(t1 - t0) + (t3 - t2),
                        optimizer=t3 - t2,
                        started_outer=opt.outer_step_count != outer_before,
                        step=counts[name],
                    )
                )

    def warm_up(run: dict) -> None:
        """To the first window's start: just after the first outer step was applied."""
        if counts[run["name"]] == 0:
            train(run["name"], h + run["tau"])

    def set_rate(bits: float | None) -> None:
        if local_rank == 0:
            set_link_rate(device, bits, setting.get("queue", "100ms"))
        dist.barrier()

    def window(run: dict, rate_key: str) -> dict:
        warm_up(run)
        outer_step = optimizers[run["name"]].outer_step_count
        dist.barrier()
        before = link_counters(device) if local_rank == 0 else None
        dist.barrier()
        cpu_before = cpu_seconds() if local_rank == 0 else None
        load, start, trace = load_average(), time.perf_counter(), []
        train(run["name"], h, trace)
        dist.barrier()
        seconds = time.perf_counter() - start
        after = link_counters(device) if local_rank == 0 else None
        cpu_after = cpu_seconds() if local_rank == 0 else None
        record = dict(
            run=run["name"], rate=rate_key, outer_step=outer_step, seconds=seconds, load=load, trace=trace,
            rank=mesh.rank, replica=mesh.replica, stage=mesh.stage,
        )  # fmt: skip
        if before is not None:
            record["link"] = {k: after[k] - before[k] for k in after}
            record["machine_cpu_s"] = {k: cpu_after[k] - cpu_before[k] for k in cpu_after}
        return record

    rates = {"unlimited": None, **{str(m): m * 1e6 for m in setting["mbits"]}}
    records = []
    for round_index in range(setting["rounds"]):
        for rate_key, bits in rates.items():
            set_rate(bits)
            for run in runs:
                record = window(run, rate_key)
                record["round"] = round_index
                records.append(record)
                if mesh.rank == 0:
                    line = f"{rate_key:>9} {run['name']:<16} {record['seconds']:7.2f} s"
                    print(f"{line} load {load_average():.1f}", flush=True)
    set_rate(None)
    for run in runs:
        optimizers[run["name"]].finish_outer_step()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(records=records, stage_params=sum(p.numel() for p in params)))
    if mesh.rank == 0:
        with open(plan["output"], "w") as f:
            json.dump(dict(ranks=gathered), f)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- driver


def launch(setting: dict, dp: int, pp: int, runs: list[dict], timeout_s: float) -> dict:
    _remove_stale_namespaces()
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        nodes = stack.enter_context(Nodes(dp))
        plan_path, output = os.path.join(tmp, "plan.json"), os.path.join(tmp, "ranks.json")
        with open(plan_path, "w") as f:
            json.dump({"setting": setting, "pp": pp, "runs": runs, "output": output}, f)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pythonpath = os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
        logs = [stack.enter_context(open(os.path.join(tmp, f"node{n}.log"), "w+")) for n in range(dp)]
        procs: list[subprocess.Popen] = []
        try:
            for node in range(dp):
                cmd = [
                    "ip", "netns", "exec", nodes.namespaces[node],
                    "env", f"GLOO_SOCKET_IFNAME={nodes.devices[node]}",
                    "torchrun", "--nnodes", str(dp), "--node-rank", str(node),
                    "--nproc-per-node", str(pp), "--master-addr", nodes.addresses[0],
                    "--master-port", str(port), "--max-restarts", "0",
                    os.path.abspath(__file__), "--worker", plan_path,
                ]  # fmt: skip
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=logs[node], stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the nodes did not finish within {timeout_s:.0f} s")
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.5)
            codes = [p.poll() for p in procs]
            if any(c != 0 for c in codes):
                raise RuntimeError(
                    f"the nodes exited with {codes}:\n" + "\n".join(_tail(log) for log in logs)
                )
            print(_tail(logs[0], 3000))
            with open(output) as f:
                return json.load(f)
        finally:
            _stop(procs)


# ----------------------------------------------------------------------------------------- the model


def _stage_times(windows: list[dict], pp: int, num_micro: int) -> tuple[list[float], list[float], float]:
    """Per stage, mean forward and backward wall seconds of a microbatch; the per-step time outside
    train_step (the slowest stage's mean), from the window's plain inner steps."""
    forward, backward, other = [], [], []
    for s in range(pp):
        ws = [w for w in windows if w["stage"] == s]
        steps = [t for w in ws for t in w["trace"] if not t["started_outer"]]
        applied = set()
        for w in ws:  # the step that applies an overlapped outer step also waits inside opt.step
            applied |= {t["step"] for t in w["trace"] if t["optimizer"] > 5 * statistics.median(
                x["optimizer"] for x in w["trace"])}  # fmt: skip
        compute = [t["train_step"] - t["wait"] for t in steps]
        back = [t["backward"] for t in steps]
        forward.append(statistics.mean(c - b for c, b in zip(compute, back)) / num_micro)
        backward.append(statistics.mean(back) / num_micro)
        other.append(statistics.mean(t["other"] for t in steps if t["step"] not in applied))
    return forward, backward, max(other)


def _slow_factors(windows: list[dict], dp: int) -> dict[int, float]:
    per = {}
    for r in range(dp):
        ws = [w for w in windows if w["replica"] == r]
        per[r] = statistics.mean(t["train_step"] - t["wait"] + t["other"] for w in ws for t in w["trace"])
    mean = statistics.mean(per.values())
    return {r: v / mean for r, v in per.items()}


def _outer_compute(windows: list[dict], tau: int) -> float:
    """The outer step's own host time at the unlimited link: its opt.step calls (start and, with tau > 0,
    apply) less a plain step's. The least over ranks: the others also wait there for a later partner (the
    rank that arrives last waits for nobody), which the simulator adds itself from the replicas' speeds."""
    extras = []
    for w in windows:
        optimizer = [t["optimizer"] for t in w["trace"]]
        plain = statistics.median(optimizer)
        started = next(i for i, t in enumerate(w["trace"]) if t["started_outer"])
        extra = optimizer[started] - plain
        if tau:
            extra += optimizer[-1] - plain  # the window's last step applies it
        extras.append(extra)
    return max(min(extras), 0.0)


def _plain_step_seconds(windows: list[dict]) -> float:
    """The mean wall time of a plain inner step (train_step and the rest; neither starting nor applying an
    outer step), over the window's ranks."""
    per_rank = []
    for w in windows:
        median = statistics.median(t["optimizer"] for t in w["trace"])
        plain = [t for t in w["trace"] if not t["started_outer"] and t["optimizer"] <= 5 * median]
        per_rank.append(statistics.mean(t["train_step"] + t["other"] for t in plain))
    return statistics.mean(per_rank)


def fit_hop_latency(setting: dict, pp: int, calibration: list[dict]) -> float:
    """The latency of one message inside a node (gloo over loopback, under this load) for which the
    simulated inner step matches the unlimited windows' measured one (bisection; the step grows with it)."""
    from hf_noloco.estimate.simulator import Network, simulate_step

    micro = setting["microbatch_size"]
    m = setting["rows"] // micro
    forward, backward, other = _stage_times(calibration, pp, m)
    target = _plain_step_seconds(calibration)

    def step(latency: float) -> float:
        return simulate_step(
            "1f1b", pp, m, forward, backward, Network(latency=latency), micro=micro
        ).step_time

    low, high = 0.0, 0.1
    if step(low) + other >= target:
        return 0.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if step(mid) + other < target else (low, mid)
    return (low + high) / 2


def predict(setting: dict, dp: int, pp: int, run: dict, bits: float, windows: list[dict], calibration):
    from hf_noloco.estimate.simulator import Network, simulate_outer_periods, simulate_step

    h, micro = setting["inner_steps"], setting["microbatch_size"]
    m = setting["rows"] // micro
    forward, backward, other = _stage_times(windows, pp, m)
    hop = fit_hop_latency(setting, pp, calibration)
    plan = simulate_step("1f1b", pp, m, forward, backward, Network(latency=hop), micro=micro)
    step = plan.step_time + other
    stage_params = {w["stage"]: w["stage_params"] for w in windows}
    stage_bytes = [4.0 * stage_params[s] for s in range(pp)]  # float32 on the wire
    network = Network(bits / 8, 0.0, procs_per_node=pp, intra_latency=hop)
    result = simulate_outer_periods(
        run["method"], dp, pp, step, stage_bytes, network, h, overlap_steps=run["tau"],
        outer_compute=_outer_compute(calibration, run["tau"]), seed=0, slow=_slow_factors(windows, dp),
        first_outer_step=windows[0]["outer_step"], phase=run["tau"],
    )  # fmt: skip
    return dict(
        window_seconds=result.time,
        step_seconds=result.time / h,
        inner_step_seconds=step,
        measured_inner_step_seconds=_plain_step_seconds(windows),
        hop_latency=hop,
        forward=forward,
        backward=backward,
        other=other,
        blocked_mean=result.blocked[0],
        uplink_bytes=result.bytes_per_uplink,
    )


def summarize(setting: dict, meshes: dict) -> list[dict]:
    rows = []
    for key, measured in meshes.items():
        dp, pp = (int(x) for x in key.split("x"))
        per_rank = measured["ranks"]
        windows = []
        for rank in per_rank:
            for rec in rank["records"]:
                windows.append(dict(rec, stage_params=rank["stage_params"]))
        for run in configurations(setting):
            calibration = [w for w in windows if w["run"] == run["name"] and w["rate"] == "unlimited"]
            for mbits in setting["mbits"]:
                ws = [w for w in windows if w["run"] == run["name"] and w["rate"] == str(mbits)]
                for round_index in sorted({w["round"] for w in ws}):
                    wr = [w for w in ws if w["round"] == round_index]
                    cal = [w for w in calibration if w["round"] == round_index]
                    p = predict(setting, dp, pp, run, mbits * 1e6, wr, cal)
                    seconds = max(w["seconds"] for w in wr)
                    nodes = {w["rank"] // pp: w["link"]["tx_bytes"] for w in wr if "link" in w}
                    frames = sum(w["link"]["tx_packets"] for w in wr if "link" in w)
                    measured_bytes = sum(nodes.values())
                    predicted_bytes = sum(p["uplink_bytes"].values())
                    per_node = [
                        nodes[k] / p["uplink_bytes"][k] for k in sorted(nodes) if p["uplink_bytes"].get(k)
                    ]
                    machine = next(w["machine_cpu_s"] for w in wr if "machine_cpu_s" in w)
                    rows.append(dict(
                        mesh=f"dp{dp}xpp{pp}", processes=dp * pp, config=run["name"], method=run["method"],
                        tau=run["tau"], mbits=mbits, round=round_index,
                        measured_step_s=seconds / setting["inner_steps"], predicted_step_s=p["step_seconds"],
                        step_error=p["step_seconds"] / (seconds / setting["inner_steps"]) - 1,
                        predicted_inner_step_s=p["inner_step_seconds"], predicted_blocked_s=p["blocked_mean"],
                        measured_inner_step_s=p["measured_inner_step_seconds"],
                        hop_latency_s=p["hop_latency"],
                        measured_uplink_bytes=measured_bytes, predicted_uplink_bytes=predicted_bytes,
                        bytes_ratio=measured_bytes / predicted_bytes if predicted_bytes else None,
                        bytes_ratio_per_node=per_node,
                        measured_tcp_payload_bytes=measured_bytes - HEADER_BYTES * frames,
                        payload_ratio=(measured_bytes - HEADER_BYTES * frames) / predicted_bytes,
                        frames=frames,
                        tcp_retransmits=sum(w["link"]["tcp_retransmits"] for w in wr if "link" in w),
                        load=statistics.mean(w["load"] for w in wr),
                        machine_busy_cores=machine["busy"] / seconds,
                        forward_s=p["forward"], backward_s=p["backward"], other_s=p["other"],
                    ))  # fmt: skip
    return rows


def table(summary: list[dict]) -> str:
    """Markdown, one row per configuration: measured and predicted step time (means over the rounds), the
    error of the means and of each round, bytes (wire and TCP payload) against the simulator's."""
    lines = [
        "| mesh | config | Mbit/s | measured step (s) | predicted (s) | error | per round | wire bytes "
        "| TCP payload | load |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    keys = list(dict.fromkeys((r["mesh"], r["config"], r["mbits"]) for r in summary))
    for mesh, config, mbits in keys:
        rs = [r for r in summary if (r["mesh"], r["config"], r["mbits"]) == (mesh, config, mbits)]
        measured = statistics.mean(r["measured_step_s"] for r in rs)
        predicted = statistics.mean(r["predicted_step_s"] for r in rs)
        rounds = ", ".join(f"{r['step_error']:+.1%}" for r in rs)
        wire = statistics.mean(r["bytes_ratio"] for r in rs)
        payload = statistics.mean(r["payload_ratio"] for r in rs)
        load = ", ".join(f"{r['load']:.1f}" for r in rs)
        lines.append(
            f"| {mesh} | {config} | {mbits} | {measured:.3f} | {predicted:.3f} "
            f"| {predicted / measured - 1:+.1%} | {rounds} | x{wire:.3f} | x{payload:.4f} | {load} |"
        )
    return "\n".join(lines)


def finish(result: dict, output: str | None) -> None:
    result["summary"] = summarize(result["setting"], result["meshes"])
    for r in result["summary"]:
        print(
            f"{r['mesh']:<9} {r['config']:<14} {r['mbits']:>3} Mbit/s  step {r['measured_step_s']:.3f} s "
            f"measured, {r['predicted_step_s']:.3f} predicted ({r['step_error']:+.1%}); "
            f"bytes x{r['bytes_ratio']:.4f}, TCP payload x{r['payload_ratio']:.4f}  load {r['load']:.1f}"
        )
    print(table(result["summary"]))
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {output}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meshes", default=",".join(f"{d}x{p}" for d, p in MESHES), help="e.g. 2x2,4x2")
    parser.add_argument("--output", default=RESULTS)
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds (default {SETTING['rounds']})")
    parser.add_argument("--queue", default=SETTING["queue"], help="tbf's queue as a latency (e.g. 1s)")
    parser.add_argument("--replot", default=None, help="summarize a result JSON again, measure nothing")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
        finish(result, args.replot)
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    problem = namespace_problem()
    if problem:
        print(f"simulator_validation: skipped: {problem}")
        return 0
    setting = dict(SETTING, rounds=args.rounds or SETTING["rounds"], queue=args.queue)
    started = time.time()
    meshes = {}
    for key in args.meshes.split(","):
        dp, pp = (int(x) for x in key.split("x"))
        t0 = time.time()
        meshes[key] = launch(setting, dp, pp, configurations(setting), args.timeout)
        meshes[key]["wall_s"] = time.time() - t0
        print(f"mesh {key}: {meshes[key]['wall_s']:.0f} s", flush=True)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started))
    result = dict(setting=setting, meshes=meshes, started=when, wall_s=time.time() - started)
    result["machine"] = dict(cores=os.cpu_count())
    finish(result, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
