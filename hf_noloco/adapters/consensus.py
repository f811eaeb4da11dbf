"""The mean of a stage's LoRA adapters over its replicas, what the export writes (a collective)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hf_noloco.adapters.stage import trainable_state_dict
from hf_noloco.engine.buffers import flatten, unflatten_into
from hf_noloco.engine.comm import peer_call
from hf_noloco.rules import check_export_replica


@torch.no_grad()
def consensus_adapters(stage: nn.Module, mesh, replica: int | None = None) -> dict[str, torch.Tensor]:
    """The mean of the stage's adapters over its replicas (or replica ``replica``'s), as CPU float32 tensors.
    Collective over ``mesh.replica_group``: one message, the adapters being small."""
    check_export_replica(replica, mesh.num_replicas)
    tensors = trainable_state_dict(stage)
    device = mesh.device if dist.get_backend() == "nccl" else torch.device("cpu")  # NCCL moves CUDA tensors
    flat = flatten(list(tensors.values()), torch.float32).to(device)
    if mesh.num_replicas > 1:
        if replica is None:
            with peer_call("the adapters' consensus"):
                dist.all_reduce(flat, group=mesh.replica_group)
            flat.div_(mesh.num_replicas)
        else:
            with peer_call("the adapters' consensus"):
                dist.broadcast(flat, src=mesh.rank_of(replica, mesh.stage), group=mesh.replica_group)
    out = {name: torch.empty(t.shape, dtype=torch.float32) for name, t in tensors.items()}
    unflatten_into(list(out.values()), flat.cpu())
    return out
