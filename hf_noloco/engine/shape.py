"""The process mesh's arithmetic (pure): which rank holds which (replica, stage), the mesh shape of a world,
and the replicas a sample may be routed among. :class:`~hf_noloco.engine.mesh.PipelineMesh` builds its groups
from these; the config and the cost models check a launch with the same functions.
"""

from __future__ import annotations

import os

from hf_noloco.rules import ROUTING_DOMAINS, check_choice, check_positive_int


def rank_of(replica: int, stage: int, num_stages: int) -> int:
    """The global rank of ``replica`` of ``stage``: a replica's column of stages is consecutive ranks."""
    return replica * num_stages + stage


def mesh_shape(world_size: int, pipeline_stages: int) -> tuple[int, int]:
    """``(num_replicas, num_stages)`` for ``world_size`` processes, or a clear error."""
    check_positive_int("pipeline_stages", pipeline_stages)
    if world_size % pipeline_stages:
        how = (
            " with a launcher, e.g. `accelerate launch --num_processes N recipes/train.py ...` or "
            "`torchrun --nproc_per_node N recipes/train.py ...`"
            if world_size == 1
            else ""
        )
        raise ValueError(
            f"The world size ({world_size} processes) is not divisible by pipeline_stages={pipeline_stages}: "
            f"launch a multiple of {pipeline_stages} processes (num_replicas x pipeline_stages){how}."
        )
    return world_size // pipeline_stages, pipeline_stages


def processes_per_node() -> int:
    """Processes this launch runs on each node: ``LOCAL_WORLD_SIZE`` (set by torchrun and accelerate), or the
    whole world when it is unset (a single-machine launch)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def routing_group_size(
    domain: str,
    group_size: int | None,
    num_replicas: int,
    pipeline_stages: int,
    procs_per_node: int | None = None,
) -> int:
    """Replicas per routing group: all of them (``global``), or those whose replica columns share a node
    (``node``): ``group_size`` if given, else ``procs_per_node // pipeline_stages``. Ranks are
    ``replica * pipeline_stages + stage`` and a node holds consecutive ranks, so the replicas of one node are
    consecutive and their whole columns sit on it exactly when ``pipeline_stages`` divides the processes per
    node."""
    check_choice("routing_domain", domain, ROUTING_DOMAINS)
    if group_size is not None:
        if domain != "node":
            raise ValueError(
                f"routing_group_size={group_size} only applies to routing_domain='node' (got {domain!r})."
            )
        check_positive_int("routing_group_size", group_size)
    if domain == "global":
        return num_replicas
    if group_size is None:
        procs_per_node = processes_per_node() if procs_per_node is None else procs_per_node
        if procs_per_node % pipeline_stages:
            raise ValueError(
                f"routing_domain='node' needs every replica column on one node, but pipeline_stages="
                f"{pipeline_stages} does not divide the {procs_per_node} processes per node: launch a "
                "multiple of pipeline_stages per node, or set routing_group_size explicitly."
            )
        group_size = min(max(procs_per_node // pipeline_stages, 1), num_replicas)
    if num_replicas % group_size:
        raise ValueError(
            f"routing_group_size={group_size} does not divide the {num_replicas} replicas per stage."
        )
    return group_size
