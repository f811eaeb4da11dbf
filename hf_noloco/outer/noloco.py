"""NoLoCo's outer step: the replicas of a stage split into random gossip groups (pairs by default), each
replica exchanges its fast weights with its partners point to point (no all-reduce, no root rank) and moves
its slow weights towards the group mean with momentum. With gamma == beta only the fast weights cross the
network; otherwise the local progress (theta - phi) and the slow weights do. The equations are
:mod:`hf_noloco.outer.gossip`'s; what travels is :mod:`hf_noloco.outer.wire`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_noloco.engine.comm import PeerError, PendingExchange, exchange, wait_sends
from hf_noloco.outer.algorithm import OuterAlgorithm
from hf_noloco.outer.checks import DeviceChecks
from hf_noloco.outer.gossip import (
    divergence_from_partners,
    group_mean_,
    group_of,
    live_gossip_groups,
    noloco_update_,
    noloco_update_parts_,
)
from hf_noloco.outer.state import InFlight, nbytes


@dataclass
class NoLoCoFlight(InFlight):
    """A NoLoCo exchange in flight: every bucket's messages posted at once."""

    exchange: PendingExchange | None = None
    peers: list[int] = field(default_factory=list)
    outgoing: list[list[torch.Tensor]] = field(default_factory=list)  # per bucket: what we send
    incoming: list[list[list[torch.Tensor]]] = field(default_factory=list)  # per bucket and peer


class NoLoCoExchange(OuterAlgorithm):
    """``outer_optimizer="noloco"``: pair (or group) averaging with modified Nesterov momentum."""

    def _peers(self) -> tuple[list[int], list[list[int]]]:
        """This outer step's partners (global ranks) and the gossip groups they come from."""
        mesh, s = self.mesh, self.settings
        groups = live_gossip_groups(
            mesh.live_replicas, s.gossip_group_size, s.routing_seed, self.state.outer_step_count
        )
        partners = [r for r in group_of(groups, mesh.replica) if r != mesh.replica]
        return [mesh.rank_of(r, mesh.stage) for r in partners], groups

    def _messages(self, b: int, theta: torch.Tensor, peers: list[int]):
        """Bucket ``b``'s messages of this outer step: ``(outgoing, incoming, sends, recvs)``.

        ``outgoing``: what goes to each partner (:meth:`Wire.noloco_outgoing`); our own float32 copy
        ``theta`` stays exact, only the wire copy is rounded.
        ``incoming``: one receive buffer per partner and message. Two messages to the same peer are matched
        in the order listed: theta, then phi."""
        outgoing = self.state.wire.noloco_outgoing(b, theta, self.state.phi_flat[b])
        incoming = [[torch.empty_like(t) for t in outgoing] for _ in peers]
        sends = [(t, peer) for peer in peers for t in outgoing]
        recvs = [(t, peer) for peer, bufs in zip(peers, incoming) for t in bufs]
        return outgoing, incoming, sends, recvs

    def step(self, step: int) -> None:
        state, mesh = self.state, self.mesh
        peers, groups = self._peers()
        context = f"NoLoCo outer step {state.outer_step_count} of {mesh.describe()}"
        checks, combined = DeviceChecks(), []  # read once, in write_back: the outer step's one host sync
        for b in range(len(state.buckets)):
            if self.replica_loss is not None and self.replica_loss.offline:
                state.write_back(combined, checks)
                state.skipped_outer_steps += 1  # no averaging while the live replicas change
                return
            theta = state.theta(b)
            outgoing, incoming, sends, recvs = self._messages(b, theta, peers)
            try:
                # Receives first: both directions of a pair then flow at once under gloo (see comm.post).
                pending = exchange(
                    sends,
                    recvs,
                    self.p2p_timeout,
                    mesh.describe_rank,
                    context,
                    group=mesh.world_group,
                    receives_first=True,
                )
                wait_sends(pending, self.p2p_timeout, context)
            except PeerError as exc:
                if self.replica_loss is None:
                    raise
                # The buckets averaged before the loss take their update; the others keep this replica's
                # weights for this outer step: its progress is carried to the next one.
                state.write_back(combined, checks)
                self.replica_loss.lost_partner(exc, step)
                state.skipped_outer_steps += 1
                return
            self._combine_bucket(b, theta, outgoing, incoming, peers, context, checks)
            combined.append(b)
        sums = state.write_back(combined, checks)  # theta <- phi
        state.last_groups = groups
        state.last_divergence_estimate = divergence_from_partners(
            sums.get("sq_dist", 0.0), len(peers), state.numel, mesh.num_replicas
        )

    def start(self, apply_at: int) -> NoLoCoFlight:
        state = self.state
        peers, groups = self._peers()
        context = f"NoLoCo outer step {state.outer_step_count} (overlapped) of {self.mesh.describe()}"
        flight = NoLoCoFlight(apply_at, [], context, peers=peers)
        sends, recvs = [], []
        for b in range(len(state.buckets)):
            theta = state.theta(b)
            outgoing, incoming, bucket_sends, bucket_recvs = self._messages(b, theta, peers)
            sends += bucket_sends
            recvs += bucket_recvs
            flight.theta.append(theta)
            flight.outgoing.append(outgoing)
            flight.incoming.append(incoming)
        flight.exchange = PendingExchange(sends, recvs, self.background_group, self.mesh.describe_rank)
        state.last_groups = groups
        return flight

    def combine(self, flight: NoLoCoFlight) -> None:
        flight.exchange.wait(self.p2p_timeout, flight.context)
        checks = DeviceChecks()
        for b in range(len(self.state.buckets)):
            self._combine_bucket(
                b,
                flight.theta[b],
                flight.outgoing[b],
                flight.incoming[b],
                flight.peers,
                flight.context,
                checks,
            )
        sums = checks.read()  # the outer step's one host sync
        self.state.last_divergence_estimate = divergence_from_partners(
            sums.get("sq_dist", 0.0), len(flight.peers), self.state.numel, self.mesh.num_replicas
        )
        flight.outgoing, flight.incoming = [], []
        flight.combined = True

    def drop(self, flight: InFlight) -> None:
        if isinstance(flight, NoLoCoFlight) and flight.exchange is not None:
            flight.exchange.wait(self.p2p_timeout, flight.context)

    def _combine_bucket(
        self,
        b: int,
        theta: torch.Tensor,
        outgoing: list[torch.Tensor],
        incoming: list[list[torch.Tensor]],
        peers: list[int],
        context: str,
        checks: DeviceChecks,
    ) -> None:
        """Folds bucket ``b``'s exchange into phi and delta, and gives ``checks`` its finite checks and its
        squared distance to the partners (none for the tied mirror's bucket, which the other stage counts).
        ``theta`` (our float32 fast weights) and the receive buffers are used as scratch space."""
        state, mesh, s = self.state, self.mesh, self.settings
        group_n = len(peers) + 1
        state.bytes_sent += sum(nbytes(t) for t in outgoing) * len(peers)
        state.bytes_received += sum(nbytes(t) for bufs in incoming for t in bufs)
        if state.wire.compressed:
            self._combine_decoded(b, outgoing, incoming, peers, context, checks)
            return
        # Finite checks ride on reductions we need anyway (one pass each, no temporaries): a NaN or inf
        # anywhere makes the sum, or the squared distance to a partner, non-finite.
        checks.check([t.sum() for t in outgoing], "this replica's own weights", context)
        # mean_G theta = theta + (1/n) sum_j (theta_j - theta): computed in place, in the receive buffers
        # and our flat copy of theta (which becomes the mean), with the distances for the estimate.
        diffs = []
        for peer, bufs in zip(peers, incoming):
            diff = bufs[0].float().sub_(theta)  # in place when fp32 (.float() is then a no-op)
            dist_sq = torch.dot(diff, diff)
            checks.check(
                [dist_sq] + [t.sum() for t in bufs[1:]],
                f"the weights received from {mesh.describe_rank(peer)}",
                context,
            )
            if b != state.uncounted_bucket:  # the tied copy counted on the other stage
                checks.add("sq_dist", dist_sq)
            diffs.append(diff)
        theta_mean = group_mean_(theta, diffs)
        del diffs
        phi, delta = state.state_on(b, theta.device)
        phi_mean = None
        if s.sends_slow_weights:
            phi_mean = phi.clone()
            for bufs in incoming:
                phi_mean += bufs[1].float()
            phi_mean /= group_n
        noloco_update_(phi, delta, theta_mean, s.outer_momentum, s.outer_lr, s.outer_averaging, phi_mean)
        state.store(b, phi, delta)

    def _combine_decoded(self, b, outgoing, incoming, peers, context, checks: DeviceChecks) -> None:
        """:meth:`_combine_bucket` for a block-scaled ``outer_dtype``: every member of the group, this replica
        included, enters the means with its *decoded* values, summed in replica order, so all members pull
        towards bit-identical means (docs/compressed-gossip.md)."""
        state, mesh, s = self.state, self.mesh, self.settings
        members = sorted([(mesh.rank, outgoing)] + list(zip(peers, incoming)), key=lambda m: m[0])

        def check(rank, values):
            who = "this replica's own weights" if rank == mesh.rank else None
            who = who or f"the weights received from {mesh.describe_rank(rank)}"
            checks.check([v.sum() for v in values], who, context)

        means, sq_dists = state.wire.combine(b, members, mesh.rank, check, lazy=True)
        if b != state.uncounted_bucket:
            for sq_dist in sq_dists:
                checks.add("sq_dist", sq_dist)
        phi, delta = state.state_on(b, means[0].device)
        if len(means) == 1:  # theta only (gamma == beta)
            noloco_update_(phi, delta, means[0], s.outer_momentum, s.outer_lr, s.outer_averaging)
        else:  # Delta and phi
            noloco_update_parts_(phi, delta, *means, s.outer_momentum, s.outer_lr, s.outer_averaging)
        state.store(b, phi, delta)
