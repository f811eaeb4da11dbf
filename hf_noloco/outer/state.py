"""What an outer method works on: one stage replica's parameters in buckets, their slow weights and momentum
(one flat float32 buffer per bucket), the wire that encodes what crosses the network, and the counters the
logs and checkpoints read. :class:`~hf_noloco.outer.optimizer.OuterOptimizer` owns it; the methods
(:mod:`~hf_noloco.outer.noloco`, :mod:`~hf_noloco.outer.diloco`, :mod:`~hf_noloco.outer.baselines`) read and
update it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_noloco.engine.buffers import flatten, unflatten_into, zeros_beside
from hf_noloco.outer.checks import DeviceChecks
from hf_noloco.outer.settings import OuterSettings
from hf_noloco.outer.wire import Wire, buckets_isolating, flat_views


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class InFlight:
    """An outer step whose exchange runs in the background (``outer_overlap_steps`` > 0): the method's own
    flights (:class:`~hf_noloco.outer.noloco.NoLoCoFlight`, :class:`~hf_noloco.outer.diloco.DiLoCoFlight`)
    add what their exchange holds. A flight restored from a checkpoint is already ``combined``."""

    apply_at: int  # the inner step after which the update is applied
    theta: list[torch.Tensor]  # per bucket: float32 fast weights when the step started (theta_k)
    context: str
    combined: bool = False  # the exchange has ended and phi, delta hold its update


@dataclass
class OuterState:
    """The buckets of one stage replica and their outer state.

    Attributes:
        params: the stage's parameters, in an order identical on every replica of the stage.
        buckets: indices into ``params``, one list per bucket (the tied weight in a bucket of its own).
        phi_flat / delta_flat: per bucket, the slow weights and the momentum (float32; on the CPU when
            offloaded, pinned where a GPU is present); ``phi`` / ``delta`` view them per parameter.
        wire: what an outer step sends per bucket (``None`` for the methods without an outer step).
        tied_bucket: the bucket of the tied weight's copy, if this stage holds one.
        uncounted_bucket: ``tied_bucket`` on the stage whose copy the other stage counts (the mirror).
        numel: the parameters the divergence estimate counts (the mirror's tied copy left out).
        tied_mirror / tied_peer: this stage holds the copy of the tied weight that the other stage counts;
            the global rank that holds the other copy (see
            :class:`~hf_noloco.outer.optimizer.OuterOptimizer`).
    """

    params: list[torch.Tensor]
    buckets: list[list[int]]
    tied_bucket: int | None
    uncounted_bucket: int | None
    numel: int
    tied_mirror: bool = False
    tied_peer: int | None = None
    phi_flat: list[torch.Tensor] = field(default_factory=list)
    delta_flat: list[torch.Tensor] = field(default_factory=list)
    phi: list[torch.Tensor] = field(default_factory=list)
    delta: list[torch.Tensor] = field(default_factory=list)
    wire: Wire | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    outer_step_count: int = 0
    skipped_outer_steps: int = 0
    last_divergence_estimate: float | None = None
    last_groups: list[list[int]] | None = None

    @classmethod
    def build(
        cls,
        params: list[torch.Tensor],
        settings: OuterSettings,
        bucket_mb: float,
        tied_weight: torch.Tensor | None,
        tied_mirror: bool,
        tied_peer: int | None,
    ) -> OuterState:
        """Buckets of at most ``bucket_mb`` MiB of float32 weights, and (for the methods with an outer step)
        phi = the weights now, delta = 0."""
        if not params:
            raise ValueError("OuterOptimizer got an empty parameter list.")
        tied = [i for i, p in enumerate(params) if p is tied_weight]
        if tied_weight is not None and not tied:
            raise ValueError("tied_weight is not one of params.")
        buckets = buckets_isolating([p.numel() * 4 for p in params], bucket_mb * 2**20, tied)
        tied_bucket = next((b for b, bucket in enumerate(buckets) if bucket == tied), None)
        numel = sum(p.numel() for i, p in enumerate(params) if not (tied_mirror and i in tied))
        uncounted = tied_bucket if tied_mirror else None
        state = cls(params, buckets, tied_bucket, uncounted, numel, tied_mirror, tied_peer)
        if settings.has_outer_step:
            state._allocate(settings)
        return state

    def _allocate(self, settings: OuterSettings) -> None:
        offload = settings.offload_outer_state
        device = torch.device("cpu") if offload else self.params[0].device
        pin = offload and torch.cuda.is_available()
        for b in range(len(self.buckets)):
            tensors = self.bucket_params(b)
            phi = flatten(tensors, torch.float32).to(device)
            phi = phi.pin_memory() if pin else phi
            delta = zeros_beside(phi)  # pinned like phi (zeros_like would not be)
            self.phi_flat.append(phi)
            self.delta_flat.append(delta)
            self.phi += flat_views(phi, tensors)
            self.delta += flat_views(delta, tensors)
        numels = [sum(p.numel() for p in self.bucket_params(b)) for b in range(len(self.buckets))]
        self.wire = Wire(
            settings.outer_dtype, settings.outer_optimizer, settings.sends_slow_weights, numels, device
        )

    @property
    def has_outer_state(self) -> bool:
        return bool(self.phi_flat)

    def bucket_params(self, b: int) -> list[torch.Tensor]:
        return [self.params[i] for i in self.buckets[b]]

    def theta(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s fast weights, as a new flat float32 tensor."""
        return flatten(self.bucket_params(b), torch.float32)

    def set_weights(self, b: int, flat: torch.Tensor) -> None:
        """Bucket ``b``'s parameters <- ``flat``."""
        unflatten_into(self.bucket_params(b), flat)

    def state_on(self, b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket ``b``'s phi and delta where its update runs (the weights' device), copied there without
        waiting from pinned memory when offloaded."""
        phi, delta = self.phi_flat[b], self.delta_flat[b]
        if phi.device == device:
            return phi, delta
        return phi.to(device, non_blocking=True), delta.to(device, non_blocking=True)

    def store(self, b: int, phi: torch.Tensor, delta: torch.Tensor) -> None:
        """Bucket ``b``'s updated phi and delta into the offloaded state without waiting (the host reads it
        only after :meth:`settle`)."""
        if phi is not self.phi_flat[b]:
            self.phi_flat[b].copy_(phi, non_blocking=True)
            self.delta_flat[b].copy_(delta, non_blocking=True)

    def settle(self) -> None:
        """Waits for the offloaded state's copies from the GPU before the host reads or writes it."""
        device = self.params[0].device
        if device.type == "cuda" and self.phi_flat and self.phi_flat[0].device.type == "cpu":
            torch.cuda.current_stream(device).synchronize()

    def write_back(self, buckets: list[int], checks: DeviceChecks) -> dict[str, float]:
        """Reads an outer step's checks (its one host sync: a non-finite value raises here, before any weight
        changed), then ``theta <- phi`` for ``buckets``; returns the checks' sums."""
        sums = checks.read()
        for b in buckets:
            params = self.bucket_params(b)
            self.set_weights(b, self.phi_flat[b].to(params[0].device, non_blocking=True))
        return sums

    def error_views(self) -> list[torch.Tensor]:
        """The error-feedback buffers, one ``(quantities, *shape)`` view per parameter (empty: none)."""
        views = []
        for b in range(len(self.buckets) if self.has_outer_state else 0):
            views += self.wire.error_views(b, self.bucket_params(b))
        return views

    def reset(self) -> None:
        """phi <- the current weights, delta <- 0, no error owed."""
        for b in range(len(self.phi_flat)):
            self.phi_flat[b].copy_(self.theta(b))
            self.delta_flat[b].zero_()
        if self.has_outer_state:
            self.wire.reset()
