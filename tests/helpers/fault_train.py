"""A tiny 2-stage x 2-replica NoLoCo run with test-only fault hooks, for tests/e2e/test_faults.py.

Run it as a script under a launcher (``torchrun ... fault_train.py OUT``, or plain processes with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), or call :func:`run` in a process whose gloo group is already up.

``FAULT=kind:step:rank`` picks the fault (none if unset; never in workers that a launcher restarted):
    kill-step   SIGKILL in the forward of the second microbatch of ``step``
    kill-outer  SIGKILL inside the outer sync after ``step``, as it starts the exchange with its partner
    kill-save   SIGKILL while writing this rank's shard of checkpoint-``step`` (model written, optimizer not)
    sigterm-agent  SIGTERM to the launcher agent (the parent) in the second microbatch of ``step``
    sigterm-self   SIGTERM to this rank only, at the same moment
    kill-store  SIGKILL to the process hosting the run's store (``STORE_PID``) in ``step``'s first forward
    stop-log    SIGSTOP at the end of ``step``, before the step's logging collectives (a hung machine)
    nan-loss    the stage output of one microbatch of ``step`` becomes NaN (use on the last stage)
    nan-grad    one gradient entry becomes NaN after the backward of ``step``
``ON_REPLICA_LOSS`` (stop|continue), ``MAX_STEPS``, ``EXPORT`` (1: export to OUT/export after training),
``NONFINITE`` (error|skip), ``P2P_TIMEOUT`` (seconds), ``PIPELINE_STAGES`` (2), ``INNER_STEPS`` (3: the outer
steps' period), ``RECORD_STEPS`` (1: record each step's weights and
first row) and ``RESUME`` (1: from the newest intact checkpoint;
any other value: that checkpoint folder) set the run. Each rank writes ``pid-rank{r}`` at start and
``result-rank{r}.pt`` (losses, weights, counters) at the end.
"""

import os
import signal
import sys
import time

import torch
from datasets import Dataset
from transformers import LlamaConfig, TrainerCallback

BLOCK = 32
MAX_STEPS = 8
SAVE_STEPS = 4
INNER_STEPS = 3  # outer steps after steps 3 and 6


def byte_corpus(blocks: int) -> Dataset:
    from pydoc_data.topics import topics

    data = "\n".join(topics[k] for k in sorted(topics)).encode()
    rows = [list(data[i * BLOCK : (i + 1) * BLOCK]) for i in range(blocks)]
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def byte_config():
    return LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def die(sig=signal.SIGKILL):
    print(
        f"fault_train: sending {signal.Signals(sig).name} to myself at monotonic {time.monotonic():.3f}",
        flush=True,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), sig)


class StopAtStepEnd(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            print(f"fault_train: run() returned at monotonic {time.monotonic():.3f} (stopping)", flush=True)
            die(signal.SIGSTOP)


class RecordSteps(TrainerCallback):
    """``RECORD_STEPS=1``: this rank's weights as each step begins, and the first row each step trains (on a
    first stage), for the join test."""

    def __init__(self, trainer):
        self.trainer, self.weights, self.rows = trainer, {}, {}
        training_step = trainer.training_step

        def recording(model, inputs, *args, **kwargs):
            self.rows[trainer.state.global_step + 1] = inputs["input_ids"][0, :8].tolist()
            return training_step(model, inputs, *args, **kwargs)

        trainer.training_step = recording

    def on_step_begin(self, args, state, control, **kwargs):
        self.weights[state.global_step] = {k: v.clone() for k, v in self.trainer.model.state_dict().items()}


class EvaluateAtStep(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_evaluate = True


def install_fault(trainer, rank: int) -> None:
    from hf_noloco.resilience import elastic

    spec = os.environ.get("FAULT")
    if not spec or elastic.is_restart():
        return  # a fault strikes the first attempt only, not the workers a launcher restarts
    kind, step, victim = spec.split(":")
    step, victim = int(step), int(victim)
    if kind == "bug-eval":  # on every rank: a bug raising a RuntimeError that reads like a lost peer's
        import hf_noloco.components.evaluation as evaluation_module

        def broken(*args, **kwargs):
            raise RuntimeError("CUDA error: an NCCL operation timed out (Socket closed)")

        evaluation_module.pooled_eval_loss = broken
        trainer.get_eval_dataloader = lambda *args, **kwargs: []  # the run has no evaluation set
        trainer.add_callback(EvaluateAtStep(step))
        return
    if rank != victim:
        return
    in_step = lambda: trainer.state.global_step == step - 1
    forwards = []

    if kind == "kill-step":

        def hook(module, args):
            if in_step():
                forwards.append(1)
                if len(forwards) == 2:
                    die()

        trainer.model.register_forward_pre_hook(hook)
    elif kind == "nan-loss":

        def hook(module, args, output):
            if in_step() and not forwards:
                forwards.append(1)
                return output * float("nan")

        trainer.model.register_forward_hook(hook)
    elif kind == "nan-grad":
        train_step = trainer.parts.engine.train_step

        def poisoned(batch):
            result = train_step(batch)
            if in_step():
                next(p for p in trainer.model.parameters() if p.grad is not None).grad.view(-1)[0] = float(
                    "nan"
                )
            return result

        trainer.parts.engine.train_step = poisoned
    elif kind == "kill-outer":
        from hf_noloco.outer import noloco as outer

        exchange = outer.exchange

        def die_in_exchange(*args, **kwargs):
            if trainer.state.global_step == step - 1:  # the outer step runs inside optimizer.step()
                die()
            return exchange(*args, **kwargs)

        outer.exchange = die_in_exchange
    elif kind == "kill-save":
        from safetensors.torch import save_file

        from hf_noloco.io.checkpoint_files import rank_folder

        write_rank_state = trainer.parts.checkpointer._write_rank_state

        def half_save(folder):
            if trainer.state.global_step != step:
                return write_rank_state(folder)
            rank_dir = rank_folder(folder, trainer.mesh)
            os.makedirs(rank_dir, exist_ok=True)
            save_file(
                {k: v.contiguous() for k, v in trainer.model.state_dict().items()},
                os.path.join(rank_dir, "model.safetensors"),
            )
            die()

        trainer.parts.checkpointer._write_rank_state = half_save
    elif kind in ("sigterm-agent", "sigterm-self"):  # at the start of `step`'s second microbatch

        def hook(module, args):
            if in_step():
                forwards.append(1)
                if len(forwards) == 2:
                    target = os.getppid() if kind == "sigterm-agent" else os.getpid()
                    print(
                        f"fault_train: SIGTERM to pid {target} at monotonic {time.monotonic():.3f}",
                        flush=True,
                    )
                    os.kill(target, signal.SIGTERM)

        trainer.model.register_forward_pre_hook(hook)
    elif kind == "kill-store":  # the process hosting the run's store (fault_runs.store_process), mid-step

        def hook(module, args):
            if in_step() and not forwards:
                forwards.append(1)
                print(f"fault_train: SIGKILL to the store at monotonic {time.monotonic():.3f}", flush=True)
                os.kill(int(os.environ["STORE_PID"]), signal.SIGKILL)

        trainer.model.register_forward_pre_hook(hook)
    elif kind == "stop-log":
        trainer.add_callback(StopAtStepEnd(step))
    else:
        raise ValueError(f"unknown fault {kind}")


def run(out: str) -> None:
    import torch.distributed as dist

    from hf_noloco.config import NoLoCoConfig
    from hf_noloco.resilience.membership import ReplicaDropped
    from hf_noloco.trainer import NoLoCoTrainer

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"pid-rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    args = NoLoCoConfig(
        output_dir=out,
        pipeline_stages=int(os.environ.get("PIPELINE_STAGES", "2")),
        per_device_train_batch_size=4,
        microbatch_size=2,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=int(os.environ.get("MAX_STEPS", MAX_STEPS)),
        logging_steps=1,
        eval_strategy="no",
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        inner_steps=int(os.environ.get("INNER_STEPS", INNER_STEPS)),
        outer_optimizer="noloco",
        routing="sample",
        report_to="none",
        disable_tqdm=True,
        seed=5,
        p2p_timeout=float(os.environ.get("P2P_TIMEOUT", "3")),
        nonfinite=os.environ.get("NONFINITE", "error"),
        on_replica_loss=os.environ.get("ON_REPLICA_LOSS", "stop"),
    )
    trainer = NoLoCoTrainer(byte_config(), args, train_dataset=byte_corpus(max(128, 16 * args.max_steps)))
    install_fault(trainer, dist.get_rank())
    record = RecordSteps(trainer) if os.environ.get("RECORD_STEPS") == "1" else None
    if record is not None:
        trainer.add_callback(record)
    resume = os.environ.get("RESUME") or None
    try:
        trainer.train(resume_from_checkpoint=True if resume == "1" else resume)
        if trainer.parts.preemption.stopped:  # as hf-noloco-train does: no results, no export, status 143
            print(f"fault_train: preempted after step {trainer.state.global_step}", flush=True)
            trainer.end()
            sys.exit(143)
        if os.environ.get("EXPORT") == "1":
            trainer.save_model(os.path.join(out, "export"))
    except ReplicaDropped as exc:  # on_replica_loss="continue": this column was dropped; leave quietly
        print(f"fault_train: dropped: {exc}", flush=True)
        trainer.close_watchers()
        with open(os.path.join(out, f"dropped-rank{rank}"), "w") as f:
            f.write(str(exc))
        os._exit(0)
    inner = trainer.outer.inner
    torch.save(
        {
            "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
            "weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "global_step": trainer.state.global_step,
            "outer_steps": trainer.outer.outer_step_count,
            "skipped_outer_steps": trainer.outer.skipped_outer_steps,
            "live_replicas": trainer.mesh.live_replicas,
            "tokens_seen": trainer.tokens_seen,
            "adam_steps": sorted({int(s["step"]) for s in inner.state.values()}),
            "joins": trainer.parts.live_replicas.joins,
            "weights_at": record.weights if record is not None else {},
            "rows": record.rows if record is not None else {},
        },
        os.path.join(out, f"result-rank{dist.get_rank()}.pt"),
    )
    trainer.end()


if __name__ == "__main__":
    try:
        run(sys.argv[1])
    finally:  # when the error left the training code (the tests compare it with the process's exit time)
        print(f"fault_train: run() returned at monotonic {time.monotonic():.3f}", file=sys.stderr, flush=True)
