"""One small all-reduce over a replica column per step, which serves the loss report, clipping and the
non-finite check: ``[loss (from the last stage), squared gradient norm of each stage]``.

Every rank then reports its column's loss (the mean over ranks is the replicas' mean), clips by the column's
norm, as the unsplit model would, and knows where a NaN or inf came from, without a collective of its own.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from hf_noloco.engine.buffers import squared_norm
from hf_noloco.engine.comm import collective
from hf_noloco.engine.mesh import PipelineMesh


def column_stats(stage: nn.Module, mesh: PipelineMesh, loss: torch.Tensor | None, step: int) -> torch.Tensor:
    """``[loss, ||grad||^2 of stage 0, ..., of stage S-1]`` of this replica column, the same on its ranks.
    The tied weight's second copy (the stage's ``mirrored_names``) is counted on the first stage only."""
    stats = torch.zeros(1 + mesh.num_stages, dtype=torch.float32, device=mesh.device)
    if loss is not None:
        stats[0] = loss.detach().float()
    mirrored = stage.mirrored_names
    for name, p in stage.named_parameters():
        if p.grad is not None and name not in mirrored:
            # in float32, without a float32 copy of a bf16 gradient (1 GiB for an 8B model's embeddings)
            stats[1 + mesh.stage] += squared_norm(p.grad)
    if mesh.num_stages > 1:
        collective(
            dist.all_reduce,
            stats,
            group=mesh.column_group,
            timeout=mesh.timeout,
            what=f"{mesh.describe()}, step {step}: all-reduce of the loss and gradient norms over replica "
            f"{mesh.replica}'s column ({mesh.describe_ranks(mesh.column_ranks())})",
        )
    return stats


def nonfinite_report(stats: torch.Tensor, mesh: PipelineMesh, step: int) -> str | None:
    """What in ``stats`` is not finite, naming the stage, replica and rank, or ``None`` when all is finite."""
    if bool(torch.isfinite(stats).all()):
        return None
    replica, last = mesh.replica, mesh.num_stages - 1
    values = stats.tolist()
    problems = []
    if not math.isfinite(values[0]):
        where = f"stage {last}, replica {replica} (rank {mesh.rank_of(replica, last)})"
        problems.append(f"a non-finite loss ({values[0]}) on {where}")
    bad = [s for s in range(mesh.num_stages) if not math.isfinite(values[1 + s])]
    if bad:
        where = ", ".join(f"stage {s}, replica {replica} (rank {mesh.rank_of(replica, s)})" for s in bad)
        problems.append(f"non-finite gradients on {where}")
    return f"Step {step}: " + " and ".join(problems)


@torch.no_grad()
def clip_gradients_(parameters, norm: torch.Tensor, max_norm: float) -> None:
    """Scales every gradient by ``min(1, max_norm / (norm + 1e-6))`` (``norm``: the column's)."""
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))
