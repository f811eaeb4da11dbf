"""DiLoCo's outer step: the pseudo-gradients ``theta - phi`` are all-reduced over the stage's replicas
(all-gathered as packets with a block-scaled ``outer_dtype``, summed after decoding: a sum of int8 values from
different scales would be wrong), and every replica applies the same momentum step to its slow weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_noloco.engine.comm import exchange, wait_collective, wait_sends
from hf_noloco.outer.algorithm import OuterAlgorithm
from hf_noloco.outer.gossip import diloco_update_
from hf_noloco.outer.state import InFlight, nbytes
from hf_noloco.outer.wire import ring_allreduce_bytes


@dataclass
class DiLoCoFlight(InFlight):
    """A DiLoCo reduction in flight: one collective per bucket."""

    works: list[dist.Work] = field(default_factory=list)
    pseudo: list = field(default_factory=list)  # per bucket: reduced in place, or gathered packets
    own_finite: list[bool] = field(default_factory=list)


class DiLoCoAllReduce(OuterAlgorithm):
    """``outer_optimizer="diloco"``: the mean pseudo-gradient of all replicas, with momentum."""

    def _what(self, overlapped: bool = False) -> str:
        how = " (overlapped)" if overlapped else ""
        return (
            f"DiLoCo all-reduce of outer step {self.state.outer_step_count}{how} over the replicas of stage "
            f"{self.mesh.stage}"
        )

    def _pseudo(self, b: int, theta: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Bucket ``b``'s pseudo-gradient ``theta - phi`` on the wire, and whether it is finite."""
        pseudo = theta - self.state.phi_flat[b].to(theta.device)
        finite = bool(torch.isfinite(pseudo.sum()))  # a NaN/inf anywhere makes the sum non-finite
        return self.state.wire.diloco_outgoing(b, pseudo), finite

    def _collective(self, pseudo: torch.Tensor, group) -> tuple[dist.Work | None, object]:
        """Posts one bucket's collective: ``(work, what _combine_bucket takes)``. A float pseudo-gradient is
        all-reduced in place; packets are all-gathered and summed after decoding. One replica: none."""
        n = self.mesh.num_replicas
        if not self.state.wire.compressed:
            return (dist.all_reduce(pseudo, group=group, async_op=True) if n > 1 else None), pseudo
        if n == 1:
            return None, [pseudo]
        gathered = [torch.empty_like(pseudo) for _ in range(n)]
        return dist.all_gather(gathered, pseudo, group=group, async_op=True), gathered

    def step(self, step: int) -> None:
        state, mesh, what = self.state, self.mesh, self._what()
        for b in range(len(state.buckets)):
            theta = state.theta(b)
            pseudo, own_finite = self._pseudo(b, theta)
            work, result = self._collective(pseudo, mesh.replica_group)
            if work is not None:
                wait_collective(work, self.p2p_timeout, f"{what} ({mesh.describe()})")
            self._combine_bucket(b, result, own_finite, what)
            state.set_weights(b, state.phi_flat[b].to(theta.device))

    def start(self, apply_at: int) -> DiLoCoFlight:
        state, context = self.state, self._what(overlapped=True)
        flight = DiLoCoFlight(apply_at, [], context)
        for b in range(len(state.buckets)):
            theta = state.theta(b)
            pseudo, own_finite = self._pseudo(b, theta)
            work, result = self._collective(pseudo, self.background_group)
            flight.theta.append(theta)
            flight.pseudo.append(result)
            flight.own_finite.append(own_finite)
            if work is not None:
                flight.works.append(work)
        if self.mesh.num_replicas == 1:
            for b, pseudo in enumerate(flight.pseudo):
                self._combine_bucket(b, pseudo, flight.own_finite[b], context)
            flight.pseudo, flight.combined = [], True
        return flight

    def combine(self, flight: DiLoCoFlight) -> None:
        for b, work in enumerate(flight.works):
            wait_collective(work, self.p2p_timeout, f"{flight.context} ({self.mesh.describe()})")
            self._combine_bucket(b, flight.pseudo[b], flight.own_finite[b], flight.context)
        flight.works, flight.pseudo = [], []
        flight.combined = True

    def drop(self, flight: InFlight) -> None:
        for work in getattr(flight, "works", []):
            wait_collective(work, self.p2p_timeout, flight.context)

    def _combine_bucket(self, b: int, pseudo, own_finite: bool, what: str) -> None:
        """Folds bucket ``b``'s all-reduced pseudo-gradient sum (or its all-gathered packets) into phi and
        delta."""
        state, mesh, n = self.state, self.mesh, self.mesh.num_replicas
        wire = state.wire
        if n > 1:
            # A ring all-gather sends each of the other n - 1 packets on once.
            if wire.compressed:
                traffic = (n - 1) * nbytes(pseudo[0])
            else:
                traffic = ring_allreduce_bytes(nbytes(pseudo), n)
            state.bytes_sent += traffic
            state.bytes_received += traffic
        # Check after the collective, so that no replica is left waiting for one that gave up.
        if not own_finite:
            raise FloatingPointError(
                f"{what}: this replica's own weights ({mesh.describe()}) are not finite."
            )
        mean = wire.diloco_mean(b, pseudo) if wire.compressed else pseudo.float().div_(n)
        if not bool(torch.isfinite(mean.sum())):
            raise FloatingPointError(
                f"{what}: the averaged pseudo-gradient is not finite: another replica of "
                f"stage {mesh.stage} sent NaN/inf weights ({mesh.describe()})."
            )
        mean = mean.to(state.phi_flat[b].device)
        s = self.settings
        diloco_update_(state.phi_flat[b], state.delta_flat[b], mean, s.outer_momentum, s.outer_lr)

    def after_update(self) -> None:
        """The first stage's tied copy's phi and delta replace the mirror's (see ``tied_peer``), and the
        mirror's weights become that phi, as the first stage's did."""
        state = self.state
        b = state.tied_bucket
        if b is None or state.tied_peer is None:
            return
        device = state.params[state.buckets[b][0]].device
        phi, delta = state.phi_flat[b].to(device), state.delta_flat[b].to(device)
        context = f"{self.mesh.describe()}: the tied copy's DiLoCo state"
        peer = state.tied_peer
        mine = [] if state.tied_mirror else [(phi, peer), (delta, peer)]
        theirs = [(phi, peer), (delta, peer)] if state.tied_mirror else []
        mesh = self.mesh
        pending = exchange(mine, theirs, self.p2p_timeout, mesh.describe_rank, context, mesh.world_group)
        wait_sends(pending, self.p2p_timeout, context)
        if state.tied_mirror:
            state.phi_flat[b].copy_(phi)
            state.delta_flat[b].copy_(delta)
            state.set_weights(b, phi)
