"""Evaluation metrics: perplexity and the replica divergence of the official code.

The free per-outer-step estimate of the divergence lives with the outer step (``OuterOptimizer
.last_divergence_estimate``), computed by :func:`hf_noloco.gossip.divergence_from_partners`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hf_noloco.comm import consecutive_buckets, flatten, wait_collective
from hf_noloco.mesh import PipelineMesh

# exp(x) overflows a float64 above ~709.78; report inf instead of raising.
_MAX_LOG = math.log(torch.finfo(torch.float64).max)

# Flatten at most this many parameter elements at once, so the metric never doubles a stage's memory.
_CHUNK_NUMEL = 1 << 24


def perplexity(loss_sum: float | torch.Tensor, token_count: float | torch.Tensor) -> float:
    """``exp(loss_sum / token_count)``: perplexity of a token-weighted mean cross-entropy, inf on overflow."""
    loss_sum, token_count = float(loss_sum), float(token_count)
    if token_count <= 0:
        raise ValueError(f"perplexity needs a positive token count, got {token_count:g}.")
    mean = loss_sum / token_count
    if math.isnan(mean):
        return float("nan")
    return math.exp(mean) if mean < _MAX_LOG else float("inf")


def squared_norm(tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``||tensor||^2`` reduced in ``dtype``, a slice at a time: ``vector_norm(t, dtype=...)`` converts the
    whole tensor first, a float32 copy of a bf16 gradient (1 GiB for Llama-3's embedding matrix at 1B)."""
    flat = tensor.detach().reshape(-1)
    total = torch.zeros((), dtype=dtype, device=tensor.device)
    for piece in flat.split(_CHUNK_NUMEL):
        total += torch.linalg.vector_norm(piece, dtype=dtype) ** 2
    return total


def _unique_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    # named_parameters() drops duplicates (tied weights), so a tied tensor is counted once; a copy of a tied
    # weight that another stage holds too (a stage's `mirrored_names`) is counted there only. Frozen weights
    # (the base model under LoRA adapters) are the same in every replica: only trained ones can diverge.
    mirrored = getattr(module, "mirrored_names", set())
    return [p for name, p in module.named_parameters() if p.requires_grad and name not in mirrored]


@torch.no_grad()
def replica_divergence(module: torch.nn.Module, mesh: PipelineMesh) -> dict[str, float]:
    """The official replica-divergence metric, per stage and over the model. Collective: every rank calls it.

    ``sqrt( sum_params sum_replicas (theta_r - mean_r theta)^2 / (numel * dp) )``, i.e. the RMS distance of
    a replica's weights from the replica mean. Returns ``{"replica_divergence": whole model,
    "replica_divergence/stage_{s}": ...}``, the same dict on every rank. Costs one all-reduce of the stage's
    weights over its replicas (so call it at logging intervals) and two tiny ones.
    """
    params = _unique_parameters(module)
    num_replicas, num_stages = mesh.num_live_replicas, mesh.num_stages  # the replicas still in the run
    device = params[0].device if params else mesh.device
    sq_sum = torch.zeros((), dtype=torch.float64, device=device)
    numel = sum(p.numel() for p in params)
    for bucket in consecutive_buckets([p.numel() for p in params], _CHUNK_NUMEL):
        theta = flatten([params[i] for i in bucket], torch.float32)
        mean = theta.clone()
        if num_replicas > 1:
            _all_reduce(mean, mesh.replica_group)
            mean.div_(num_replicas)
        sq_sum += (theta - mean).pow_(2).sum(dtype=torch.float64)
    # Slot s: stage s's squared deviations summed over its replicas; slot S+s: its numel. Reduced over the
    # replica group, then over the column (one rank per stage): two tiny messages, and no world-wide group.
    stats = torch.zeros(2 * num_stages, dtype=torch.float64, device=device)
    stats[mesh.stage] = sq_sum
    if num_replicas > 1:
        _all_reduce(stats, mesh.replica_group)
    stats[num_stages + mesh.stage] = float(numel)
    if num_stages > 1:
        _all_reduce(stats, mesh.column_group)
    stats = stats.tolist()
    result = {"replica_divergence": _rms(sum(stats[:num_stages]), sum(stats[num_stages:]), num_replicas)}
    for s in range(num_stages):
        result[f"replica_divergence/stage_{s}"] = _rms(stats[s], stats[num_stages + s], num_replicas)
    return result


def _all_reduce(tensor: torch.Tensor, group) -> None:
    # Waited for through comm: a lost member is a PeerError, and under on_replica_loss="continue" a change of
    # the live replicas interrupts the wait. The group's own timeout (p2p_timeout) bounds it.
    work = dist.all_reduce(tensor, group=group, async_op=True)
    wait_collective(work, 24 * 3600.0, "the replica-divergence all-reduce")


def _rms(sq_sum: float, numel: float, num_replicas: int) -> float:
    return math.sqrt(sq_sum / (numel * num_replicas)) if numel > 0 else 0.0
