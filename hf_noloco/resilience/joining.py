"""A replica column that joins a live run (``python -m hf_noloco.column_launch --join``).

A column that was lost (or never started) is started again with the same launch line plus ``--join``. Its
processes cannot join the run's default process group: the live ranks made it long ago, and a gloo or NCCL
group is made by all its members together. So a joining process stands in an *absent* default group (torch's
fake process group: the run's size and this rank, communicating with no one) on the run's own store, which is
enough for Accelerate and the Trainer to set up, and does all its communication in the groups of the view that
admits it (:meth:`hf_noloco.engine.mesh.PipelineMesh.regroup`), made by name by the members of that view.

Admission (:mod:`hf_noloco.resilience.membership`): each joining rank writes a request into the store; the
leader of the live view finds a column whose every stage asked and proposes the next view with that column
live, to take effect at the fence after the next one, so that no survivor skips a step. At that fence the
members make the new groups, and for each stage a live replica (:func:`join_pairs`) sends the joiner its
whole state point to point (:mod:`hf_noloco.resilience.transfer`); the joiner then resumes from it as from a
checkpoint of its own replica, at the run's step (:mod:`hf_noloco.components.live_replicas`).
"""

from __future__ import annotations

import os
from datetime import timedelta

# torch is imported inside the functions: column_launch reads JOIN_ENV before it imports torch.
JOIN_ENV = "HF_NOLOCO_JOIN"
_ABSENT = "hf_noloco_absent"


def is_joining() -> bool:
    """Whether this process was started to join a live run (``column_launch --join`` sets it). Read once, by
    :class:`~hf_noloco.NoLoCoConfig` (its ``joining``): every other part is told."""
    return os.environ.get(JOIN_ENV) == "1"


def join_live_run(timeout_s: float) -> bool:
    """Stands this process in an absent default group of the run's size (rank from the environment), on the
    run's store under the key prefix the live ranks' default group has (``env://`` with the agent's store:
    ``default_pg/``), so that the groups made by name later are found by every member. Returns whether it
    did (only when no group is initialised yet). Called for a joining process only."""
    import torch.distributed as dist

    from hf_noloco.resilience.authentication import default_group_store
    from hf_noloco.resilience.elastic import launcher_store

    if dist.is_initialized():
        return False
    try:
        from torch._C._distributed_c10d import FakeProcessGroup as fake

        fake._create_internal  # noqa: B018 - how torch makes one
    except (ImportError, AttributeError):
        raise RuntimeError(
            "Joining a live run needs torch's FakeProcessGroup (torch 2.5 or newer)."
        ) from None
    if _ABSENT not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            _ABSENT,
            lambda store, rank, size, timeout: fake._create_internal(rank, size),
            devices=["cpu", "cuda"],
        )
    store, rank, world_size = launcher_store(timeout_s)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        _ABSENT,
        store=default_group_store(store),  # as the live ranks' (authenticated: resilience/authentication.py)
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return True


def join_pairs(previous_live: list[int], joined: list[int], num_stages: int) -> list[tuple[int, int]]:
    """``(donor rank, joiner rank)`` for every stage of every joined column: the k-th joined column copies the
    (k mod n)-th replica that was live before (n of them), so that several joiners draw on several donors."""
    donors = sorted(previous_live)
    return [
        (donors[k % len(donors)] * num_stages + stage, column * num_stages + stage)
        for k, column in enumerate(sorted(joined))
        for stage in range(num_stages)
    ]
