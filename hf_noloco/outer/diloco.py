"""DiLoCo's outer step: the pseudo-gradients ``theta - phi`` are all-reduced over the stage's replicas
(all-gathered as packets with a block-scaled ``outer_dtype``, summed after decoding: a sum of int8 values from
different scales would be wrong), and every replica applies the same momentum step to its slow weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_noloco.engine.comm import exchange, post_collective, wait_collective, wait_sends
from hf_noloco.outer.algorithm import OuterAlgorithm
from hf_noloco.outer.checks import DeviceChecks
from hf_noloco.outer.gossip import diloco_update_
from hf_noloco.outer.state import InFlight, nbytes
from hf_noloco.outer.wire import ring_allreduce_bytes


@dataclass
class DiLoCoFlight(InFlight):
    """A DiLoCo reduction in flight: one collective per bucket."""

    works: list[dist.Work] = field(default_factory=list)
    pseudo: list = field(default_factory=list)  # per bucket: reduced in place, or gathered packets
    own_sums: list[torch.Tensor] = field(default_factory=list)  # per bucket: the own pseudo-gradient's sum


class DiLoCoAllReduce(OuterAlgorithm):
    """``outer_optimizer="diloco"``: the mean pseudo-gradient of all replicas, with momentum."""

    def _what(self, overlapped: bool = False) -> str:
        how = " (overlapped)" if overlapped else ""
        return (
            f"DiLoCo all-reduce of outer step {self.state.outer_step_count}{how} over the replicas of stage "
            f"{self.mesh.stage}"
        )

    def _pseudo(self, b: int, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket ``b``'s pseudo-gradient ``theta - phi`` on the wire, and its sum (a NaN/inf anywhere makes
        it non-finite; checked once the collective is done)."""
        pseudo = theta - self.state.phi_flat[b].to(theta.device, non_blocking=True)
        return self.state.wire.diloco_outgoing(b, pseudo), pseudo.sum()

    def _collective(self, pseudo: torch.Tensor, group, what: str):
        """Posts one bucket's collective: ``(work, what _combine_bucket takes)``. A float pseudo-gradient is
        all-reduced in place; packets are all-gathered and summed after decoding. One replica: none."""
        n = self.mesh.num_replicas
        if not self.state.wire.compressed:
            work = post_collective(dist.all_reduce, pseudo, group=group, what=what) if n > 1 else None
            return work, pseudo
        if n == 1:
            return None, [pseudo]
        gathered = [torch.empty_like(pseudo) for _ in range(n)]
        return post_collective(dist.all_gather, gathered, pseudo, group=group, what=what), gathered

    def step(self, step: int) -> None:
        state, mesh, what = self.state, self.mesh, self._what()
        checks = DeviceChecks()
        for b in range(len(state.buckets)):
            theta = state.theta(b)
            pseudo, own_sum = self._pseudo(b, theta)
            work, result = self._collective(pseudo, mesh.replica_group, f"{what} ({mesh.describe()})")
            if work is not None:
                wait_collective(work, self.p2p_timeout, f"{what} ({mesh.describe()})")
            self._combine_bucket(b, result, own_sum, what, checks)
        state.write_back(list(range(len(state.buckets))), checks)

    def start(self, apply_at: int) -> DiLoCoFlight:
        state, context = self.state, self._what(overlapped=True)
        flight = DiLoCoFlight(apply_at, [], context)
        where = f"{context} ({self.mesh.describe()})"
        for b in range(len(state.buckets)):
            theta = state.theta(b)
            pseudo, own_sum = self._pseudo(b, theta)
            work, result = self._collective(pseudo, self.background_group, where)
            flight.theta.append(theta)
            flight.pseudo.append(result)
            flight.own_sums.append(own_sum)
            if work is not None:
                flight.works.append(work)
        if self.mesh.num_replicas == 1:
            checks = DeviceChecks()
            for b, pseudo in enumerate(flight.pseudo):
                self._combine_bucket(b, pseudo, flight.own_sums[b], context, checks)
            checks.read()
            flight.pseudo, flight.combined = [], True
        return flight

    def combine(self, flight: DiLoCoFlight) -> None:
        checks = DeviceChecks()
        for b, work in enumerate(flight.works):
            wait_collective(work, self.p2p_timeout, f"{flight.context} ({self.mesh.describe()})")
            self._combine_bucket(b, flight.pseudo[b], flight.own_sums[b], flight.context, checks)
        checks.read()  # the outer step's one host sync
        flight.works, flight.pseudo = [], []
        flight.combined = True

    def drop(self, flight: InFlight) -> None:
        for work in getattr(flight, "works", []):
            wait_collective(work, self.p2p_timeout, flight.context)

    def _combine_bucket(self, b: int, pseudo, own_sum: torch.Tensor, what: str, checks: DeviceChecks) -> None:
        """Folds bucket ``b``'s all-reduced pseudo-gradient sum (or its all-gathered packets) into phi and
        delta; its finite checks go to ``checks`` (read after the collective, so that no replica is left
        waiting for one that gave up)."""
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
        own = f"{what}: this replica's own weights ({mesh.describe()}) are not finite."
        checks.check([own_sum], "this replica's own weights", what, message=own)
        mean = wire.diloco_mean(b, pseudo) if wire.compressed else pseudo.float().div_(n)
        averaged = (
            f"{what}: the averaged pseudo-gradient is not finite: another replica of "
            f"stage {mesh.stage} sent NaN/inf weights ({mesh.describe()})."
        )
        checks.check([mean.sum()], "the averaged pseudo-gradient", what, message=averaged)
        phi, delta = state.state_on(b, mean.device)
        s = self.settings
        diloco_update_(phi, delta, mean, s.outer_momentum, s.outer_lr)
        state.store(b, phi, delta)

    def after_update(self) -> None:
        """The first stage's tied copy's phi and delta replace the mirror's (see ``tied_peer``), and the
        mirror's weights become that phi, as the first stage's did."""
        state = self.state
        b = state.tied_bucket
        if b is None or state.tied_peer is None:
            return
        device = state.params[state.buckets[b][0]].device
        phi = state.phi_flat[b].to(device, non_blocking=True)
        delta = state.delta_flat[b].to(device, non_blocking=True)
        context = f"{self.mesh.describe()}: the tied copy's DiLoCo state"
        peer = state.tied_peer
        mine = [] if state.tied_mirror else [(phi, peer), (delta, peer)]
        theirs = [(phi, peer), (delta, peer)] if state.tied_mirror else []
        mesh = self.mesh
        pending = exchange(mine, theirs, self.p2p_timeout, mesh.describe_rank, context, mesh.world_group)
        wait_sends(pending, self.p2p_timeout, context)
        if state.tied_mirror:
            state.phi_flat[b].copy_(phi, non_blocking=True)  # read on the host only after settle()
            state.delta_flat[b].copy_(delta, non_blocking=True)
            state.set_weights(b, phi)
