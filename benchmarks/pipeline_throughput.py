"""Training throughput of the pipeline engine against the unsplit model, on this machine's CPUs.

One training step = forward + backward of a per-replica batch + the inner AdamW step. Measured side by side
in one run, every process with one thread:

    reference       the unsplit model in one process (plain transformers forward with labels)
    pp=2 x dp=1     two stages, for each microbatch size
    pp=2 x dp=2     four processes, `sample` vs `fixed` routing, for each microbatch size

tokens/s counts the tokens of all replicas;
efficiency = tokens/s / (min(processes, cores) * reference tokens/s).
Each configuration runs in fresh processes (forked by hf_noloco.local_launch); configurations are run in
turn, `--repeats` times. Every timed step sits between two barriers. On a shared machine other programs
only ever slow a step down, so the headline tokens/s is the fastest step over all repeats among the steps
during which other programs used under `quiet_cores` of CPU (measured from /proc/stat); the median is
recorded too.

    python benchmarks/pipeline_throughput.py            # full: a small Llama, a few minutes
    python benchmarks/pipeline_throughput.py --quick    # smoke: a tiny model, seconds; checks the output
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from hf_noloco.local_launch import run_distributed
from hf_noloco.mesh import PipelineMesh
from hf_noloco.partition import split_model
from hf_noloco.pipeline import PipelineEngine
from hf_noloco.routing import Router

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipeline_throughput.json")

# model; per-replica rows; seq_len; microbatch sizes; warmup and timed steps per run; alternated repeats;
# the foreign load (cores used by other programs) under which a step counts as quiet
SETTINGS = {
    "full": dict(
        model=dict(hidden_size=256, num_hidden_layers=4, intermediate_size=688, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=4096),
        rows=8, seq_len=256, microbatch_sizes=[1, 2, 4], warmup=1, steps=4, repeats=3, quiet_cores=0.25,
    ),
    "quick": dict(
        model=dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=512),
        rows=4, seq_len=64, microbatch_sizes=[1, 2], warmup=1, steps=2, repeats=1, quiet_cores=0.25,
    ),
}


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def llama_config(model: dict, seq_len: int) -> LlamaConfig:
    config = LlamaConfig(**model, max_position_embeddings=seq_len, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def configurations(microbatch_sizes: list[int]) -> list[dict]:
    """Every configuration measured, in the order they are run (and printed)."""
    runs = [dict(name="reference", pp=1, dp=1, routing=None, microbatch_size=None)]
    for m in microbatch_sizes:
        runs.append(dict(name=f"pp2 dp1 mb{m}", pp=2, dp=1, routing="sample", microbatch_size=m))
    for m in microbatch_sizes:
        for routing in ("fixed", "sample"):
            runs.append(dict(name=f"pp2 dp2 mb{m} {routing}", pp=2, dp=2, routing=routing, microbatch_size=m))
    return runs


# ------------------------------------------------------------------------------------ one rank's work


def _train(run: dict, setting: dict) -> dict:
    """On each rank: build the model (same seed everywhere), train `warmup` steps, then time `steps` steps,
    each between two barriers. Returns this rank's step times and last loss."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(setting["model"], setting["seq_len"]))
    rows, seq_len = setting["rows"], setting["seq_len"]
    rank = dist.get_rank()
    replica = rank // run["pp"]
    g = torch.Generator().manual_seed(1000 + replica)  # each replica its own data shard
    input_ids = torch.randint(0, model.config.vocab_size, (rows, seq_len), generator=g)

    if run["name"] == "reference":
        params = model.parameters()

        def forward_backward():
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            return loss
    else:
        mesh = PipelineMesh.build(run["pp"])
        stage = split_model(model, mesh.stage, run["pp"], setting["stage_boundaries"])
        del model  # the stage keeps its own modules
        router = Router(mesh.num_replicas, run["routing"], seed=0)
        engine = PipelineEngine(stage, mesh, router, run["microbatch_size"])
        params = stage.parameters()
        batch = {"input_ids": input_ids}

        def forward_backward():
            return engine.train_step(batch).loss

    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward()
        optimizer.step()
        return None if loss is None else loss.detach()

    for _ in range(setting["warmup"]):
        step()
    steps = []  # (wall seconds, this process's CPU seconds, the machine's busy CPU seconds) per step
    for _ in range(setting["steps"]):
        dist.barrier()
        start, cpu, busy = time.perf_counter(), time.process_time(), machine_busy_seconds()
        loss = step()
        dist.barrier()
        steps.append((time.perf_counter() - start, time.process_time() - cpu, machine_busy_seconds() - busy))
    return dict(steps=steps, loss=None if loss is None else loss.item())


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes, plus time stolen by a hypervisor)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------- driver


def measure(setting: dict, runs: list[dict]) -> list[dict]:
    """Runs every configuration `repeats` times, in turn (rotating the order), in fresh processes.

    A step's time is the slowest rank's. Other programs on the machine are measured, not guessed: a step's
    foreign load is the machine's busy CPU time minus our ranks' CPU time, over the step's wall time (in
    cores). Steps with a foreign load under `quiet_cores` are quiet; a configuration's tokens/s comes from
    its fastest quiet step (from its fastest step if none was quiet), and the median is recorded too."""
    steps = {run["name"]: [] for run in runs}  # (wall s, foreign cores) per timed step
    losses = {}
    for repeat in range(setting["repeats"]):
        shift = repeat % len(runs)
        for run in runs[shift:] + runs[:shift]:
            per_rank = run_distributed(_train, run["pp"] * run["dp"], run, setting, timeout_s=300.0)
            for ranks in zip(*(r["steps"] for r in per_rank)):
                wall = max(w for w, _, _ in ranks)
                foreign = max(0.0, ranks[0][2] - sum(c for _, c, _ in ranks)) / wall
                steps[run["name"]].append((wall, foreign))
            losses[run["name"]] = [r["loss"] for r in per_rank if r["loss"] is not None]
            recent = steps[run["name"]][-setting["steps"]:]
            print(f"  repeat {repeat + 1}/{setting['repeats']}  {run['name']:<22} step s (foreign cores) "
                  + " ".join(f"{w:.3f} ({f:.1f})" for w, f in recent), file=sys.stderr, flush=True)

    rows, reference = [], None
    for run in runs:
        tokens = setting["rows"] * setting["seq_len"] * run["dp"]  # per step, all replicas
        processes = run["pp"] * run["dp"]
        quiet = [w for w, f in steps[run["name"]] if f < setting["quiet_cores"]]
        times = quiet or [w for w, _ in steps[run["name"]]]
        row = dict(
            **run, processes=processes, tokens_per_step=tokens, step_s=min(times),
            step_s_median=statistics.median(times), quiet_steps=len(quiet), steps=len(steps[run["name"]]),
            foreign_cores_mean=statistics.mean(f for _, f in steps[run["name"]]),
            tokens_per_s=tokens / min(times), tokens_per_s_median=tokens / statistics.median(times),
            steps_all=steps[run["name"]], last_losses=losses[run["name"]],
        )
        reference = reference or row
        row["efficiency"] = row["tokens_per_s"] / (min(processes, cores()) * reference["tokens_per_s"])
        row["efficiency_median"] = row["tokens_per_s_median"] / (
            min(processes, cores()) * reference["tokens_per_s_median"])
        rows.append(row)
    return rows


def ratios(rows: list[dict], microbatch_sizes: list[int]) -> dict:
    by_name = {row["name"]: row for row in rows}
    sample_cost, sample_cost_median, efficiency_pp2, efficiency_pp2_median = {}, {}, {}, {}
    for m in microbatch_sizes:
        fixed, sample = by_name[f"pp2 dp2 mb{m} fixed"], by_name[f"pp2 dp2 mb{m} sample"]
        sample_cost[str(m)] = 1.0 - sample["tokens_per_s"] / fixed["tokens_per_s"]
        sample_cost_median[str(m)] = 1.0 - sample["tokens_per_s_median"] / fixed["tokens_per_s_median"]
        efficiency_pp2[str(m)] = by_name[f"pp2 dp1 mb{m}"]["efficiency"]
        efficiency_pp2_median[str(m)] = by_name[f"pp2 dp1 mb{m}"]["efficiency_median"]
    return dict(
        sample_vs_fixed_cost=sample_cost,  # 1 - sample/fixed tokens/s, pp=2 x dp=2; > 0: sample is slower
        sample_vs_fixed_cost_median=sample_cost_median,
        pp2_dp1_efficiency=efficiency_pp2,
        pp2_dp1_efficiency_median=efficiency_pp2_median,
        targets=dict(
            sample_vs_fixed_cost_max=0.03, pp2_dp1_efficiency_min=0.8,
            sample_cost_met={m: c <= 0.03 for m, c in sample_cost.items()},
            pp2_dp1_efficiency_met={m: e >= 0.8 for m, e in efficiency_pp2.items()},
        ),
    )


def machine() -> dict:
    return dict(
        cores=cores(), cpu_count=os.cpu_count(), processor=_cpu_name(), platform=platform.platform(),
        python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
        threads_per_process=1,
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def wait_for_quiet(max_load: float, max_wait_s: float, poll_s: float = 25.0) -> float:
    """Waits (at most ``max_wait_s``) until the 1-minute load average is below ``max_load`` and other programs
    used under half a core over the last 5 seconds; returns the load average then."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy = machine_busy_seconds()
        time.sleep(5.0)
        busy = (machine_busy_seconds() - busy) / 5.0
        load = os.getloadavg()[0]
        if (load < max_load and busy < 0.5) or time.monotonic() > deadline:
            return load
        print(f"load average {load:.2f}, {busy:.1f} cores busy: waiting {poll_s:.0f} s", file=sys.stderr,
              flush=True)
        time.sleep(poll_s)


def print_table(rows: list[dict], summary: dict) -> None:
    print(f"{'configuration':<22} {'procs':>5} {'step s':>7} {'tokens/s':>9} {'efficiency':>10} "
          f"{'| median: tokens/s':>18} {'efficiency':>10} {'| quiet steps':>13} {'foreign cores':>13}")
    for row in rows:
        print(f"{row['name']:<22} {row['processes']:>5} {row['step_s']:>7.3f} {row['tokens_per_s']:>9.0f} "
              f"{row['efficiency']:>10.3f} {row['tokens_per_s_median']:>18.0f} "
              f"{row['efficiency_median']:>10.3f} {row['quiet_steps']:>8}/{row['steps']:<4} "
              f"{row['foreign_cores_mean']:>13.2f}")
    print()
    for m, cost in summary["sample_vs_fixed_cost"].items():
        print(f"microbatch {m}: sample routing costs {100 * cost:+.1f}% against fixed (target <= 3%; median "
              f"{100 * summary['sample_vs_fixed_cost_median'][m]:+.1f}%), pp2 x dp1 efficiency "
              f"{summary['pp2_dp1_efficiency'][m]:.3f} (target >= 0.8; median "
              f"{summary['pp2_dp1_efficiency_median'][m]:.3f})")


def check_structure(result: dict, microbatch_sizes: list[int]) -> None:
    """What the quick mode (and its test) asserts about the output."""
    names = [row["name"] for row in result["rows"]]
    assert names == [run["name"] for run in configurations(microbatch_sizes)], names
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and row["efficiency"] > 0 and row["step_s"] > 0, row
        assert all(math.isfinite(loss) for loss in row["last_losses"]), row
    assert result["rows"][0]["efficiency"] == 1.0
    assert set(result["summary"]["sample_vs_fixed_cost"]) == {str(m) for m in microbatch_sizes}
    assert result["machine"]["cores"] >= 1


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run that checks the output")
    parser.add_argument("--output", default=RESULTS, help="where to write the JSON (default: %(default)s)")
    parser.add_argument("--repeats", type=int, help="override the number of alternated repeats")
    parser.add_argument("--steps", type=int, help="override the number of timed steps")
    parser.add_argument("--max-load", type=float, default=None,
                        help="first wait until the 1-minute load average is below this (polls every 30 s)")
    parser.add_argument("--max-wait", type=float, default=2400, help="longest wait for --max-load, seconds")
    parser.add_argument("--stage-boundaries", type=int, nargs="+", default=None,
                        help="first layer of stages 1.. (default: split_model's even split)")
    args = parser.parse_args(argv)

    mode = "quick" if args.quick else "full"
    setting = dict(SETTINGS[mode])
    setting["repeats"] = args.repeats or setting["repeats"]
    setting["steps"] = args.steps or setting["steps"]
    setting["stage_boundaries"] = args.stage_boundaries
    if args.max_load is not None:
        wait_for_quiet(args.max_load, args.max_wait)
    load_before = os.getloadavg()
    runs = configurations(setting["microbatch_sizes"])
    start = time.monotonic()
    rows = measure(setting, runs)
    summary = ratios(rows, setting["microbatch_sizes"])
    config = llama_config(setting["model"], setting["seq_len"])
    with torch.device("meta"):
        parameters = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    result = dict(
        benchmark="pipeline_throughput", mode=mode, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        machine=machine(),
        load_average=dict(before=list(load_before), after=list(os.getloadavg())),
        model=dict(**setting["model"], parameters=parameters, tie_word_embeddings=False, attention="sdpa",
                   dtype="float32", stage_boundaries=args.stage_boundaries or "even (split_model default)"),
        setup=dict(rows_per_replica=setting["rows"], seq_len=setting["seq_len"], optimizer="AdamW",
                   warmup_steps=setting["warmup"], timed_steps=setting["steps"], repeats=setting["repeats"],
                   statistic="fastest quiet step over all repeats (median also given)",
                   quiet_cores=setting["quiet_cores"],
                   step="forward + backward + AdamW step", wall_s=time.monotonic() - start),
        rows=rows, summary=summary,
    )
    print_table(rows, summary)
    print(f"\nload average (1, 5, 15 min) before the run: {' '.join(f'{x:.2f}' for x in load_before)}; "
          f"{cores()} cores; {parameters / 1e6:.2f}M parameters; wall {result['setup']['wall_s']:.0f} s")
    if args.quick:
        check_structure(result, setting["microbatch_sizes"])
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
