"""Workers that a launcher's agent restarts (``torchrun --max-restarts N``, ``accelerate launch
--max_restarts N``).

When a worker of the job fails, the agent stops the others and starts every worker again. The new workers must
(1) form a process group of their own, and (2) resume from the newest intact checkpoint (the trainer's job).

(1) does not work out of the box: torchrun's agents keep one TCPStore for the whole job and hand it to every
attempt's workers without a per-attempt prefix, so a restarted worker can read the dead attempt's gloo/NCCL
addresses from it and fail with ``Connection refused`` (pytorch/pytorch#135712, #167288). The attempt number
the agent passes (``TORCHELASTIC_RESTART_COUNT``) cannot name the attempt either: each agent counts its own
restarts, so the nodes of one job can disagree. :func:`join_restartable_group` therefore counts the attempts
in the store itself (every rank is started once per attempt) and joins the process group under that attempt's
prefix.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from hf_noloco.engine.structured import all_gather_json

_attempt: int | None = None  # this worker's attempt (1 = the first start), when counted in the agent's store


def restartable() -> bool:
    """Whether an agent that shares its store started this worker and may restart it."""
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0
    )


def join_restartable_group(backend: str, timeout_s: float) -> bool:
    """Joins the default process group for this attempt when the worker is :func:`restartable` (and none is
    initialised yet); returns whether it did. Accelerate, which the Trainer uses next, keeps an initialised
    group."""
    global _attempt
    if dist.is_initialized() or not restartable():
        return False
    store, rank, world_size = launcher_store(timeout_s)
    timeout = timedelta(seconds=timeout_s)
    _attempt = store.add(f"hf_noloco/starts/rank-{rank}", 1)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"hf_noloco/attempt-{_attempt}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return True


def launcher_store(timeout_s: float) -> tuple[dist.TCPStore, int, int]:
    """A client of the store the launcher hosts (``MASTER_ADDR:MASTER_PORT``), this worker's rank and the
    world size, from the environment the launcher set."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    return store, rank, world_size


def is_restart() -> bool:
    """Whether this worker was started again after a failed attempt of the same job (this rank's view; the
    trainer makes every rank agree)."""
    return (_attempt or 1) > 1 or int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0


def agreed_restart(mesh) -> bool:
    """Whether a launcher's agent restarted this job's workers, the same answer on every rank: each agent
    counts its own restarts, so one node's workers may not know that the job restarted. Collective when
    :func:`restartable`."""
    if not restartable():
        return False  # no agent that restarts workers: no collective
    views = all_gather_json(is_restart(), what=f"{mesh.describe()}: agreeing whether the job was restarted")
    return any(view is True for view in views)
