"""What an outer step puts on the network, bucket by bucket, in ``outer_dtype`` (pure: no communication).

:class:`Wire` turns one bucket's float32 weights into the messages of an outer step and the received messages
back into float32 values; with a block-scaled format (:mod:`hf_noloco.outer.compression`) it also keeps the
error-feedback buffers, one float32 row per quantity it sends. What crosses the network (the derivation is in
docs/compressed-gossip.md):

- noloco, gamma == beta: theta (float formats: cast; block-scaled: with error feedback).
- noloco, gamma != beta: theta and phi (float formats); Delta = theta - phi and phi (block-scaled).
- diloco: Delta, all-reduced (float formats), or all-gathered and summed after decoding (block-scaled).

With gamma != beta the beta term needs ``mean_G(theta - phi)``: sending the small Delta instead of theta
puts only Delta's rounding error (a fraction of a quantum of *Delta*) on it; the gamma term's slow weights
have to travel as absolute values anyway (partners are redrawn every outer step, so a sender shares no
reference with its next partner that a difference could be taken against).
"""

from __future__ import annotations

import torch

from hf_noloco.engine.buffers import consecutive_buckets, state_zeros
from hf_noloco.outer.compression import (
    dequantize,
    encode_with_feedback_,
    group_sum_mean,
    is_compressed,
)


class Wire:
    """The wire format of one :class:`~hf_noloco.outer.optimizer.OuterOptimizer`.

    Args:
        outer_dtype: the option's value.
        method: ``"noloco"`` or ``"diloco"``.
        sends_slow_weights: noloco with gamma != beta.
        numels: the values of each bucket.
        device: where the error-feedback buffers live (the outer state's device; pinned when that is the host
            of a GPU machine: :func:`~hf_noloco.engine.buffers.state_zeros`).
    """

    def __init__(
        self, outer_dtype: str, method: str, sends_slow_weights: bool, numels: list[int], device
    ) -> None:
        self.outer_dtype = outer_dtype
        self.compressed = is_compressed(outer_dtype)
        self.cast = None if self.compressed else getattr(torch, outer_dtype)
        if method == "diloco":
            self.streams: tuple[str, ...] = ("delta",)
        elif sends_slow_weights:
            self.streams = ("delta", "phi") if self.compressed else ("theta", "phi")
        else:
            self.streams = ("theta",)
        self.numels = list(numels)
        # One row per quantity sent: each has its own rounding history. Pinned when offloaded (host memory of
        # a GPU machine), like the slow weights beside them.
        self.error: list[torch.Tensor] = (
            [state_zeros((len(self.streams), n), device) for n in self.numels] if self.compressed else []
        )

    def noloco_outgoing(self, b: int, theta: torch.Tensor, phi: torch.Tensor) -> list[torch.Tensor]:
        """Bucket ``b``'s messages to each partner, from our float32 fast and slow weights (on the device of
        ``theta``: quantization runs there). Our own ``theta`` stays exact; only the wire copies are rounded.
        """
        # From pinned (offloaded) slow weights the copy is asynchronous; the host writes phi only after
        # reading this outer step's results from the device, which waits for the copy (same stream).
        phi = phi.to(theta.device, non_blocking=True)
        if not self.compressed:
            return [theta.to(self.cast) if s == "theta" else phi.to(self.cast) for s in self.streams]
        values = {"theta": lambda: theta, "delta": lambda: theta - phi, "phi": lambda: phi}
        return [
            encode_with_feedback_(values[s](), self.error[b][k], self.outer_dtype)
            for k, s in enumerate(self.streams)
        ]

    def decode(self, b: int, packets: list[torch.Tensor]) -> list[torch.Tensor]:
        """The float32 values of one member's messages of bucket ``b`` (new tensors)."""
        return [dequantize(p, self.numels[b], self.outer_dtype) for p in packets]

    def fast_weights(self, values: list[torch.Tensor]) -> torch.Tensor:
        """A member's decoded fast weights, from its decoded messages."""
        if self.streams[0] == "theta":
            return values[0]
        return values[0] + values[1]  # Delta + phi

    def group_means(self, members: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Per quantity sent, the mean over the group's decoded values, ``members`` in replica order."""
        return [group_sum_mean([m[k] for m in members]) for k in range(len(self.streams))]

    def combine(
        self, b: int, members: list, own, check, lazy: bool = False
    ) -> tuple[list[torch.Tensor], list[float] | list[torch.Tensor]]:
        """Decodes one bucket's messages of a whole gossip group, ``members`` = ``[(key, packets)]`` in
        replica order (``own`` the key of this replica's): the means over the group of each quantity sent
        (this replica entering with its own decoded values, like every other member), and the squared
        distances of the others' decoded fast weights to ours. ``check(key, values)`` sees every member's
        decoded values first (the finite check). ``lazy``: the distances stay 0-d tensors on the device (no
        host sync; :class:`~hf_noloco.outer.checks.DeviceChecks` reads them once per outer step)."""
        decoded = {}
        for key, packets in members:
            decoded[key] = self.decode(b, packets)
            check(key, decoded[key])
        means = self.group_means([decoded[key] for key, _ in members])
        mine = self.fast_weights(decoded[own])
        sq_dists = []
        for key, _ in members:
            if key != own:
                diff = self.fast_weights(decoded[key]) - mine
                sq_dist = torch.dot(diff, diff)
                sq_dists.append(sq_dist if lazy else sq_dist.item())
        return means, sq_dists

    def diloco_outgoing(self, b: int, pseudo: torch.Tensor) -> torch.Tensor:
        """Bucket ``b``'s pseudo-gradient ``theta - phi`` on the wire: cast, or a packet with feedback."""
        if not self.compressed:
            return pseudo.to(self.cast)
        return encode_with_feedback_(pseudo, self.error[b][0], self.outer_dtype)

    def diloco_mean(self, b: int, gathered: list[torch.Tensor]) -> torch.Tensor:
        """The mean pseudo-gradient of the all-gathered packets, summed in rank order as
        :func:`~hf_noloco.outer.compression.group_sum_mean` does (identical on every rank), decoding one
        packet at a time: one float32 copy of the bucket at a time, whatever the number of replicas."""
        total = dequantize(gathered[0], self.numels[b], self.outer_dtype)
        for packet in gathered[1:]:
            total.add_(dequantize(packet, self.numels[b], self.outer_dtype))
        return total.div_(len(gathered))

    def error_views(self, b: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Bucket ``b``'s error-feedback buffer as one ``(quantities, *shape)`` view per parameter."""
        return flat_views(self.error[b], like, rows=len(self.streams)) if self.compressed else []

    def reset(self) -> None:
        for error in self.error:
            error.zero_()


def buckets_isolating(sizes: list[int], limit: float, isolated: list[int]) -> list[list[int]]:
    """:func:`~hf_noloco.engine.buffers.consecutive_buckets` (one message per bucket), with the item of
    ``isolated`` (at most one) in a bucket of its own."""
    if not isolated:
        return consecutive_buckets(sizes, limit)
    [i] = isolated
    after = consecutive_buckets(sizes[i + 1 :], limit)
    return consecutive_buckets(sizes[:i], limit) + [[i]] + [[j + i + 1 for j in b] for b in after]


def flat_views(flat: torch.Tensor, like: list[torch.Tensor], rows: int | None = None) -> list[torch.Tensor]:
    """Views of a flat buffer (or, with ``rows``, of each row of a ``(rows, numel)`` one) shaped like
    ``like``'s tensors, in order."""
    views, offset = [], 0
    for t in like:
        if rows is None:
            views.append(flat[offset : offset + t.numel()].view(t.shape))
        else:
            views.append(flat[:, offset : offset + t.numel()].view(rows, *t.shape))
        offset += t.numel()
    return views


def ring_allreduce_bytes(nbytes: int, n: int) -> int:
    """Bytes each of ``n`` processes sends (and receives) in a ring all-reduce of ``nbytes``."""
    # Gloo/NCCL do not report traffic; a ring all-reduce (the bandwidth-optimal algorithm) sends and receives
    # 2 (n-1)/n of the buffer per process, which is what we count.
    return 2 * (n - 1) * nbytes // n
