"""Checkpoints of a NoLoCo run: every rank's stage replica, written so that a checkpoint is complete or
absent.

Layout of ``output_dir/checkpoint-N/``::

    noloco_mesh.json                  the mesh the run had (stages, replicas, layer split, method, routing)
    trainer_state.json, scheduler.pt  the Trainer's own state (written by rank 0)
    rng_state_<rank>.pth              each rank's random state (the Trainer's format)
    stage-<s>-replica-<r>/            one folder per rank:
        model.safetensors             the stage replica's weights (only the adapters, for a LoRA run)
        optimizer.pt                  inner + outer optimizer state (plain tensors and numbers)
        pipeline.pt                   the routing counters and tokens seen

Every rank writes into ``tmp-checkpoint-N/``; rank 0 renames it to ``checkpoint-N/`` only once every rank is
done, so a crash during a save leaves the previous checkpoint the newest. Everything is read back with
safetensors or ``torch.load(weights_only=True)``: no pickled code.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .mesh import PipelineMesh

MESH_FILE = "noloco_mesh.json"
_WEIGHTS, _OPTIMIZER, _PIPELINE = "model.safetensors", "optimizer.pt", "pipeline.pt"
# What a resume must share with the run that saved: anything else would load tensors into the wrong places.
_MUST_MATCH = ("pipeline_stages", "num_replicas", "layer_ranges", "outer_optimizer", "adapter")


def rank_folder(checkpoint: str, mesh: PipelineMesh) -> str:
    return os.path.join(checkpoint, f"stage-{mesh.stage}-replica-{mesh.replica}")


def checkpoints_in(folder: str) -> bool:
    """Whether ``folder`` holds completed checkpoints of a run."""
    return os.path.isdir(folder) and any(
        n.startswith(f"{PREFIX_CHECKPOINT_DIR}-") for n in os.listdir(folder)
    )


def write_checkpoint(
    run_dir: str,
    step: int,
    mesh: PipelineMesh,
    write_rank_state: Callable[[str], None],
    write_shared_state: Callable[[str], None],
    timeout: float,
    save_total_limit: int | None = None,
    best_model_checkpoint: str | None = None,
) -> str:
    """Writes ``run_dir/checkpoint-<step>`` atomically. Collective: every rank calls it.

    Args:
        run_dir: the run's output folder.
        step: the global step, which names the checkpoint.
        mesh: the process mesh.
        write_rank_state: called on every rank with the temporary checkpoint folder; writes this rank's files.
        write_shared_state: called on rank 0 once every rank has written; writes the files of the whole run.
        timeout: seconds rank 0 waits for the others (a monitored barrier names the ranks that did not
        arrive). save_total_limit: the Trainer's limit on kept checkpoints.
        best_model_checkpoint: the checkpoint of the best ``metric_for_best_model``, which the limit keeps.

    Returns:
        The completed checkpoint's folder.
    """
    name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
    final, tmp = os.path.join(run_dir, name), os.path.join(run_dir, f"tmp-{name}")
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    write_rank_state(tmp)
    # Rank 0 renames the folder only when every rank has written its part. A monitored barrier (gloo) names
    # the ranks that did not get there; rank 0 then fails, and the others with it.
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    else:
        dist.barrier()
    if mesh.rank == 0:
        write_shared_state(tmp)
    dist.barrier()
    if mesh.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=save_total_limit,
            best_model_checkpoint=best_model_checkpoint,
            use_mtime=False,
        )
    dist.barrier()
    return final


def save_rank_state(
    folder: str,
    mesh: PipelineMesh,
    stage: nn.Module,
    optimizer_state: dict,
    pipeline_state: dict,
    trainable_only: bool = False,
):
    """This rank's stage replica: weights, optimizer state and pipeline counters (and the stream position).
    With ``trainable_only`` only the parameters that train (LoRA adapters) are written: the frozen base comes
    from the base model again."""
    rank_dir = rank_folder(folder, mesh)
    os.makedirs(rank_dir, exist_ok=True)
    if trainable_only:
        weights = {k: p.detach().contiguous().cpu() for k, p in stage.named_parameters() if p.requires_grad}
    else:
        weights = {k: v.detach().contiguous().cpu() for k, v in stage.state_dict().items()}
    save_file(weights, os.path.join(rank_dir, _WEIGHTS))
    torch.save(optimizer_state, os.path.join(rank_dir, _OPTIMIZER))
    torch.save(pipeline_state, os.path.join(rank_dir, _PIPELINE))


def write_mesh_record(folder: str, record: dict) -> None:
    with open(os.path.join(folder, MESH_FILE), "w") as f:
        json.dump(record, f, indent=2)


def check_mesh_record(checkpoint: str, record: dict) -> None:
    """Refuses to resume ``checkpoint`` with another mesh, stage split or outer optimizer than it was saved
    with."""
    with open(os.path.join(checkpoint, MESH_FILE)) as f:
        saved = json.load(f)
    for key in _MUST_MATCH:
        if saved.get(key) != json.loads(
            json.dumps(record.get(key))
        ):  # JSON has lists where the record has tuples
            raise ValueError(
                f"Cannot resume {checkpoint}: it was saved with {key}={saved[key]}, this run has "
                f"{record[key]}. "
                "Resume with the same pipeline_stages, number of processes, stage split and outer_optimizer."
            )


def load_rank_state(
    checkpoint: str, mesh: PipelineMesh, stage: nn.Module, trainable_only: bool = False
) -> dict:
    """Loads this rank's weights into ``stage`` (with ``trainable_only``: exactly its trainable parameters);
    returns its pipeline counters."""
    rank_dir = rank_folder(checkpoint, mesh)
    weights = load_file(os.path.join(rank_dir, _WEIGHTS))
    if trainable_only:
        expected = {name for name, p in stage.named_parameters() if p.requires_grad}
        if set(weights) != expected:
            raise ValueError(
                f"Cannot resume {checkpoint}: its adapter tensors do not match this run's "
                f"({sorted(set(weights) ^ expected)[:3]} differ)."
            )
    stage.load_state_dict(weights, strict=not trainable_only)
    return torch.load(os.path.join(rank_dir, _PIPELINE), weights_only=True)


def load_optimizer_state(checkpoint: str, mesh: PipelineMesh) -> dict:
    return torch.load(
        os.path.join(rank_folder(checkpoint, mesh), _OPTIMIZER), weights_only=True, map_location="cpu"
    )
