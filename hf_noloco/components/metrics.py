"""The run's metrics: perplexity, the replica divergence of the official code, and what each training log adds
(the divergence estimate, outer-step bytes, tokens per second).

The free per-outer-step estimate of the divergence lives with the outer step (``OuterOptimizer
.last_divergence_estimate``), computed by :func:`hf_noloco.outer.gossip.divergence_from_partners`.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from hf_noloco.engine.buffers import consecutive_buckets, flatten
from hf_noloco.engine.comm import collective
from hf_noloco.engine.mesh import PipelineMesh

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
            _all_reduce(mean, mesh.replica_group, mesh.timeout)
            mean.div_(num_replicas)
        sq_sum += (theta - mean).pow_(2).sum(dtype=torch.float64)
    # Slot s: stage s's squared deviations summed over its replicas; slot S+s: its numel. Reduced over the
    # replica group, then over the column (one rank per stage): two tiny messages, and no world-wide group.
    stats = torch.zeros(2 * num_stages, dtype=torch.float64, device=device)
    stats[mesh.stage] = sq_sum
    if num_replicas > 1:
        _all_reduce(stats, mesh.replica_group, mesh.timeout)
    stats[num_stages + mesh.stage] = float(numel)
    if num_stages > 1:
        _all_reduce(stats, mesh.column_group, mesh.timeout)
    stats = stats.tolist()
    result = {"replica_divergence": _rms(sum(stats[:num_stages]), sum(stats[num_stages:]), num_replicas)}
    for s in range(num_stages):
        result[f"replica_divergence/stage_{s}"] = _rms(stats[s], stats[num_stages + s], num_replicas)
    return result


def _all_reduce(tensor: torch.Tensor, group, timeout: float) -> None:
    # Through comm: a lost member is a PeerError, and under on_replica_loss="continue" a change of the live
    # replicas interrupts the wait.
    collective(
        dist.all_reduce, tensor, group=group, timeout=timeout, what="the replica-divergence all-reduce"
    )


def _rms(sq_sum: float, numel: float, num_replicas: int) -> float:
    return math.sqrt(sq_sum / (numel * num_replicas)) if numel > 0 else 0.0


class Throughput:
    """Tokens seen over all replicas, and their rate between two training logs."""

    def __init__(self):
        self.tokens_seen = 0
        self._last = (0, time.monotonic())

    def add(self, tokens: int) -> None:
        self.tokens_seen += tokens

    def restart(self, tokens_seen: int) -> None:
        """After a resume: the count so far, and the clock from now."""
        self.tokens_seen = tokens_seen
        self._last = (tokens_seen, time.monotonic())

    def log_entries(self) -> dict[str, float]:
        last_tokens, last_time = self._last
        now = time.monotonic()
        self._last = (self.tokens_seen, now)
        rate = (self.tokens_seen - last_tokens) / max(now - last_time, 1e-9)
        return {"tokens_seen": self.tokens_seen, "tokens_per_second": rate}


def outer_log_entries(outer, live_sum) -> dict[str, float]:
    """The outer optimizer's entries of a training log, averaged over the live ranks with ``live_sum`` (sums a
    tensor in place over them, returns how many): the partner-distance divergence estimate (over the ranks
    that have one) and the outer-step bytes sent per rank."""
    estimate = outer.last_divergence_estimate
    stats = torch.tensor(
        [estimate or 0.0, float(estimate is not None), float(outer.bytes_sent)],
        dtype=torch.float64,
        device=outer.params[0].device,
    )
    ranks = live_sum(stats)
    entries = {"outer_bytes_sent_per_rank": (stats[2] / ranks).item()}
    if stats[1] > 0:
        entries["replica_divergence_estimate"] = (stats[0] / stats[1]).item()
    return entries


def mean_training_loss(tr_loss: torch.Tensor, window: int, skipped: int, live_sum) -> float:
    """The logged training loss: the mean over the live ranks and the last ``window`` steps of their column
    losses, through ``live_sum`` (our bounded sum over the live ranks, where the Trainer's own gather over the
    default group would wait unbounded for a lost peer). Steps a rank skipped (a replica lost meanwhile) added
    0 to its loss and are left out of the mean."""
    stats = torch.tensor([tr_loss.item(), window - skipped], dtype=torch.float64, device=tr_loss.device)
    live_sum(stats)
    return (stats[0] / stats[1]).item() if stats[1] > 0 else float("nan")
