"""The GPU-only paths, checked on a machine with CUDA: one line per check, PASS / FAIL / SKIP.

    bash benchmarks/gpu_check.sh                 # everything this machine's GPUs allow
    python benchmarks/gpu_check.py --device cpu  # the same checks on CPU processes (gloo): keeps the script
    honest

One GPU: a pp=1 run in bf16 with the outer state offloaded (where every tensor lives, that the loss falls,
that slow weights and momentum stay in pinned CPU memory, also after a resume), and the export (one checkpoint
that reloads and reproduces the trained stage's logits), and packed rows under sdpa and flash-attention
against each sequence alone. Two GPUs or more: pp=2 with the 1f1b schedule and
messages of 16 MiB and more (the size at which NCCL's sends wait for their receiver: the schedule's batching
is what keeps it from deadlocking), then a rank killed mid-training, which the other must report, naming it,
within p2p_timeout. Writes benchmarks/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
# The package from this copy of the tree, installed or not (a device machine gets a bare copy: the ignored
# *.egg-info of an editable install is not in it); the children it launches get it through PYTHONPATH.
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

RESULTS = os.path.join(BENCH_DIR, "results", "gpu_check.json")
CHECKS = ("single", "packed", "pipeline", "tied")
CHILD_TIMEOUT = 900  # seconds one launched check may take


def run_children(
    commands: list[list[str]], envs: list[dict], timeout: float
) -> tuple[list[int | None], list[str]]:
    """Starts each command in a session of its own and waits for all of them at most ``timeout`` seconds in
    all; returns their exit codes (``None``: killed at the timeout) and outputs. A command still running then
    is killed with its whole process group (torchrun's workers, a hung rank's threads): nothing is left on
    the GPUs."""
    procs = [
        subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for command, env in zip(commands, envs)
    ]
    deadline, codes, logs = time.monotonic() + timeout, [], []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            codes.append(proc.returncode)
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            codes.append(None)
        logs.append(out or "")
    return codes, logs


def _model_config(hidden: int, layers: int, vocab: int = 512):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def _corpus(rows: int, seq: int, vocab: int = 512):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    # A learnable sequence: each token predicts the next (t -> t + 1), so the loss must fall.
    starts = torch.randint(0, vocab, (rows, 1), generator=g)
    ids = ((starts + torch.arange(seq)) % vocab).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _args(out: str, device: str, **overrides):
    from hf_noloco.config import NoLoCoConfig

    settings = dict(
        output_dir=out,
        per_device_train_batch_size=8,
        microbatch_size=4,
        learning_rate=3e-3,
        warmup_steps=0,
        lr_scheduler_type="constant",
        max_steps=12,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=device == "cpu",
        bf16=device == "cuda",
        seed=0,
    )
    settings.update(overrides)
    return NoLoCoConfig(**settings)


# ------------------------------------------------------------------------------------------- one process


def single_process_checks(device: str, out: str) -> list[tuple[str, bool, str]]:
    """pp=1: placement, bf16, offload, resume, export. Returns (check, passed, detail) rows."""
    from transformers import AutoModelForCausalLM

    from hf_noloco.trainer import NoLoCoTrainer

    rows = []
    data = _corpus(64, 128)
    run = dict(
        outer_optimizer="diloco", inner_steps=4, offload_outer_state=True, save_strategy="steps", save_steps=8
    )
    trainer = NoLoCoTrainer(_model_config(256, 2), _args(out, device, **run), train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    stage_device = {p.device.type for p in trainer.model.parameters()}
    rows.append(("pp=1 run", losses[-1] < 0.85 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"))
    rows.append(("stage on the device", stage_device == {device}, f"parameters on {sorted(stage_device)}"))
    inner = {t.device.type for state in trainer.optimizer.state.values() for t in state.values() if t.dim()}
    rows.append(("inner optimizer state beside its parameters", inner == {device}, f"on {sorted(inner)}"))
    pinned = device == "cuda"
    kept = trainer.outer.outer_state
    state = kept.phi_flat + kept.delta_flat + kept.wire.error
    outer = {(t.device.type, t.is_pinned()) for t in state}
    rows.append(("offloaded outer state", outer == {("cpu", pinned)}, f"(device, pinned) = {sorted(outer)}"))
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
        rows.append(("bf16 autocast", trainer.args.bf16, f"peak GPU memory {peak:.0f} MiB"))
    resumed = NoLoCoTrainer(
        _model_config(256, 2), _args(out, device, **{**run, "max_steps": 10}), train_dataset=data
    )
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-8"))
    kept = resumed.outer.outer_state
    state = kept.phi_flat + kept.delta_flat + kept.wire.error
    outer = {(t.device.type, t.is_pinned()) for t in state}
    rows.append(("offloaded outer state after a resume", outer == {("cpu", pinned)}, f"{sorted(outer)}"))

    export = os.path.join(out, "export")
    resumed.save_model(export)
    model = AutoModelForCausalLM.from_pretrained(export).to(device)
    ids = torch.tensor([data[0]["input_ids"][:64]], device=device)
    with torch.no_grad():
        expected = resumed.model(ids).float()
        got = model(ids).logits.float()
    error = (got - expected).abs().max().item()
    rows.append(("export reloads and reproduces the stage's logits", error < 1e-3, f"max |diff| {error:.2e}"))
    # A plain `python` process sees every GPU: the Trainer's own batch would be per-device rows x GPUs.
    per_device = resumed.args.per_device_train_batch_size
    seen = next(iter(resumed.get_train_dataloader()))["input_ids"].shape[0]
    visible = torch.cuda.device_count() if device == "cuda" else 0
    detail = f"{seen} rows (per_device_train_batch_size {per_device}; {visible} GPUs visible)"
    rows.append(("a batch is per_device_train_batch_size rows", seen == per_device, detail))
    resumed.end()
    return rows


def packed_rows_checks(device: str) -> list[tuple[str, bool | None, str]]:
    """Packed rows (position ids restarting at each sequence, no mask) through a stage, against the model on
    each sequence alone: sdpa (a block-diagonal mask), and flash-attention where installed (the stage runs
    the microbatch as one flat row, whose positions its variable-length kernels read)."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    from hf_noloco.engine.partition import split_model

    lengths = [[37, 20, 50, 21], [64, 40, 24]]  # each row: 128 tokens
    ids = torch.randint(3, 512, (2, 128), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths], device=device)
    dtype, tolerance = (torch.bfloat16, 3e-2) if device == "cuda" else (torch.float32, 1e-4)
    rows = []
    for impl in ("sdpa", "flash_attention_2"):
        if impl.startswith("flash") and (device != "cuda" or importlib.util.find_spec("flash_attn") is None):
            rows.append((f"packed rows under {impl}", None, "needs CUDA and the flash_attn package"))
            continue
        config = _model_config(256, 2)
        config._attn_implementation = impl
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(device, dtype).eval()
        stage = split_model(model, 0, 1)
        with torch.no_grad():
            packed = stage(ids, position_ids=positions).float()
            error, scale = 0.0, 0.0
            for r, row in enumerate(lengths):
                start = 0
                for n in row:
                    alone = model(input_ids=ids[r : r + 1, start : start + n]).logits.float()[0]
                    error = max(error, (packed[r, start : start + n] - alone).abs().max().item())
                    scale = max(scale, alone.abs().max().item())
                    start += n
        relative = error / max(scale, 1e-9)
        name = str(dtype).removeprefix("torch.")
        detail = f"max |diff| {error:.2e} ({relative:.1e} of the largest logit), {name}"
        rows.append((f"packed rows under {impl} equal each sequence alone", relative < tolerance, detail))
    return rows


# ------------------------------------------------------------------------------------------ several ranks


def pipeline_worker(out: str, device: str, kill_rank: int | None) -> None:
    """One rank of a pp=2 run (under torchrun). With ``kill_rank``, that rank kills itself at step 3."""
    from transformers import TrainerCallback

    from hf_noloco.trainer import NoLoCoTrainer

    world = int(os.environ["WORLD_SIZE"])
    # 16 MiB messages on a GPU (bf16: rows 8 x 1024 tokens x hidden 1024 x 2 bytes); small ones on CPU.
    hidden, seq, micro = (1024, 1024, 8) if device == "cuda" else (64, 64, 2)
    routing = "sample" if world >= 4 else "fixed"
    args = _args(
        out,
        device,
        pipeline_stages=2,
        per_device_train_batch_size=4 * micro,
        microbatch_size=micro,
        pipeline_schedule="1f1b",
        routing=routing,
        outer_optimizer="local",
        max_steps=6,
        p2p_timeout=10,
    )
    trainer = NoLoCoTrainer(_model_config(hidden, 4), args, train_dataset=_corpus(64 * micro, seq))

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3 and trainer.mesh.rank == kill_rank:
                print(f"GPU_CHECK_KILLED_AT {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    class Stall(TrainerCallback):
        """Wall time against GPU time per step: a host that never blocks keeps the GPU busy through it."""

        def __init__(self):
            self.steps = []

        def on_step_begin(self, args, state, control, **kwargs):
            if device == "cuda":
                self.begin, self.wall = torch.cuda.Event(enable_timing=True), time.monotonic()
                self.begin.record()

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                end.synchronize()
                self.steps.append(((time.monotonic() - self.wall) * 1e3, self.begin.elapsed_time(end)))

    stall = Stall()
    trainer.add_callback(Kill())
    trainer.add_callback(stall)
    start = time.monotonic()
    try:
        trainer.train()
    except Exception:
        print(f"GPU_CHECK_RAISED_AT {time.time():.3f}", flush=True)
        raise
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.mesh.rank == 0:
        record = {"losses": losses, "seconds": time.monotonic() - start}
        if stall.steps:
            walls, gpus = sorted(w for w, _ in stall.steps[1:]), sorted(g for _, g in stall.steps[1:])
            record["stall"] = {"wall_ms": walls[len(walls) // 2], "gpu_ms": gpus[len(gpus) // 2]}
        print(f"GPU_CHECK_RESULT {json.dumps(record)}", flush=True)
    trainer.end()


def tied_diloco_worker(out: str, device: str) -> None:
    """One rank of DiLoCo dp 4 x pp 2 with tied embeddings (under torchrun, 8 ranks): the two copies of the
    tied matrix (stage 0's embeddings, stage 1's lm_head) are compared after every outer step."""
    from transformers import TrainerCallback

    from hf_noloco.trainer import NoLoCoTrainer

    config = _model_config(256, 4)
    config.tie_word_embeddings = True
    args = _args(out, device, pipeline_stages=2, outer_optimizer="diloco", inner_steps=2, max_steps=8)
    trainer = NoLoCoTrainer(config, args, train_dataset=_corpus(256, 128))
    compared = []

    class Compare(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 2 == 0:  # an outer step ended this step
                trainer.parts.tied.check_equal()  # raises, naming both ranks, if the copies differ
                compared.append(state.global_step)

    trainer.add_callback(Compare())
    trainer.train()
    if trainer.mesh.rank == 0:
        print(f"GPU_CHECK_TIED {json.dumps({'compared_after_steps': compared})}", flush=True)
    trainer.end()


def tied_diloco_check(device: str, out: str) -> list[tuple[str, bool, str]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8", __file__]
    command += ["--worker", "tied-diloco", "--device", device, "--out", os.path.join(out, "tied")]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    [code], [log] = run_children([command], [env], CHILD_TIMEOUT)
    marks = _marks(log, "GPU_CHECK_TIED ")
    name = "DiLoCo dp 4 x pp 2, tied embeddings: the copies equal after every outer step"
    if code == 0 and marks:
        steps = json.loads(log.split("GPU_CHECK_TIED ", 1)[1].splitlines()[0])["compared_after_steps"]
        return [(name, steps == [2, 4, 6, 8], f"compared after steps {steps}")]
    why = "timed out: killed with its process group" if code is None else f"exit {code}"
    return [(name, False, f"{why}: {log[-1500:]}")]


def multi_process_checks(device: str, nproc: int, out: str) -> list[tuple[str, bool, str]]:
    rows = []
    base = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        __file__,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    [code], [log] = run_children(
        [[*base, "--worker", "--device", device, "--out", os.path.join(out, "pp2")]], [env], CHILD_TIMEOUT
    )
    result = [line for line in log.splitlines() if line.startswith("GPU_CHECK_RESULT ")]
    if code == 0 and result:
        record = json.loads(result[0].split(" ", 1)[1])
        first, last = record["losses"][0], record["losses"][-1]
        detail = f"{nproc} ranks, 6 steps in {record['seconds']:.1f} s, loss {first:.3f} -> {last:.3f}"
        rows.append(("pp=2 1f1b with large messages completes", True, detail))
        if record.get("stall"):
            stall = record["stall"]
            detail = f"median per step: wall {stall['wall_ms']:.1f} ms, GPU {stall['gpu_ms']:.1f} ms"
            rows.append(("host stall per step (CUDA events against wall time)", True, detail))
    else:
        why = "timed out: killed with its process group" if code is None else f"exit {code}"
        rows.append(("pp=2 1f1b with large messages completes", False, f"{why}: {log[-1500:]}"))
    # Plain processes, no launcher agent (which would stop the survivors itself): their own waits must find
    # the dead peer and say which it is.
    from hf_noloco.launch.local_launch import free_port

    port, start, commands, envs = free_port(), time.monotonic(), [], []
    for rank in range(nproc):
        rank_env = dict(
            env,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        command = [
            sys.executable,
            __file__,
            "--worker",
            "--device",
            device,
            "--out",
            os.path.join(out, "kill"),
            "--kill-rank",
            "1",
        ]
        commands.append(command)
        envs.append(rank_env)
    codes, logs = run_children(commands, envs, CHILD_TIMEOUT)
    seconds = time.monotonic() - start
    survivors = [r for r in range(nproc) if r != 1]
    named = all("rank 1 (stage 1, replica 0)" in logs[r] for r in survivors)
    failed = all(codes[r] not in (0, None) for r in survivors)
    killed = [float(t) for log in logs for t in _marks(log, "GPU_CHECK_KILLED_AT ")]
    raised = [float(t) for r in survivors for t in _marks(logs[r], "GPU_CHECK_RAISED_AT ")]
    named_after = f", named {max(raised) - killed[0]:.1f} s after the kill" if killed and raised else ""
    rows.append(
        (
            "a killed rank ends the job, named by every survivor",
            failed and named,
            f"exit codes {codes} after {seconds:.0f} s{named_after}",
        )
    )
    return rows


def _marks(log: str, prefix: str) -> list[str]:
    return [line.split(prefix, 1)[1].split()[0] for line in log.splitlines() if prefix in line]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--out", help="working folder (default: a temporary one)")
    parser.add_argument("--worker", nargs="?", const="pipeline", help=argparse.SUPPRESS)
    parser.add_argument("--kill-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-save", action="store_true", help="do not write benchmarks/results/gpu_check.json"
    )
    parser.add_argument("--out-json", default=RESULTS, help="where the results go")
    parser.add_argument(
        "--only",
        default=",".join(CHECKS),
        help=f"the checks to run, comma-separated, of {', '.join(CHECKS)} (default: all)",
    )
    args = parser.parse_args()
    only = set(args.only.split(","))
    if only - set(CHECKS):
        parser.error(f"--only: unknown checks {sorted(only - set(CHECKS))}; choose from {', '.join(CHECKS)}")
    if args.worker == "tied-diloco":
        tied_diloco_worker(args.out, args.device)
        return 0
    if args.worker:
        pipeline_worker(args.out, args.device, args.kill_rank)
        return 0
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        print("SKIP every check: no CUDA device (run with --device cpu to check the same paths on CPU)")
        return 0
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = args.out or tmp
            if "single" in only:
                single = os.path.join(out, "single")
                rows += _guarded("pp=1 checks", single_process_checks, args.device, single)
            if "packed" in only:
                rows += _guarded("packed rows", packed_rows_checks, args.device)
            if "pipeline" in only and (args.device == "cpu" or gpus >= 2):
                nproc = 2 if args.device == "cpu" else (4 if gpus >= 4 else 2)
                rows += _guarded("pp=2 and a killed rank", multi_process_checks, args.device, nproc, out)
            elif "pipeline" in only:
                rows.append(("pp=2 and a killed rank", None, "need 2 GPUs or more"))
            if "tied" in only and args.device == "cuda" and gpus >= 8:
                rows += _guarded("tied DiLoCo dp 4 x pp 2", tied_diloco_check, args.device, out)
            elif "tied" in only:  # on gloo, tests/distributed/test_never_silently_wrong.py checks the copies
                rows.append(("tied DiLoCo dp 4 x pp 2", None, "need 8 GPUs"))
    finally:  # every check reported and recorded, whatever happened to the others
        for check, passed, detail in rows:
            print(
                f"{'SKIP' if passed is None else 'PASS' if passed else 'FAIL'} {check}: {detail}", flush=True
            )
        if not args.no_save:
            write_results(args.out_json, args.device, gpus, rows)
    return 0 if all(p is not False for _, p, _ in rows) else 1


def _guarded(name: str, check, *args) -> list[tuple[str, bool | None, str]]:
    """The rows of ``check``, or one FAIL row naming what it raised."""
    try:
        return check(*args)
    except Exception as exc:  # noqa: BLE001 - a check that fails is reported, never fatal to the others
        return [(name, False, f"{type(exc).__name__}: {str(exc)[-1500:]}")]


def write_results(path: str, device: str, gpus: int, rows) -> None:
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    record = {
        "device": name,
        "gpus": gpus,
        "torch": torch.__version__,
        "checks": [{"check": c, "passed": p, "detail": d} for c, p, d in rows],
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
