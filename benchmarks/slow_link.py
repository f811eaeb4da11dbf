"""Two "nodes" joined by an emulated slow link: tokens/s and the bytes that really cross it.

Linux, as root. Two network namespaces are joined by a veth pair; each end's egress is rate-limited with
`tc qdisc ... tbf`. Each namespace holds one "node" of two ranks, launched by `torchrun --nnodes 2` across the
link (gloo over the veth addresses); ranks are `replica * 2 + stage`, so with pp = 2 each node holds one whole
replica column. Traffic between the two ranks of a node stays inside its namespace (loopback); everything
that crosses the link is counted by the veth's own counters (`/sys/class/net/<veth>/statistics/tx_bytes`, read
inside each namespace), headers and acknowledgements included.

Measured for ddp, diloco and noloco, global against node routing, with the outer sync blocking or
overlapped (`outer_overlap_steps`), and `local` (no sync: the pipeline's own traffic alone), each at an
unlimited link and at link rates scaled so that NoLoCo's link-time / compute-time ratio matches an 8B model on
10, 3 and 1 Gbit/s links (see `scaled_rates`). `--configs wires` measures instead NoLoCo with node routing and
overlap for every `outer_dtype` (float32, bfloat16, int8, float8_e4m3, int4) at tau = H/2 and tau = H. Four
processes are started once and run every configuration in interleaved rounds; tokens/s ratios (a rate against
the unlimited link) are taken within a round and their median over rounds is reported, with the machine's load
beside each window: the load average, and from /proc/stat the cores used by the four ranks, by other work and
by niced work. The bytes predicted by the traffic model (`hf_noloco/estimate/traffic.py`, compressed packets
with their scales included) are compared with the bytes measured on the link.

Addresses (a private /30) exist only inside the namespaces this script creates; the namespaces (and with them
the veth pair) are deleted at the end, on errors and on Ctrl-C. Where namespaces cannot be made (not root, no
`ip`/`tc`, no permission in a container) the script says so and exits without measuring.

    sudo python benchmarks/slow_link.py            # full, ~1-2 hours on 2 shared cores
    sudo python benchmarks/slow_link.py --configs wires --rounds 4 --output /tmp/wires.json  # ~16 min
    sudo python benchmarks/slow_link.py --quick    # smoke: tiny model, one rate, one round (CI)
    python benchmarks/slow_link.py --replot benchmarks/results/slow_link.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from hf_noloco.estimate.traffic import LLAMA_3_8B

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "slow_link.json")
SKIP_PREFIX = "slow_link: skipped:"

NODES, PROCS_PER_NODE, PP = 2, 2, 2  # one replica column per node
ADDRESSES = ("10.213.7.1", "10.213.7.2")  # a private /30, only inside the namespaces made here
ROUTING_SEED = 0
MTU = 9000  # jumbo frames: TCP/IP headers ~1% of the bytes (~5% at 1500)

# The 8B reference whose link-time / compute-time ratios the emulated rates reproduce (see scaled_rates):
# Llama-3-8B, pp = 4 with one replica column per node (4 GPUs), 8 samples of 4096 tokens per replica and
# step, NoLoCo with H = 50 in float32 (fp32 master weights, as the engine sends them), and a step's compute
# time from 6 * parameters * tokens + causal attention FLOPs at 40% of an H100's 989 TFLOP/s, times the 1F1B
# bubble (microbatches + stages - 1) / microbatches with 8 microbatches of one sample.
REFERENCE_8B = dict(
    model=LLAMA_3_8B,  # the config of the README's traffic tables
    pp=4,
    seq_len=4096,
    rows=8,
    inner_steps=50,
    gpu_flops=989e12,
    mfu=0.4,
    link_gbits=[10, 3, 1],
)

SETTINGS = {
    "full": dict(
        model=dict(
            model_type="llama",
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=2048,
            tie_word_embeddings=False,
        ),
        rows=8,
        seq_len=128,
        microbatch_size=2,
        inner_steps=20,
        overlap_steps=10,  # tau / H = 0.5, the ratio of the convergence check's tau = 5 at H = 10
        ddp_steps=3,
        rounds=3,
        configs="all",
    ),
    "quick": dict(
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
        microbatch_size=2,
        inner_steps=4,
        overlap_steps=3,
        ddp_steps=2,
        rounds=1,
        configs=["ddp global", "noloco node overlap", "local global", "local node"],
        link_gbits=[1],
    ),
}


WIRES = "wires"  # --configs wires: NoLoCo, node routing, overlapped, every outer_dtype at tau = H/2 and H
WIRE_DTYPES = {"float32": "", "bfloat16": " bf16", "int8": " int8", "float8_e4m3": " fp8", "int4": " int4"}


def wire_configurations(setting: dict) -> list[dict]:
    """NoLoCo with node routing and an overlapped outer step, per wire format, at tau = H/2 (the names of
    the `all` grid's overlap rows: ``overlap_steps``) and at tau = H (``... overlap H``)."""
    runs = []
    for tau, suffix in ((setting["overlap_steps"], ""), (setting["inner_steps"], " H")):
        for dtype, label in WIRE_DTYPES.items():
            name = f"noloco node overlap{suffix}{label}"
            runs.append(dict(name=name, method="noloco", domain="node", overlap=True, dtype=dtype, tau=tau))
    return runs


def run_tau(setting: dict, run: dict) -> int:
    """tau of ``run``: its own (the wire grid), else the setting's ``overlap_steps`` when it overlaps."""
    if not run.get("overlap"):
        return 0
    return run.get("tau", setting["overlap_steps"])


def configurations(setting: dict) -> list[dict]:
    """Every configuration measured, in the order of a round."""
    runs = []
    for method in ("ddp", "diloco", "noloco", "local"):
        for domain in ("global", "node"):
            for overlap in (False, True) if method in ("diloco", "noloco") else (False,):
                if method == "diloco" and domain == "global" and overlap:
                    continue  # the global-routing DiLoCo run is there for its blocking sync only
                name = f"{method} {domain}" + (" overlap" if overlap else "")
                runs.append(dict(name=name, method=method, domain=domain, overlap=overlap, dtype="float32"))
    # the same with half the outer-sync bytes on the wire
    runs.append(
        dict(name="noloco node overlap bf16", method="noloco", domain="node", overlap=True, dtype="bfloat16")
    )
    if setting["configs"] == WIRES:
        return wire_configurations(setting)
    if setting["configs"] != "all":
        names = {r["name"] for r in runs}
        runs += [r for r in wire_configurations(setting) if r["name"] not in names]
        runs = [r for r in runs if r["name"] in setting["configs"]]
    return runs


# ------------------------------------------------------------------------------------------ the model


def outer_settings(setting: dict, run: dict):
    from hf_noloco.outer.settings import OuterSettings

    if run["method"] in ("ddp", "local"):
        return OuterSettings(run["method"])
    tau = run_tau(setting, run)
    return OuterSettings(
        run["method"],
        setting["inner_steps"],
        outer_overlap_steps=tau,
        routing_seed=0,
        outer_dtype=run.get("dtype", "float32"),
    )


def predicted_traffic(setting: dict, run: dict, first_step: int | None = None, steps: int = 0):
    """The traffic model's bytes for ``run``: expected, or with ``first_step`` the router's real draws for the
    samples of steps ``first_step .. first_step + steps - 1`` (what a measured window trained)."""
    from hf_noloco.estimate.traffic import step_traffic

    rows = setting["rows"]
    keys = None
    if first_step is not None:
        keys = [
            (t, k) for t in range(first_step, first_step + steps) for k in range(t * rows, (t + 1) * rows)
        ]

    dp = NODES * PROCS_PER_NODE // PP
    return step_traffic(
        setting["model"],
        seq_len=setting["seq_len"],
        batch_size=setting["rows"],
        pipeline_stages=PP,
        num_replicas=dp,
        procs_per_node=PROCS_PER_NODE,
        routing="sample",
        routing_group_size=dp if run["domain"] == "global" else PROCS_PER_NODE // PP,
        outer=outer_settings(setting, run),
        routing_seed=ROUTING_SEED,
        routing_keys=keys,
    )


def reference_step_seconds(reference: dict = REFERENCE_8B) -> float:
    """Compute time of one 8B pipeline step (see REFERENCE_8B)."""
    from hf_noloco.estimate.traffic import stage_parameter_counts

    m = reference["model"]
    params = sum(stage_parameter_counts(m, reference["pp"]))
    non_embedding = params - m["vocab_size"] * m["hidden_size"]  # an embedding lookup costs no FLOPs
    tokens = reference["rows"] * reference["seq_len"]
    # causal attention: QK^T and AV, 2 * 2 * seq * hidden multiply-adds per token and layer, halved by the
    # mask, times 3 for forward + backward
    attention = 3 * 2 * m["num_hidden_layers"] * reference["seq_len"] * m["hidden_size"] * tokens
    flops = 6 * non_embedding * tokens + attention
    bubble = (reference["rows"] + reference["pp"] - 1) / reference["rows"]
    return flops / (reference["pp"] * reference["gpu_flops"] * reference["mfu"]) * bubble


def reference_node_bytes_per_step(reference: dict = REFERENCE_8B) -> float:
    """Bytes per step that leave a node of the 8B reference under NoLoCo with node routing (the outer
    sync)."""
    from hf_noloco.estimate.traffic import step_traffic
    from hf_noloco.outer.settings import OuterSettings

    traffic = step_traffic(
        reference["model"],
        seq_len=reference["seq_len"],
        batch_size=reference["rows"],
        pipeline_stages=reference["pp"],
        num_replicas=2,
        procs_per_node=reference["pp"],
        routing="fixed",
        outer=OuterSettings("noloco", reference["inner_steps"]),
    )
    return traffic.node_egress_per_step(0)


def reference_summary(setting: dict, reference: dict = REFERENCE_8B) -> dict:
    """The 8B reference's numbers, and its NoLoCo (node routing) link-time / compute-time ratio per rate."""
    seconds, node_bytes = reference_step_seconds(reference), reference_node_bytes_per_step(reference)
    gbits = setting.get("link_gbits", reference["link_gbits"])
    ratios = {str(g): node_bytes * 8 / (g * 1e9) / seconds for g in gbits}
    return dict(reference, step_seconds=seconds, node_bytes_per_step=node_bytes, link_over_compute=ratios)


def scaled_rates(setting: dict, step_seconds: float, reference: dict = REFERENCE_8B) -> dict[float, float]:
    """``{8B link Gbit/s: emulated bit/s}``: for NoLoCo with node routing (only its outer sync crosses), the
    time a step's share of the outer sync takes on the link, over a step's compute time, is the same here as
    for the 8B reference on a link of that rate. ``step_seconds`` is this machine's measured step time."""
    tiny = predicted_traffic(setting, dict(method="noloco", domain="node", overlap=False))
    tiny_bytes = tiny.node_egress_per_step(0)
    ref_bytes, ref_seconds = reference_node_bytes_per_step(reference), reference_step_seconds(reference)
    gbits = setting.get("link_gbits", reference["link_gbits"])
    # ratio = bytes * 8 / rate / step time, equal on both sides
    return {g: tiny_bytes / step_seconds * (g * 1e9 * ref_seconds / ref_bytes) for g in gbits}


# ------------------------------------------------------------------------------------- namespaces


def namespace_problem() -> str | None:
    """Why two network namespaces cannot be made here, or None."""
    if platform.system() != "Linux":
        return f"network namespaces need Linux (this is {platform.system()})"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (run as root, or with sudo)"
    for tool in ("ip", "tc", "torchrun"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"hfnlprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


class TwoNodes(contextlib.AbstractContextManager):
    """Two namespaces joined by a veth pair; deleted on exit, whatever happened."""

    def __init__(self, tag: str):
        self.namespaces = (f"hfnl{tag}a", f"hfnl{tag}b")
        self.devices = (f"hfnl{tag}a", f"hfnl{tag}b")
        self.made: list[str] = []

    def __enter__(self):
        try:
            for ns in self.namespaces:
                _run("ip", "netns", "add", ns)
                self.made.append(ns)
            _run("ip", "link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
            for ns, dev, address in zip(self.namespaces, self.devices, ADDRESSES):
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "link", "set", dev, "mtu", str(MTU))
                _run("ip", "-n", ns, "addr", "add", f"{address}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        # Deleting a namespace deletes the veth end inside it, and with it the pair.
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []
        return False


def _remove_stale_namespaces() -> None:
    """Namespaces left by an earlier run of this script that was killed (SIGKILL skips every clean-up)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        if name.startswith("hfnl") and name[4:-1].isdigit() and not os.path.exists(f"/proc/{name[4:-1]}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


# ------------------------------------------------------------------------------------------ worker


def set_link_rate(device: str, bits_per_second: float | None, queue: str = "100ms") -> None:
    """tbf on this namespace's end of the link (its egress); None removes the limit. ``queue``: tbf's
    ``latency``, the longest a packet may wait in its queue before it is dropped."""
    if bits_per_second is None:
        subprocess.run(["tc", "qdisc", "del", "dev", device, "root"], capture_output=True)
        return
    rate = int(bits_per_second)
    burst = max(int(rate / 8 * 0.004), 4 * MTU)  # 4 ms of traffic: smooth at every rate measured
    _run(
        "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{rate}bit", "burst", str(burst),
        "latency", queue,
    )  # fmt: skip


def link_counters(device: str) -> dict[str, int]:
    base = f"/sys/class/net/{device}/statistics"
    values = {}
    for name in ("tx_bytes", "rx_bytes", "tx_packets"):
        with open(os.path.join(base, name)) as f:
            values[name] = int(f.read())
    with open("/proc/net/snmp") as f:  # this namespace's TCP counters
        lines = [line.split() for line in f if line.startswith("Tcp:")]
    values["tcp_retransmits"] = int(lines[1][lines[0].index("RetransSegs")])
    return values


def cpu_seconds() -> dict[str, float]:
    """This machine's CPU time so far (all cores, /proc/stat; not namespaced): busy at normal priority and
    busy at a positive nice value (e.g. a study run under `nice`, which yields to the ranks timed here)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    hz = os.sysconf("SC_CLK_TCK")
    return {"busy": (user + system + irq + softirq + steal) / hz, "nice": nice / hz}


def load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _worker(plan_path: str) -> None:
    import torch
    import torch.distributed as dist

    from hf_noloco.engine.loading import build_stage
    from hf_noloco.engine.mesh import PipelineMesh
    from hf_noloco.engine.pipeline import PipelineEngine
    from hf_noloco.engine.routing import Router
    from hf_noloco.outer.optimizer import OuterOptimizer

    with open(plan_path) as f:
        plan = json.load(f)
    setting = plan["setting"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = PipelineMesh.build(PP)
    local_rank = int(os.environ["LOCAL_RANK"])
    device = os.environ["GLOO_SOCKET_IFNAME"]
    from transformers import AutoConfig

    values = dict(setting["model"])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config._attn_implementation = "sdpa"
    stage = build_stage(config, mesh.stage, PP, seed=0)  # every replica draws the same weights
    params = list(stage.parameters())
    inner = torch.optim.AdamW(params, lr=1e-5)  # shared by every configuration: only its cost matters here

    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(step * 1000 + mesh.replica)
        return {
            "input_ids": torch.randint(
                0, config.vocab_size, (setting["rows"], setting["seq_len"]), generator=g
            )
        }

    runs = plan["runs"]
    engines, optimizers, counts = {}, {}, {}
    for run in runs:
        group = mesh.num_replicas if run["domain"] == "global" else PROCS_PER_NODE // PP
        router = Router(mesh.num_replicas, "sample", seed=ROUTING_SEED, group_size=group)
        engines[run["name"]] = PipelineEngine(stage, mesh, router, setting["microbatch_size"])
        optimizers[run["name"]] = OuterOptimizer(inner, params, mesh, outer_settings(setting, run))
        counts[run["name"]] = 0

    # With tau = H an outer step is applied and the next one started by the same step(), the last of a
    # window: left in flight, that exchange would cross the link during the other configurations' windows.
    # Its start is held back to the beginning of the configuration's next train() call (inside the next
    # window's timing), which trains exactly the same sequence of steps and exchanges.
    held: dict[str, bool] = {}
    for run in runs:
        if run["method"] in ("diloco", "noloco") and run_tau(setting, run) == setting["inner_steps"]:
            opt = optimizers[run["name"]]
            opt.start_outer_step = lambda name=run["name"]: held.__setitem__(name, True)

    def start_held(name: str) -> None:
        if held.pop(name, False):
            type(optimizers[name]).start_outer_step(optimizers[name])

    def train(name: str, steps: int) -> None:
        engine, opt = engines[name], optimizers[name]
        for _ in range(steps):
            start_held(name)
            opt.zero_grad(set_to_none=True)
            engine.train_step(batch(counts[name]))
            opt.reduce_gradients()
            opt.step()
            counts[name] += 1

    def window_steps(run: dict) -> int:
        return setting["inner_steps"] if run["method"] in ("diloco", "noloco") else setting["ddp_steps"]

    def warm_up(run: dict) -> None:
        """Up to the first window's start: right after an outer step was applied, nothing in flight."""
        if counts[run["name"]] == 0:
            tau = run_tau(setting, run)
            train(run["name"], window_steps(run) + tau if run["method"] in ("diloco", "noloco") else 1)

    def set_rate(bits: float | None) -> None:
        if local_rank == 0:
            set_link_rate(device, bits)
        dist.barrier()

    def window(run: dict, rate_key: str) -> dict:
        warm_up(run)
        steps = window_steps(run)
        syncs_before, first_step = optimizers[run["name"]].outer_step_count, counts[run["name"]]
        dist.barrier()
        before = link_counters(device) if local_rank == 0 else None
        # No rank may send before both nodes have read their counters: with tau = H a window's first step
        # posts an exchange, which an unlimited link would carry in the moment the read takes.
        dist.barrier()
        cpu_before = cpu_seconds() if local_rank == 0 else None
        load, start, own = load_average(), time.perf_counter(), time.process_time()
        train(run["name"], steps)
        dist.barrier()
        seconds, own = time.perf_counter() - start, time.process_time() - own
        after = link_counters(device) if local_rank == 0 else None
        cpu_after = cpu_seconds() if local_rank == 0 else None
        record = dict(
            run=run["name"],
            rate=rate_key,
            steps=steps,
            first_step=first_step,
            syncs=optimizers[run["name"]].outer_step_count - syncs_before,
            seconds=seconds,
            tokens=steps * setting["rows"] * setting["seq_len"] * mesh.num_replicas,
            load=load,
            cpu_s=own,  # this rank's CPU time (all its threads: gloo's included)
        )
        if before is not None:
            record["link"] = {k: after[k] - before[k] for k in after}
            record["machine_cpu_s"] = {k: cpu_after[k] - cpu_before[k] for k in cpu_after}
        return record

    # Calibration: this machine's step time without any link limit (NoLoCo, node routing, blocking sync).
    set_rate(None)
    calibration_run = dict(name="noloco node", method="noloco", domain="node", overlap=False)
    if calibration_run["name"] not in engines:
        calibration_run = runs[0]
    warm_up(calibration_run)
    calibration = [window(calibration_run, "unlimited")["seconds"] / window_steps(calibration_run)]
    rates = [None]
    if mesh.rank == 0:
        seconds = statistics.median(calibration)
        rates = [scaled_rates(setting, seconds)]
    dist.broadcast_object_list(rates, src=0)
    rates = {str(g): bits for g, bits in rates[0].items()}
    order = ["unlimited", *rates]

    records = []
    for round_index in range(setting["rounds"]):
        # Interleaved: every configuration at every rate within a round; the order alternates between rounds.
        for rate_key in order if round_index % 2 == 0 else order[::-1]:
            set_rate(None if rate_key == "unlimited" else rates[rate_key])
            for run in runs if round_index % 2 == 0 else runs[::-1]:
                if run["method"] == "local" and rate_key != "unlimited" and not setting.get("local_at_rates"):
                    continue  # the pipeline's own traffic: its bytes are the point, not its speed
                record = window(run, rate_key)
                record["round"] = round_index
                records.append(record)
                if mesh.rank == 0:
                    print(
                        f"round {round_index} {rate_key:>9} {run['name']:<28} "
                        f"{record['tokens'] / record['seconds']:8.0f} tokens/s  load {record['load']:.1f}",
                        flush=True,
                    )
    set_rate(None)
    for run in runs:
        optimizers[run["name"]].finish_outer_step()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if mesh.rank == 0:
        # Link counters were read by each node's local rank 0: ranks 0 and 2. Add both ends' egress.
        merged = []
        for i, record in enumerate(gathered[0]):
            other = gathered[PROCS_PER_NODE][i]
            record["link_bytes"] = record["link"]["tx_bytes"] + other["link"]["tx_bytes"]
            record["tcp_retransmits"] = record["link"]["tcp_retransmits"] + other["link"]["tcp_retransmits"]
            record["link_per_node"] = [record.pop("link"), other["link"]]
            # What else used the cores meanwhile: the machine's busy time less the four ranks' own.
            ours = sum(g[i]["cpu_s"] for g in gathered)
            machine = record.pop("machine_cpu_s")
            record["cpu_cores"] = dict(
                ranks=ours / record["seconds"],
                others=max(machine["busy"] - ours, 0.0) / record["seconds"],
                niced=machine["nice"] / record["seconds"],
            )
            merged.append(record)
        with open(plan["output"], "w") as f:
            json.dump({"rates": rates, "calibration_step_seconds": calibration, "windows": merged}, f)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- driver


def launch(setting: dict, runs: list[dict], timeout_s: float) -> dict:
    """Runs the worker on 2 x 2 ranks across the emulated link; returns what rank 0 recorded."""
    _remove_stale_namespaces()
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        nodes = stack.enter_context(TwoNodes(str(os.getpid())))
        plan_path, output = os.path.join(tmp, "plan.json"), os.path.join(tmp, "windows.json")
        with open(plan_path, "w") as f:
            json.dump({"setting": setting, "runs": runs, "output": output}, f)
        # Any free port: the rendezvous listens on the namespace's own address, not on this machine's network.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pythonpath = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
        logs = [stack.enter_context(open(os.path.join(tmp, f"node{n}.log"), "w+")) for n in range(NODES)]
        procs: list[subprocess.Popen] = []
        try:
            for node in range(NODES):
                cmd = [
                    "ip", "netns", "exec", nodes.namespaces[node],
                    "env", f"GLOO_SOCKET_IFNAME={nodes.devices[node]}",
                    "torchrun", "--nnodes", str(NODES), "--node-rank", str(node),
                    "--nproc-per-node", str(PROCS_PER_NODE), "--master-addr", ADDRESSES[0],
                    "--master-port", str(port), "--max-restarts", "0",
                    os.path.abspath(__file__), "--worker", plan_path,
                ]  # fmt: skip
                log = logs[node]
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the two nodes did not finish within {timeout_s:.0f} s")
                if any(p.poll() not in (None, 0) for p in procs):
                    break  # one node failed: stop the other too
                time.sleep(0.5)
            codes = [p.poll() for p in procs]
            if codes != [0, 0]:
                tails = "\n".join(_tail(log) for log in logs)
                raise RuntimeError(f"the nodes exited with {codes}:\n{tails}")
            with open(output) as f:
                return json.load(f)
        finally:
            _stop(procs)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stops every launched node (its whole process group: torchrun and its workers)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _tail(log, chars: int = 4000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:]


def summarize(setting: dict, runs: list[dict], measured: dict) -> dict:
    windows = measured["windows"]
    rate_keys = ["unlimited", *measured["rates"]]
    rounds = sorted({w["round"] for w in windows})
    by = {(w["run"], w["rate"], w["round"]): w for w in windows}
    rows = []
    for run in runs:
        traffic = predicted_traffic(setting, run)
        for rate_key in rate_keys:
            ws = [by[run["name"], rate_key, r] for r in rounds if (run["name"], rate_key, r) in by]
            if not ws:
                continue
            tps = [w["tokens"] / w["seconds"] for w in ws]
            ratios = [
                (w["tokens"] / w["seconds"]) / (u["tokens"] / u["seconds"])
                for w in ws
                if (u := by.get((run["name"], "unlimited", w["round"]))) is not None
            ]
            # ddp syncs every step (its outer-step counter stays 0): cross_bytes then spreads by step
            syncs = [w["syncs"] if run["method"] in ("diloco", "noloco") else None for w in ws]
            predicted = [traffic.cross_bytes(w["steps"], n) for w, n in zip(ws, syncs)]
            realized = [
                predicted_traffic(setting, run, w["first_step"], w["steps"]).cross_bytes(w["steps"], n)
                for w, n in zip(ws, syncs)
            ]
            measured_bytes = [w["link_bytes"] for w in ws]
            # What the link costs against compute here: the busiest node's outgoing bytes at the link rate,
            # over the same configuration's unlimited window of the same round (its compute time).
            link_over_compute = None
            if rate_key != "unlimited":
                bits = measured["rates"][rate_key]
                link_over_compute = statistics.median(
                    max(n["tx_bytes"] for n in w["link_per_node"]) * 8 / bits / u["seconds"]
                    for w in ws
                    if (u := by.get((run["name"], "unlimited", w["round"]))) is not None
                )
            rows.append(
                dict(
                    config=run["name"],
                    rate=rate_key,
                    link_bits_per_second=None if rate_key == "unlimited" else measured["rates"][rate_key],
                    tokens_per_second=statistics.median(tps),
                    tokens_per_second_rounds=tps,
                    vs_unlimited=statistics.median(ratios) if ratios else None,
                    vs_unlimited_rounds=ratios,
                    link_over_compute=link_over_compute,
                    predicted_link_bytes_per_window=statistics.mean(predicted),
                    measured_link_bytes_per_window=statistics.mean(measured_bytes),
                    measured_over_predicted=(sum(measured_bytes) / sum(predicted))
                    if sum(predicted)
                    else None,
                    predicted_realized_link_bytes_per_window=statistics.mean(realized),
                    measured_over_realized=(sum(measured_bytes) / sum(realized)) if sum(realized) else None,
                    predicted_pipeline_link_bytes_per_step=sum(r.pipeline_cross for r in traffic.ranks),
                    tcp_retransmits=sum(w["tcp_retransmits"] for w in ws),
                    load=[w["load"] for w in ws],
                    # cores busy with the ranks, with other normal-priority work, and with niced work
                    cpu_cores={
                        k: [round(w["cpu_cores"][k], 2) for w in ws]
                        for k in ("ranks", "others", "niced")
                        if all("cpu_cores" in w for w in ws)
                    },
                )
            )
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["summary"] if not r["config"].startswith("local")]
    rates = result["rates"]
    fig, ax = plt.subplots(figsize=(8, 5))
    top = max(float(g) for g in rates) * 3  # where the unlimited link is drawn
    for config in dict.fromkeys(r["config"] for r in rows):
        points = sorted(
            (top if r["rate"] == "unlimited" else float(r["rate"]), r["tokens_per_second"])
            for r in rows
            if r["config"] == config
        )
        style = "-" if "node" in config else "--"
        ax.plot(*zip(*points), style, marker="o", label=config)
    ax.set_xscale("log")
    ticks = sorted(float(g) for g in rates) + [top]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks[:-1]] + ["unlimited"])
    ax.minorticks_off()
    ax.set_xlabel("link rate, as the 8B-model equivalent (Gbit/s per node)")
    ax.set_ylabel("tokens/s (median over rounds)")
    ax.set_title("Two emulated nodes over a rate-limited link (tbf): tokens/s per configuration")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------- stages across the link (--placement)

# --placement pp2 | pp2xdp2: stage 0 of every replica on node A, stage 1 on node B, so every microbatch's
# activations and activation gradients cross the link (sample routing across the replicas with dp 2); no
# outer sync (each replica steps its own AdamW), so the boundary is the only traffic on the link. Ranks are
# started directly (not by torchrun) to choose that order: rank replica * 2 + stage runs on node `stage`.
BOUNDARY_FORMATS = {  # name -> (boundary_dtype, boundary_grad_dtype); "wire f32": today's float32 wire
    "wire f32": (None, None),
    "bf16": ("bfloat16", "bfloat16"),
    "int8": ("int8", "int8"),
    "fp8": ("float8_e4m3", "float8_e5m2"),
    "int4": ("int4", "int4"),
}
PLACEMENTS = {"pp2": 1, "pp2xdp2": 2}  # -> replicas
STAGES_SETTING = dict(
    model=SETTINGS["full"]["model"],
    rows=8,
    seq_len=128,
    microbatch_size=2,
    steps=3,
    rounds=2,
    link_gbits=[10, 1, 0.1],
)


def stage_node_egress(setting: dict, dp: int, fmt: tuple, keys=None, config=None) -> float:
    """Bytes per step that leave node A (stage 0: activations and records) under the traffic model, for the
    stage placement; ``config`` another model (the 8B reference), ``keys`` the router's real draws."""
    from hf_noloco.estimate.traffic import step_traffic

    traffic = step_traffic(
        config or setting["model"],
        seq_len=setting["seq_len"],
        batch_size=setting["rows"],
        pipeline_stages=PP,
        num_replicas=dp,
        procs_per_node=1,  # every rank's pipeline bytes cross (its peers are on the other node)
        routing="sample",
        outer=_local_outer(),
        stage_params=[1] * PP,
        routing_seed=ROUTING_SEED,
        routing_keys=keys,
        boundary_dtype=fmt[0],
        boundary_grad_dtype=fmt[1],
    )
    return sum(r.pipeline_cross for r in traffic.ranks if r.stage == 0)


def _local_outer():
    from hf_noloco.outer.settings import OuterSettings

    return OuterSettings("local")


def stage_scaled_rates(setting: dict, dp: int, step_seconds: float, reference: dict = REFERENCE_8B) -> dict:
    """``{8B link Gbit/s: emulated bit/s}`` for the stage placement: a step's float32 boundary bytes out of
    node A over the link rate, against a step's compute time, equal here and for Llama-3-8B at pp 2 (one
    stage per node, the reference's 8 samples of 4096 tokens per replica and step, its FLOPs model)."""
    ref = dict(reference, pp=PP)
    ref_setting = dict(seq_len=ref["seq_len"], rows=ref["rows"])
    ref_bytes = stage_node_egress(ref_setting, dp, (None, None), config=ref["model"])
    ref_seconds = reference_step_seconds(ref)
    tiny_bytes = stage_node_egress(setting, dp, (None, None))
    return {g: tiny_bytes / step_seconds * (g * 1e9 * ref_seconds / ref_bytes) for g in setting["link_gbits"]}


def _stages_worker(plan_path: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from hf_noloco.engine.loading import build_stage
    from hf_noloco.engine.mesh import PipelineMesh
    from hf_noloco.engine.pipeline import PipelineEngine
    from hf_noloco.engine.routing import Router

    with open(plan_path) as f:
        plan = json.load(f)
    setting, dp = plan["setting"], plan["dp"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = PipelineMesh.build(PP)
    local_rank, device = int(os.environ["LOCAL_RANK"]), os.environ["GLOO_SOCKET_IFNAME"]
    values = dict(setting["model"])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config._attn_implementation = "sdpa"
    stage = build_stage(config, mesh.stage, PP, seed=0)
    inner = torch.optim.AdamW(stage.parameters(), lr=1e-5)
    engines, counts = {}, {}
    for name, (fmt, grad_fmt) in BOUNDARY_FORMATS.items():
        router = Router(mesh.num_replicas, "sample", seed=ROUTING_SEED)
        engines[name] = PipelineEngine(
            stage, mesh, router, setting["microbatch_size"], boundary_dtype=fmt, boundary_grad_dtype=grad_fmt
        )
        counts[name] = 0

    def train(name: str, steps: int) -> float:
        waited = 0.0
        for _ in range(steps):
            g = torch.Generator().manual_seed(counts[name] * 1000 + mesh.replica)
            ids = torch.randint(0, config.vocab_size, (setting["rows"], setting["seq_len"]), generator=g)
            inner.zero_grad(set_to_none=True)
            engines[name].train_step({"input_ids": ids})
            inner.step()
            waited += engines[name].wait_seconds
            counts[name] += 1
        return waited

    def set_rate(bits):
        if local_rank == 0:
            set_link_rate(device, bits)
        dist.barrier()

    def window(name: str, rate_key: str) -> dict:
        first_step = counts[name]
        dist.barrier()
        before = link_counters(device) if local_rank == 0 else None
        dist.barrier()
        load, start, own = load_average(), time.perf_counter(), time.process_time()
        waited = train(name, setting["steps"])
        dist.barrier()
        seconds, own = time.perf_counter() - start, time.process_time() - own
        after = link_counters(device) if local_rank == 0 else None
        record = dict(
            run=name, rate=rate_key, steps=setting["steps"], first_step=first_step, seconds=seconds,
            tokens=setting["steps"] * setting["rows"] * setting["seq_len"] * mesh.num_replicas,
            load=load, cpu_s=own, wait_s=waited, stage=mesh.stage,
        )  # fmt: skip
        if before is not None:
            record["link"] = {k: after[k] - before[k] for k in after}
        return record

    set_rate(None)
    for name in engines:  # warm-up: one step each
        train(name, 1)
    calibration = [window("wire f32", "unlimited")["seconds"] / setting["steps"] for _ in range(2)]
    rates = [stage_scaled_rates(setting, dp, statistics.median(calibration))] if mesh.rank == 0 else [None]
    dist.broadcast_object_list(rates, src=0)
    rates = {str(g): bits for g, bits in rates[0].items()}
    order, names = ["unlimited", *rates], list(engines)
    records = []
    for round_index in range(setting["rounds"]):
        for rate_key in order if round_index % 2 == 0 else order[::-1]:
            set_rate(None if rate_key == "unlimited" else rates[rate_key])
            for name in names if round_index % 2 == 0 else names[::-1]:
                record = window(name, rate_key)
                record["round"] = round_index
                records.append(record)
                if mesh.rank == 0:
                    print(f"round {round_index} {rate_key:>9} {name:<9} "
                          f"{record['tokens'] / record['seconds']:8.0f} tokens/s  load {record['load']:.1f}",
                          flush=True)  # fmt: skip
    set_rate(None)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if mesh.rank == 0:
        merged = []
        for i, record in enumerate(gathered[0]):
            other = gathered[1][i]  # rank 1 (stage 1 of replica 0): node B's local rank 0, its counters
            record["link_per_node"] = [record.pop("link"), other["link"]]
            record["link_bytes"] = sum(n["tx_bytes"] for n in record["link_per_node"])
            record["wait_s_per_rank"] = [g[i]["wait_s"] for g in gathered]
            merged.append(record)
        with open(plan["output"], "w") as f:
            json.dump({"rates": rates, "calibration_step_seconds": calibration, "windows": merged}, f)
    dist.barrier()
    dist.destroy_process_group()


def launch_stages(setting: dict, dp: int, timeout_s: float) -> dict:
    """Runs the stage-placement worker: ranks replica * 2 + stage, stage 0 on node A, stage 1 on node B."""
    _remove_stale_namespaces()
    world = PP * dp
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        nodes = stack.enter_context(TwoNodes(str(os.getpid())))
        plan_path, output = os.path.join(tmp, "plan.json"), os.path.join(tmp, "windows.json")
        with open(plan_path, "w") as f:
            json.dump({"setting": setting, "dp": dp, "output": output}, f)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pythonpath = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
        logs, procs = [], []
        try:
            for rank in range(world):
                replica, node = divmod(rank, PP)
                ranks_env = [
                    f"RANK={rank}", f"WORLD_SIZE={world}", f"LOCAL_RANK={replica}", f"LOCAL_WORLD_SIZE={dp}",
                    f"MASTER_ADDR={ADDRESSES[0]}", f"MASTER_PORT={port}",
                    f"GLOO_SOCKET_IFNAME={nodes.devices[node]}",
                ]  # fmt: skip
                cmd = ["ip", "netns", "exec", nodes.namespaces[node], "env", *ranks_env,
                       sys.executable, os.path.abspath(__file__), "--stages-worker", plan_path]  # fmt: skip
                log = stack.enter_context(open(os.path.join(tmp, f"rank{rank}.log"), "w+"))
                logs.append(log)
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))  # fmt: skip
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the ranks did not finish within {timeout_s:.0f} s")
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.5)
            codes = [p.poll() for p in procs]
            if any(c != 0 for c in codes):
                raise RuntimeError(f"the ranks exited with {codes}:\n" + "\n".join(_tail(lg) for lg in logs))
            with open(output) as f:
                return json.load(f)
        finally:
            _stop(procs)


def summarize_stages(setting: dict, dp: int, measured: dict) -> list[dict]:
    windows, rates = measured["windows"], measured["rates"]
    by = {(w["run"], w["rate"], w["round"]): w for w in windows}
    rounds = sorted({w["round"] for w in windows})
    rows = []
    for name, fmt in BOUNDARY_FORMATS.items():
        for rate_key in ["unlimited", *rates]:
            ws = [by[name, rate_key, r] for r in rounds if (name, rate_key, r) in by]
            units = [by[name, "unlimited", w["round"]] for w in ws]
            ratios = [(w["tokens"] / w["seconds"]) / (u["tokens"] / u["seconds"]) for w, u in zip(ws, units)]
            keys = lambda w: [  # the samples a window trained
                (t, k)
                for t in range(w["first_step"], w["first_step"] + w["steps"])
                for k in range(t * setting["rows"], (t + 1) * setting["rows"])
            ]
            # node A's egress, the busier direction (activations and records)
            predicted = [stage_node_egress(setting, dp, fmt, keys(w)) * w["steps"] for w in ws]
            measured_a = [w["link_per_node"][0]["tx_bytes"] for w in ws]
            link_over_compute = None
            if rate_key != "unlimited":
                link_over_compute = statistics.median(
                    a * 8 / rates[rate_key] / u["seconds"] for a, u in zip(measured_a, units)
                )
            rows.append(
                dict(
                    placement=f"pp2xdp{dp}" if dp > 1 else "pp2",
                    config=name,
                    boundary_dtype=fmt[0],
                    boundary_grad_dtype=fmt[1],
                    rate=rate_key,
                    link_bits_per_second=rates.get(rate_key),
                    tokens_per_second=statistics.median(w["tokens"] / w["seconds"] for w in ws),
                    vs_unlimited=statistics.median(ratios),
                    vs_unlimited_rounds=ratios,
                    link_over_compute=link_over_compute,
                    node_a_bytes_measured_over_model=sum(measured_a) / sum(predicted),
                    wait_s_per_rank=[
                        statistics.median(w["wait_s_per_rank"][i] for w in ws)
                        for i in range(len(ws[0]["wait_s_per_rank"]))
                    ],  # fmt: skip
                    load=[w["load"] for w in ws],
                )
            )
    return rows


def main_stages(args) -> int:
    problem = namespace_problem()
    if problem:
        print(f"{SKIP_PREFIX} {problem}")
        return 0
    setting = dict(STAGES_SETTING)
    if args.rounds:
        setting["rounds"] = args.rounds
    if args.gbits:
        setting["link_gbits"] = [float(g) for g in args.gbits.split(",")]
    started = time.time()
    result = dict(mode="stages", setting=setting, placements={}, summary=[], started=time.ctime(started))
    for placement in args.placement.split(","):
        dp = PLACEMENTS[placement]
        measured = launch_stages(setting, dp, args.timeout)
        result["placements"][placement] = measured
        result["summary"] += summarize_stages(setting, dp, measured)
    result["wall_s"] = time.time() - started
    result["machine"] = dict(cores=os.cpu_count(), platform=platform.platform())
    for row in result["summary"]:
        loc = "" if row["link_over_compute"] is None else f"link/compute {row['link_over_compute']:.2f}"
        print(f"{row['placement']:<8} {row['config']:<9} {row['rate']:>9} {row['tokens_per_second']:8.0f} "
              f"tokens/s {row['vs_unlimited']:.2f} of unlimited  {loc:<20} "
              f"bytes/model {row['node_a_bytes_measured_over_model']:.3f}")  # fmt: skip
    output = args.output or os.path.join(HERE, "results", "slow_link_boundary.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, one rate, one round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated configuration names (default: all), or {WIRES!r}: NoLoCo, node routing, "
        "overlapped, each outer_dtype at tau = H/2 and tau = H",
    )
    parser.add_argument("--gbits", default=None, help="comma-separated 8B-equivalent link rates in Gbit/s")
    parser.add_argument("--output", default=None, help=f"result JSON (default {RESULTS}; --quick: not saved)")
    parser.add_argument("--replot", default=None, help="redraw the plot of a result JSON, measure nothing")
    parser.add_argument("--timeout", type=float, default=4 * 3600)
    parser.add_argument(
        "--placement",
        default=None,
        help="pp2 and/or pp2xdp2 (comma-separated): stages on different nodes, every boundary format "
        "(float32 wire, bf16, int8, fp8, int4) at the 8B-equivalent boundary rates (default 10,1,0.1 Gbit/s)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stages-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    if args.stages_worker:
        _stages_worker(args.stages_worker)
        return 0
    if args.placement:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
        return main_stages(args)
    if args.replot:  # summary (from the recorded windows), table and plot again; nothing is measured
        with open(args.replot) as f:
            result = json.load(f)
        measured = {k: result[k] for k in ("rates", "windows")}
        result["summary"] = summarize(result["setting"], configurations(result["setting"]), measured)
        result["reference_8b"] = reference_summary(result["setting"])
        finish(result, args.replot)
        return 0
    # Ctrl-C raises KeyboardInterrupt; a plain kill (SIGTERM, SIGHUP) must unwind the same way, so that the
    # launched nodes are stopped and the namespaces deleted. SIGINT is set explicitly: a process started
    # with SIGINT ignored (a background job of a script, or a parent that ignores it) inherits that, and
    # Python then installs no KeyboardInterrupt handler, so Ctrl-C would be ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    problem = namespace_problem()
    if problem:
        print(f"{SKIP_PREFIX} {problem}")
        return 0
    mode = "quick" if args.quick else "full"
    setting = dict(SETTINGS[mode])
    if args.rounds:
        setting["rounds"] = args.rounds
    if args.configs:
        setting["configs"] = WIRES if args.configs == WIRES else [c.strip() for c in args.configs.split(",")]
    if args.gbits:
        setting["link_gbits"] = [float(g) for g in args.gbits.split(",")]
    runs = configurations(setting)
    started = time.time()
    measured = launch(setting, runs, args.timeout if not args.quick else 600)
    from hf_noloco.estimate.traffic import record_bytes_per_row  # noqa: F401 - the model used below

    result = dict(
        mode=mode,
        setting=setting,
        reference_8b=reference_summary(setting),
        rates=measured["rates"],
        calibration_step_seconds=measured["calibration_step_seconds"],
        machine=dict(cores=os.cpu_count(), platform=platform.platform(), python=platform.python_version()),
        started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        wall_s=time.time() - started,
        summary=summarize(setting, runs, measured),
        windows=measured["windows"],
    )
    finish(result, args.output or (RESULTS if not args.quick else None))
    return 0


def finish(result: dict, output: str | None) -> None:
    """Prints the summary; writes the JSON and the plot to ``output`` (and its .png) unless it is None."""
    for row in result["summary"]:
        keep = "" if row["vs_unlimited"] is None else f"{row['vs_unlimited']:.2f} of unlimited"
        ratio = row["measured_over_predicted"]
        print(
            f"{row['config']:<28} {row['rate']:>9}  {row['tokens_per_second']:8.0f} tokens/s  {keep:>18}  "
            f"link {row['measured_link_bytes_per_window'] / 2**20:8.2f} MiB/window "
            f"(model {row['predicted_link_bytes_per_window'] / 2**20:8.2f}"
            + (f", x{ratio:.3f})" if ratio else ")")
        )
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.splitext(output)[0] + ".png")
        print(f"wrote {output} and {os.path.splitext(output)[0]}.png")


if __name__ == "__main__":
    sys.exit(main())
