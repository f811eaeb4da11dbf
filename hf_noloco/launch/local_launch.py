"""Runs a function on N local gloo processes (one thread each) and returns what each rank returned, or raises
with the failing rank's traceback. Used by the multi-process tests and the benchmarks."""

from __future__ import annotations

import gc
import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_noloco.engine.comm import free_port


def _worker(rank, world_size, port, out_dir, fn, args, timeout_s):
    # What the parent imported is inherited and never freed: out of the collector's sight, a full collection
    # (the Trainer runs one at the end of training) costs milliseconds instead of most of a second.
    gc.freeze()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 60.0) -> list:
    """Calls ``fn(*args)`` on ``world_size`` gloo ranks; ``fn`` must be importable (module level).

    Returns the list of per-rank results. A failure on any rank raises with that rank's traceback.
    """
    # Forked ranks inherit what this process imported: importing the trainer (torch.distributed,
    # transformers, accelerate) once here spares each rank the seconds it takes.
    import hf_noloco.trainer  # noqa: F401

    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _worker,
            args=(world_size, free_port(), out_dir, fn, args, timeout_s),
            nprocs=world_size,
            join=False,
            start_method=os.environ.get("HF_NOLOCO_TEST_START_METHOD", "fork"),
        )
        try:
            while not context.join(timeout=timeout_s * 4):
                pass
        except Exception as exc:  # noqa: BLE001 - any failure: report what the ranks recorded
            errors = []
            for rank in range(world_size):
                path = os.path.join(out_dir, f"rank{rank}.pt")
                if os.path.exists(path):
                    record = torch.load(path, weights_only=False)
                    if not record["ok"]:
                        errors.append(f"--- rank {rank} ---\n{record['error']}")
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors or [str(exc)])) from None
        results = []
        for rank in range(world_size):
            record = torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
            results.append(record["result"])
        return results
