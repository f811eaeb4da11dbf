"""The run's metrics: perplexity, the replica divergence of the official code, and what each training log adds
(the divergence estimate, outer-step bytes, tokens per second, MFU).

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
from hf_noloco.estimate.flops import peak_flops, training_flops_per_token

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
    """Non-padding and trained (loss-bearing) tokens over all live replicas, their rates between two
    training logs, and the MFU (model FLOPs utilisation) when the device's peak FLOPs are known.

    Only the first stage of each replica counts (:meth:`count`, every step), from its batch's attention mask
    and labels, into tensors beside the batch: on a GPU nothing waits for the device until
    :meth:`log_entries` sums the counts over the live ranks at a training log. The FLOPs of a token come from
    the model's config (:func:`~hf_noloco.estimate.flops.training_flops_per_token`), so the sum over the ranks
    is the model's FLOPs, whichever stage did which part: the MFU counts the non-padding tokens, the
    Trainer's ``total_flos`` (:meth:`count`'s return value) every token computed, padding included.
    """

    def __init__(self, config=None, counts: bool = True, peak_flops: float | None = None):
        """``config``: the model's (``None``: no FLOPs); ``counts``: this rank counts (a first stage);
        ``peak_flops``: one device's peak, or the :func:`resolved_peak_flops` of training arguments."""
        if peak_flops is not None and not isinstance(peak_flops, (int, float)):
            peak_flops = resolved_peak_flops(peak_flops)
        self.config, self.counts, self.peak_flops = config, counts, peak_flops
        self.tokens_seen = 0
        self.trained_tokens_seen = 0
        # This rank's non-padding tokens, trained tokens and their FLOPs since the last log (float64: exact
        # integers up to 2^53), where the batches are.
        self._pending: torch.Tensor | None = None
        self._flops_per_token: dict[int, float] = {}
        self._last_time = time.monotonic()

    def count(self, inputs: dict) -> float:
        """Counts a training batch of this replica (on the first stage; a no-op elsewhere) and returns the
        FLOPs of all its tokens on this rank, padding included (0 off the first stage), for ``total_flos``."""
        if not self.counts:
            return 0.0
        input_ids = inputs["input_ids"]
        mask, labels = inputs.get("attention_mask"), inputs.get("labels")
        rows, seq_len = input_ids.shape
        per_token = self._per_token(seq_len)
        if self._pending is None:
            self._pending = torch.zeros(3, dtype=torch.float64, device=input_ids.device)
        elif self._pending.device != input_ids.device:  # restored from a checkpoint, on the CPU
            self._pending = self._pending.to(input_ids.device)
        tokens = mask.sum() if mask is not None else input_ids.numel()
        trained = (labels[:, 1:] != -100).sum() if labels is not None else rows * (seq_len - 1)
        self._pending[0] += tokens
        self._pending[1] += trained
        self._pending[2] += tokens * per_token
        return input_ids.numel() * per_token

    def _per_token(self, seq_len: int) -> float:
        if self.config is None:
            return 0.0
        if seq_len not in self._flops_per_token:
            self._flops_per_token[seq_len] = training_flops_per_token(self.config, seq_len)
        return self._flops_per_token[seq_len]

    def _pending_counts(self) -> list[float]:
        return [0.0, 0.0, 0.0] if self._pending is None else self._pending.tolist()

    def state_dict(self) -> dict:
        return {
            "tokens_seen": self.tokens_seen,
            "trained_tokens_seen": self.trained_tokens_seen,
            "pending": self._pending_counts(),
        }

    def load_state_dict(self, state) -> None:
        """After a resume: the counts so far, and the clock from now. (A checkpoint from before the trained
        tokens were counted holds only ``tokens_seen``, an int.)"""
        state = {"tokens_seen": state} if isinstance(state, int) else state
        self.tokens_seen = int(state["tokens_seen"])
        self.trained_tokens_seen = int(state.get("trained_tokens_seen", 0))
        pending = state.get("pending")
        self._pending = None if pending is None else torch.tensor(pending, dtype=torch.float64)
        self._last_time = time.monotonic()

    def log_entries(self, live_sum, device) -> dict[str, float]:
        """The counts since the last log summed over the live ranks with ``live_sum`` (collective: every
        rank calls it; the sum is made on ``device``), as log entries."""
        stats = torch.zeros(3, dtype=torch.float64, device=device)
        if self._pending is not None:
            stats += self._pending.to(device)
            self._pending = None
        ranks = live_sum(stats)
        tokens, trained, flops = stats.tolist()
        self.tokens_seen += int(tokens)
        self.trained_tokens_seen += int(trained)
        now = time.monotonic()
        seconds, self._last_time = max(now - self._last_time, 1e-9), now
        entries = {
            "tokens_seen": self.tokens_seen,
            "tokens_per_second": tokens / seconds,
            "trained_tokens_seen": self.trained_tokens_seen,
            "trained_tokens_per_second": trained / seconds,
        }
        if self.peak_flops:
            entries["mfu"] = flops / seconds / max(ranks, 1) / self.peak_flops
        return entries


class PredictionStats:
    """The last stage's right predictions, summed entropy and target tokens since the last log, as TRL's
    ``mean_token_accuracy`` and ``entropy`` (from the logits the loss computes anyway:
    :func:`~hf_noloco.engine.losses.next_token_losses`), kept in a tensor beside the batch until
    :meth:`log_entries` sums it over the live ranks (no wait for the device per step).

    Args:
        counts: this rank counts (a last stage).
    """

    def __init__(self, counts: bool):
        self.counts = counts
        self._pending: torch.Tensor | None = None  # right predictions, summed entropy, target tokens

    def add(self, token_stats: torch.Tensor | None, target_tokens: torch.Tensor | None) -> None:
        """A step's counts (its :class:`~hf_noloco.engine.pipeline.StepResult`'s ``token_stats`` and
        ``target_tokens``); a no-op off the last stage."""
        if not self.counts or token_stats is None:
            return
        stats = torch.cat([token_stats, target_tokens.double().reshape(1)])
        self._pending = stats if self._pending is None else self._pending + stats

    def log_entries(self, live_sum, device) -> dict[str, float]:
        """The counts since the last log summed over the live ranks with ``live_sum`` (collective), as log
        entries (none when no target was scored)."""
        stats = torch.zeros(3, dtype=torch.float64, device=device)
        if self._pending is not None:
            stats += self._pending.to(device)
            self._pending = None
        live_sum(stats)
        right, entropy, tokens = stats.tolist()
        return prediction_entries(right, entropy, tokens)


def prediction_entries(right: float, entropy: float, tokens: float, prefix: str = "") -> dict[str, float]:
    """``mean_token_accuracy`` (the share of target tokens predicted right, by the argmax) and ``entropy``
    (the predictions' mean entropy, in nats), TRL's names; none without a target."""
    if tokens <= 0:
        return {}
    return {f"{prefix}mean_token_accuracy": right / tokens, f"{prefix}entropy": entropy / tokens}


def resolved_peak_flops(args) -> float | None:
    """The peak FLOPS of one device: ``peak_tflops``, else a known GPU's (:mod:`hf_noloco.estimate.flops`)."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if torch.device(args.device).type == "cuda":
        return peak_flops(torch.cuda.get_device_name(args.device))
    return None


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
