"""Fault benchmark: what losing one rank costs a dp = 4 x pp = 2 NoLoCo run.

The same seeded run four times (8 gloo processes, one thread each):

- ``uninterrupted``: no fault, one job under ``torchrun --standalone --nproc_per_node 8 --max-restarts 1``;
- ``stop+restart``: the same job, where one rank SIGKILLs itself as step ``kill_step`` begins (first attempt
  only). The launcher stops the other workers and starts all 8 again; they resume from the newest intact
  checkpoint by themselves;
- ``continue, uninterrupted``: ``on_replica_loss="continue"``, launched as four ``python -m
  hf_noloco.column_launch`` (one per replica column, column 0 hosting the store), no fault: what the mode's
  per-step fence costs;
- ``continue``: the same, with the same rank killed at the same step. Its column is dropped; the six other
  processes train on to ``max_steps`` with three replicas.

``--join`` runs a third arm instead of the restart: ``continue + join``, the ``continue`` run whose lost
column is launched again with ``column_launch --join`` as soon as the victim is dead. Reported: the time from
that launch to the replacement's first trained step (and its start-up alone), the bytes copied, the
survivors' pause (the step during which the replacement was admitted, minus the median step), the tokens never
trained and the final perplexity against the uninterrupted and the continue-only runs of the same invocation.

Reported for ``stop+restart``, against the uninterrupted job:

- tokens lost: the steps the first attempt had finished after its last checkpoint, trained again (times the
  tokens of one step over all replicas);
- wall time lost: the job's wall time minus the uninterrupted job's, split into the restart (the kill to the
  restarted job's first step: the launcher's reaction, new processes, process group, checkpoint verification
  and loading) and the recomputation of the lost steps;
- final validation perplexity of both (a resume is exact, so they should be equal), and whether the losses the
  restarted job logged after the kill are the uninterrupted job's.

Reported for ``continue``: the tokens not trained (the interrupted step on the ranks that skipped it, and the
lost replica's share of every later step), the wall time against both uninterrupted jobs, the time from the
kill to the end of the interrupted step (detection, agreement, new process groups), and the final validation
perplexity (three replicas train the last steps, so it need not equal the uninterrupted one).

    python benchmarks/faults.py           # 96 steps, checkpoints every 32, rank 5 killed at step 56 (~10 min)
    python benchmarks/faults.py --quick   # 16 steps (~4 min): checks the machinery
    python benchmarks/faults.py --exit-statuses 10   # the killed-worker column launch 10 times: statuses
    python benchmarks/faults.py --join    # uninterrupted, continue, continue + join (the replacement at once)

Writes benchmarks/results/faults.json (faults_quick.json with --quick). The model, corpus and optimizer
settings are the convergence study's (benchmarks/studies/factorial.yaml, arm noloco-H8-a0.3).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from _common import BUILTIN, RESULTS_DIR, count_parameters, load_corpus, machine

DP, PP = 4, 2
MODEL = {  # the convergence study's 1.25M-parameter Llama
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
BLOCK, GLOBAL_BATCH, EVAL_BLOCKS = 64, 32, 128
SETTINGS = {
    "full": {"max_steps": 96, "save_steps": 32, "kill_step": 56, "victim": 5},
    "quick": {"max_steps": 16, "save_steps": 8, "kill_step": 12, "victim": 5},
}


# ------------------------------------------------------------------------------------------------ worker


def _process_start() -> float:
    """When this process started (wall clock, 10 ms resolution): its start in ticks since boot (/proc)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def worker(plan_path: str) -> None:
    """One rank of one attempt (torchrun runs this): trains, evaluates, and records its timeline."""
    import datasets
    import torch
    import torch.distributed as dist
    import transformers
    from transformers import LlamaConfig, TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from hf_noloco.config import NoLoCoConfig
    from hf_noloco.resilience import elastic
    from hf_noloco.resilience.joining import is_joining
    from hf_noloco.resilience.membership import ReplicaDropped
    from hf_noloco.trainer import NoLoCoTrainer

    with open(plan_path) as f:
        plan = json.load(f)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    train = datasets.load_from_disk(plan["train"])
    eval_ = datasets.load_from_disk(plan["eval"])
    steps = plan["max_steps"]
    args = NoLoCoConfig(
        output_dir=plan["out"],
        pipeline_stages=PP,
        outer_optimizer="noloco",
        inner_steps=8,
        outer_lr=0.3,
        outer_momentum=0.7,
        routing="sample",
        per_device_train_batch_size=GLOBAL_BATCH // DP,
        microbatch_size=4,
        per_device_eval_batch_size=16,
        learning_rate=2e-3,
        weight_decay=0.01,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=max(steps // 10, 1),
        max_grad_norm=1.0,
        max_steps=steps,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="steps",
        save_steps=plan["save_steps"],
        report_to="none",
        disable_tqdm=True,
        seed=1,
        data_seed=1,
        p2p_timeout=60,
        on_replica_loss="continue" if plan.get("continue") else "stop",
    )
    trainer = NoLoCoTrainer(LlamaConfig(**MODEL, tie_word_embeddings=False), args, train_dataset=train)
    trainer.remove_callback(PrinterCallback)
    rank, restarted = dist.get_rank(), elastic.is_restart()
    timeline = {
        "attempt": 2 if restarted else 1,
        "process_start": _process_start(),  # before Python's imports
        "trainer_ready": time.time(),  # imports, data, process group and model built
        "step_end": {},
    }

    class Timeline(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            timeline["train_begin"], timeline["start_step"] = time.time(), state.global_step

        def on_step_begin(self, args, state, control, **kwargs):
            strike = plan["fault"] and not restarted and rank == plan["victim"] and not is_joining()
            if strike and state.global_step + 1 == plan["kill"]:
                with open(os.path.join(plan["out"], "killed_at.json"), "w") as f:
                    json.dump({"time": time.time(), "step": plan["kill"], "rank": rank}, f)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_step_end(self, args, state, control, **kwargs):
            timeline["step_end"][state.global_step] = time.time()

    trainer.add_callback(Timeline())
    try:
        trainer.train()
    except ReplicaDropped:  # continue: the killed rank's column mate leaves; the others train on
        trainer.close_watchers()
        os._exit(0)
    timeline["train_end"] = time.time()
    timeline["tokens_seen"] = trainer.tokens_seen
    timeline["joins"] = trainer.parts.live_replicas.joins
    metrics = trainer.evaluate(eval_)
    if is_joining():  # the replacement column's timeline (its first step, what it received)
        with open(os.path.join(plan["out"], f"timeline-join-rank{rank}.json"), "w") as f:
            json.dump(timeline, f)
    if rank == 0:
        timeline["eval_perplexity"] = metrics["eval_perplexity"]
        timeline["losses"] = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        with open(os.path.join(plan["out"], f"timeline-attempt{timeline['attempt']}.json"), "w") as f:
            json.dump(timeline, f)
    trainer.end()


# ------------------------------------------------------------------------------------------------ driver


def run_job(plan: dict, work: str, name: str) -> dict:
    """One torchrun job; returns its wall time, exit status and rank 0's timelines."""
    out = os.path.join(work, name)
    os.makedirs(out)
    plan = dict(plan, out=out)
    plan_path = os.path.join(work, f"{name}.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    command += [str(DP * PP)]
    command += ["--max-restarts", "1", os.path.abspath(__file__), "--worker", plan_path]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["HF_NOLOCO_RUN_SECRET"] = secrets.token_hex(32)  # the job's own (docs/security.md)
    load_before = os.getloadavg()[0]
    started = time.time()
    with open(os.path.join(work, f"{name}.log"), "w") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
    wall = time.time() - started
    if code != 0:
        raise RuntimeError(f"{name}: torchrun exited {code}; see {work}/{name}.log")
    return _job_record(out, started, wall, load_before)


def _job_record(out: str, started: float, wall: float, load_before: float, **extra) -> dict:
    """What a finished job left in ``out``: rank 0's timeline of each attempt and when the victim died."""
    timelines = {}
    for attempt in (1, 2):
        path = os.path.join(out, f"timeline-attempt{attempt}.json")
        if os.path.exists(path):
            with open(path) as f:
                timelines[attempt] = json.load(f)
    killed = None
    if os.path.exists(os.path.join(out, "killed_at.json")):
        with open(os.path.join(out, "killed_at.json")) as f:
            killed = json.load(f)
    return {
        "wall_s": wall,
        "started": started,
        "load_1min": [load_before, os.getloadavg()[0]],
        **extra,
        "timelines": timelines,
        "killed": killed,
    }


def run_columns_job(plan: dict, work: str, name: str) -> dict:
    """One on_replica_loss="continue" run: a ``hf_noloco.column_launch`` per replica column (column 0 hosts
    the store); returns its wall time, the launches' exit statuses and rank 0's timeline."""
    from hf_noloco.launch.local_launch import free_port

    out = os.path.join(work, name)
    os.makedirs(out)
    plan = dict(plan, out=out, **{"continue": True})
    plan_path = os.path.join(work, f"{name}.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["HF_NOLOCO_RUN_SECRET"] = secrets.token_hex(32)  # the job's own (docs/security.md)
    load_before = os.getloadavg()[0]
    started = time.time()
    launches = []
    for column in range(DP):
        command = [sys.executable, "-m", "hf_noloco.column_launch", "--store", f"127.0.0.1:{port}"]
        command += ["--host-store", "--linger", "2"] if column == 0 else []
        command += ["--column", str(column), "--columns", str(DP), "--stages", str(PP)]
        command += [os.path.abspath(__file__), "--worker", plan_path]
        log = open(os.path.join(work, f"{name}-column{column}.log"), "w")  # noqa: SIM115 - closed below
        launches.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    replacement = None
    if plan.get("join"):  # the lost column's replacement, started as soon as the victim is dead
        killed = os.path.join(out, "killed_at.json")
        while not os.path.exists(killed) and all(proc.poll() is None for proc, _ in launches[1:]):
            time.sleep(0.05)
        column = plan["victim"] // PP
        command = [sys.executable, "-m", "hf_noloco.column_launch", "--store", f"127.0.0.1:{port}", "--join"]
        command += ["--column", str(column), "--columns", str(DP), "--stages", str(PP)]
        command += [os.path.abspath(__file__), "--worker", plan_path]
        log = open(os.path.join(work, f"{name}-join{column}.log"), "w")  # noqa: SIM115 - closed below
        replacement = time.time()
        launches.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in launches:
        codes.append(proc.wait(timeout=1800))
        log.close()
    record = _job_record(out, started, time.time() - started, load_before, launch_exit_codes=codes)
    if replacement is not None:
        record["replacement_launched"] = replacement
        record["join_timelines"] = {}
        for rank in range(plan["victim"] // PP * PP, plan["victim"] // PP * PP + PP):
            with open(os.path.join(out, f"timeline-join-rank{rank}.json")) as f:
                record["join_timelines"][rank] = json.load(f)
    return record


def summarize_join(plain: dict, kept: dict, joined: dict, tokens_per_step: int) -> dict:
    """The continue + join run against the uninterrupted torchrun job and the continue-only run."""
    final, straight = joined["timelines"][1], plain["timelines"][1]
    joiners = joined["join_timelines"]
    first = {r: min(int(k) for k in t["step_end"]) for r, t in joiners.items()}
    first_end = max(t["step_end"][str(first[r])] for r, t in joiners.items())
    join_step = next(iter(first.values())) - 1  # the state the replacement started from
    ends = {int(k): v for k, v in final["step_end"].items()}
    steps = sorted(ends)
    normal = sorted(ends[s] - ends[s - 1] for s in steps[1:] if s - 1 in ends)
    normal_step_s = normal[len(normal) // 2]
    return {
        "killed_rank": joined["killed"]["rank"],
        "killed_at_step": joined["killed"]["step"],
        "launch_exit_codes": joined["launch_exit_codes"],
        "joined_after_step": join_step,
        "launch_to_first_trained_step_s": first_end - joined["replacement_launched"],
        "kill_to_replacement_launch_s": joined["replacement_launched"] - joined["killed"]["time"],
        "replacement_startup_s": min(t["train_begin"] - t["process_start"] for t in joiners.values()),
        "bytes_copied": sum(j["bytes"] for t in joiners.values() for j in t["joins"]),
        "copy_s": max(j["seconds"] for t in joiners.values() for j in t["joins"]),
        "survivors_pause_s": ends[join_step + 1] - ends[join_step] - normal_step_s,
        "median_step_s": normal_step_s,
        "tokens_trained": final["tokens_seen"],
        "tokens_not_trained": tokens_per_step * len(ends) - final["tokens_seen"],
        "wall_time_vs_continue_s": joined["wall_s"] - kept["wall_s"],
        "final_perplexity": final["eval_perplexity"],
        "continue_final_perplexity": kept["timelines"][1]["eval_perplexity"],
        "uninterrupted_final_perplexity": straight["eval_perplexity"],
        "perplexity_ratio": final["eval_perplexity"] / straight["eval_perplexity"],
        "continue_perplexity_ratio": kept["timelines"][1]["eval_perplexity"] / straight["eval_perplexity"],
    }


def summarize_continue(plain: dict, steady: dict, faulty: dict, tokens_per_step: int) -> dict:
    """The continue run against the uninterrupted torchrun job (``plain``) and the uninterrupted continue run
    (``steady``)."""
    final, calm, straight = faulty["timelines"][1], steady["timelines"][1], plain["timelines"][1]
    killed = faulty["killed"]
    step = killed["step"]
    ends = {int(k): v for k, v in final["step_end"].items()}
    normal_step_s = (calm["train_end"] - calm["train_begin"]) / len(calm["step_end"])
    return {
        "killed_rank": killed["rank"],
        "killed_at_step": step,
        "launch_exit_codes": faulty["launch_exit_codes"],
        "steps_run_by_survivors": len(ends),
        "tokens_trained": final["tokens_seen"],
        "tokens_not_trained": tokens_per_step * len(ends) - final["tokens_seen"],
        "tokens_of_the_lost_replica_from_the_kill": (len(ends) - step + 1) * tokens_per_step // DP,
        "kill_to_end_of_interrupted_step_s": ends[step] - killed["time"],
        "normal_step_s": normal_step_s,
        "wall_time_vs_uninterrupted_continue_s": faulty["wall_s"] - steady["wall_s"],
        "wall_time_vs_uninterrupted_torchrun_s": faulty["wall_s"] - plain["wall_s"],
        "continue_overhead_uninterrupted_s": steady["wall_s"] - plain["wall_s"],
        "startup_s_continue_vs_torchrun": [
            calm["train_begin"] - calm["process_start"],
            straight["train_begin"] - straight["process_start"],
        ],
        "after_training_s_continue_vs_torchrun": [  # evaluation, export-free exit, the store's linger
            steady["started"] + steady["wall_s"] - calm["train_end"],
            plain["started"] + plain["wall_s"] - straight["train_end"],
        ],
        "train_time_per_step_continue_vs_torchrun": normal_step_s
        / ((straight["train_end"] - straight["train_begin"]) / len(straight["step_end"])),
        "final_perplexity": final["eval_perplexity"],
        "uninterrupted_continue_final_perplexity": calm["eval_perplexity"],
        "uninterrupted_final_perplexity": straight["eval_perplexity"],
        "perplexity_ratio": final["eval_perplexity"] / straight["eval_perplexity"],
        # The continue mode averages the logged loss in float64 over the live ranks, torchrun's Trainer in
        # float32: equal to rounding (the final perplexities of both uninterrupted runs are identical).
        "losses_before_kill_match_rel_1e-6": all(
            math.isclose(final["losses"][s], straight["losses"][s], rel_tol=1e-6)
            for s in straight["losses"]
            if int(s) < step
        ),
    }


def summarize(plain: dict, faulty: dict, tokens_per_step: int) -> dict:
    final = faulty["timelines"][2]
    straight = plain["timelines"][1]
    killed = faulty["killed"]
    resumed_from = final["start_step"]
    # The first attempt's rank 0 wrote no timeline (it was stopped); its steps are in the restarted job's
    # log: the kill came as step kill_step began, so steps resumed_from+1 .. kill_step-1 were done twice.
    redone = killed["step"] - 1 - resumed_from
    recompute = final["step_end"][str(killed["step"] - 1)] - final["train_begin"] if redone else 0.0
    step_s = (straight["train_end"] - straight["train_begin"]) / len(straight["step_end"])
    after_kill = [s for s in straight["losses"] if int(s) >= killed["step"]]
    return {
        "killed_rank": killed["rank"],
        "killed_at_step": killed["step"],
        "resumed_from_step": resumed_from,
        "steps_lost": redone,
        "tokens_lost": redone * tokens_per_step,
        "wall_time_lost_s": faulty["wall_s"] - plain["wall_s"],
        "restart_s": final["train_begin"] - killed["time"],
        "restart_parts_s": {  # the restart, step by step
            "launcher_stops_and_starts_workers": final["process_start"] - killed["time"],
            "imports_data_process_group_model": final["trainer_ready"] - final["process_start"],
            "checkpoint_verified_and_loaded": final["train_begin"] - final["trainer_ready"],
        },
        "uninterrupted_startup_s": straight["train_begin"] - straight["process_start"],
        "recompute_s": recompute,
        "uninterrupted_step_s": step_s,
        "final_perplexity": final["eval_perplexity"],
        "uninterrupted_final_perplexity": straight["eval_perplexity"],
        "perplexity_ratio": final["eval_perplexity"] / straight["eval_perplexity"],
        "losses_after_kill_identical": all(final["losses"][s] == straight["losses"][s] for s in after_kill),
    }


def exit_statuses(repeats: int) -> None:
    """The per-column launch with a killed worker, ``repeats`` times in a row: every launch's exit status.
    A survivor's launch that exits non-zero (e.g. 134, an abort at interpreter exit) reads as a failed job to
    any scheduler."""
    plan_settings = {"max_steps": 16, "save_steps": 8, "kill": 6, "victim": 5}
    statuses = []
    with tempfile.TemporaryDirectory() as work:
        train, eval_, _ = load_corpus(BUILTIN, BLOCK, MODEL["vocab_size"], EVAL_BLOCKS)
        train.save_to_disk(os.path.join(work, "train"))
        eval_.save_to_disk(os.path.join(work, "eval"))
        plan = dict(plan_settings, train=os.path.join(work, "train"), eval=os.path.join(work, "eval"))
        for repeat in range(repeats):
            record = run_columns_job(dict(plan, fault=True), work, f"continue-{repeat}")
            statuses.append(record["launch_exit_codes"])
            print(f"run {repeat + 1}/{repeats}: launch exit statuses {statuses[-1]}", flush=True)
    victim_column = plan_settings["victim"] // PP
    survivors = [codes[c] for codes in statuses for c in range(DP) if c != victim_column]
    result = {
        "benchmark": "faults-exit-statuses",
        "settings": plan_settings,
        "launch": "python -m hf_noloco.column_launch --column C --columns 4 --stages 2 (x4, column 0 hosts)",
        "statuses": statuses,
        "victim_column_statuses": [codes[victim_column] for codes in statuses],
        "survivor_launches": len(survivors),
        "survivor_launches_nonzero": sum(code != 0 for code in survivors),
        "machine": machine(),
    }
    print(
        f"{result['survivor_launches_nonzero']} of {len(survivors)} survivor launches exited non-zero; the "
        f"victim's column: {result['victim_column_statuses']}"
    )
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, "faults_exit_statuses.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 steps: checks the machinery")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of jobs (uninterrupted, faulty)")
    parser.add_argument("--kill-step", type=int, help="the step at whose start the victim dies")
    parser.add_argument("--victim", type=int, help="the rank killed (rank = replica * 2 + stage)")
    parser.add_argument(
        "--exit-statuses",
        type=int,
        metavar="N",
        help="only run N 'continue' jobs with the kill (16 steps, rank 5 killed at step 6, checkpoints at 8 "
        "and 16, after the loss) and record every launch's exit status: survivors' launches must all exit 0",
    )
    parser.add_argument(
        "--join",
        action="store_true",
        help="only the uninterrupted job, the 'continue' job and 'continue + join' (the killed column's "
        "replacement launched with --join as soon as the victim dies); writes faults_join.json",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker:
        return worker(cli.worker)
    if cli.exit_statuses:
        return exit_statuses(cli.exit_statuses)
    settings = dict(SETTINGS["quick" if cli.quick else "full"])
    if cli.kill_step:
        settings["kill_step"] = cli.kill_step
    if cli.victim is not None:
        settings["victim"] = cli.victim
    tokens_per_step = GLOBAL_BATCH * BLOCK
    with tempfile.TemporaryDirectory() as work:
        train, eval_, _ = load_corpus(BUILTIN, BLOCK, MODEL["vocab_size"], EVAL_BLOCKS)
        train.save_to_disk(os.path.join(work, "train"))
        eval_.save_to_disk(os.path.join(work, "eval"))
        plan = {
            "train": os.path.join(work, "train"),
            "eval": os.path.join(work, "eval"),
            "max_steps": settings["max_steps"],
            "save_steps": settings["save_steps"],
            "kill": settings["kill_step"],
            "victim": settings["victim"],
        }
        if cli.join:
            return join_arm(plan, work, settings, tokens_per_step, cli.quick)
        runs = []
        for repeat in range(cli.repeats):
            plain = run_job(dict(plan, fault=False), work, f"uninterrupted-{repeat}")
            faulty = run_job(dict(plan, fault=True), work, f"stop-restart-{repeat}")
            summary = summarize(plain, faulty, tokens_per_step)
            print(json.dumps(summary, indent=1), flush=True)
            steady = run_columns_job(dict(plan, fault=False), work, f"continue-uninterrupted-{repeat}")
            kept = run_columns_job(dict(plan, fault=True), work, f"continue-{repeat}")
            summary_continue = summarize_continue(plain, steady, kept, tokens_per_step)
            print(json.dumps(summary_continue, indent=1), flush=True)
            runs.append(
                {
                    "summary": summary,
                    "summary_continue": summary_continue,
                    "uninterrupted": plain,
                    "stop_restart": faulty,
                    "continue_uninterrupted": steady,
                    "continue": kept,
                }
            )
    result = {
        "benchmark": "faults",
        **_run_description(settings, tokens_per_step),
        "launch": {
            "stop+restart": "torchrun --standalone --nproc_per_node 8 --max-restarts 1",
            "continue": "python -m hf_noloco.column_launch --column C --columns 4 --stages 2 (x4)",
        },
        "machine": machine(),
        "runs": runs,
    }
    _save(result, "faults_quick.json" if cli.quick else "faults.json")


def join_arm(plan: dict, work: str, settings: dict, tokens_per_step: int, quick: bool) -> None:
    plain = run_job(dict(plan, fault=False), work, "uninterrupted")
    kept = run_columns_job(dict(plan, fault=True), work, "continue")
    joined = run_columns_job(dict(plan, fault=True, join=True), work, "continue-join")
    summary = summarize_join(plain, kept, joined, tokens_per_step)
    print(json.dumps(summary, indent=1), flush=True)
    result = {
        "benchmark": "faults --join",
        **_run_description(settings, tokens_per_step),
        "launch": "python -m hf_noloco.column_launch ... (x4), then --column 2 --join when rank 5 is killed",
        "machine": machine(),
        "summary": summary,
        "runs": {"uninterrupted": plain, "continue": kept, "continue_join": joined},
    }
    _save(result, "faults_join_quick.json" if quick else "faults_join.json")


def _run_description(settings: dict, tokens_per_step: int) -> dict:
    """The mesh, model and settings every result file of this benchmark records."""
    return {
        "mesh": {"dp": DP, "pp": PP, "processes": DP * PP},
        "model": dict(MODEL, parameters=count_parameters(MODEL)),
        "settings": dict(
            settings, tokens_per_step=tokens_per_step, block_size=BLOCK, global_batch=GLOBAL_BATCH
        ),
    }


def _save(result: dict, name: str) -> None:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
