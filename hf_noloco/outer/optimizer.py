"""Outer optimizers over the data-parallel replicas of one pipeline stage: noloco, diloco, ddp, local.

``OuterOptimizer`` wraps the inner optimizer of one stage replica, so the Trainer keeps calling
``optimizer.step()`` / ``zero_grad()``; every ``inner_steps`` steps it runs an outer step:

- ``noloco``: the replicas are split into random gossip groups (pairs by default); each replica exchanges
  its fast weights with its partners point to point (no all-reduce, no root rank) and moves its slow weights
  towards the group mean with momentum. With gamma == beta only the fast weights cross the network.
- ``diloco``: the pseudo-gradients ``theta - phi`` are all-reduced over the stage's replicas (all-gathered
  as packets with a block-scaled ``outer_dtype``: :mod:`hf_noloco.outer.wire`).
- ``ddp``: no outer step; :meth:`OuterOptimizer.reduce_gradients` averages gradients every step.
- ``local``: no synchronisation.

With ``overlap_steps`` (tau) > 0 the exchange of an outer step runs in the background, on a process group
of its own, while the next tau inner steps run. When it ends the outer update is computed from the weights
that were sent (theta_k) and applied keeping the local progress made meanwhile:
``theta <- phi_new + (theta_now - theta_k)``. tau = 0 is the blocking outer step.

The math is in :mod:`hf_noloco.outer.gossip`; this file moves tensors and keeps the state.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_noloco.engine.buffers import flatten, unflatten_into
from hf_noloco.engine.comm import PeerError, PendingExchange, exchange, peer_call, wait_collective, wait_sends
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.outer.checks import check_finite, check_saved_outer
from hf_noloco.outer.gossip import (
    diloco_update_,
    divergence_from_partners,
    group_of,
    live_gossip_groups,
    noloco_update_,
    noloco_update_parts_,
)
from hf_noloco.outer.settings import OuterSettings
from hf_noloco.outer.wire import Wire, buckets_isolating, flat_views, ring_allreduce_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _InFlight:
    """An outer step whose exchange runs in the background (``overlap_steps`` > 0)."""

    method: str
    apply_at: int  # the inner step after which the update is applied
    theta: list[torch.Tensor]  # per bucket: float32 fast weights when the step started (theta_k)
    context: str
    exchange: PendingExchange | None = None  # noloco
    peers: list[int] = field(default_factory=list)  # noloco
    outgoing: list[list[torch.Tensor]] = field(default_factory=list)  # noloco, per bucket: what we send
    incoming: list[list[list[torch.Tensor]]] = field(default_factory=list)  # noloco, per bucket and peer
    works: list[dist.Work] = field(default_factory=list)  # diloco: one collective per bucket
    pseudo: list = field(default_factory=list)  # diloco, per bucket: reduced in place, or gathered packets
    own_finite: list[bool] = field(default_factory=list)  # diloco
    combined: bool = False  # the exchange has ended and phi, delta hold its update


class OuterOptimizer(torch.optim.Optimizer):
    """Wraps the inner optimizer of one stage replica and adds the outer synchronisation over its replicas.

    ``param_groups``, ``defaults`` and ``state`` are the inner optimizer's (the same objects), so LR
    schedulers and Accelerate's ``AcceleratedOptimizer`` work on the wrapper. Build it after
    :func:`broadcast_replica_weights`: the slow weights phi are snapshotted from ``params`` here.

    Args:
        inner: the optimizer of this replica's stage parameters (AdamW, SGD, ...).
        params: the stage's parameters, in an order identical on every replica of the stage.
        mesh: the process mesh; the outer sync runs over ``mesh.replica_group``.
        settings: the method and its hyperparameters (:class:`~hf_noloco.outer.settings.OuterSettings`;
            unset ones are the paper's defaults).
        p2p_timeout: seconds to wait for a peer before raising :class:`~hf_noloco.engine.comm.PeerError`.
        bucket_mb: the outer step works on buckets of at most this many MiB of fp32 weights (one message per
            partner and bucket), which bounds its temporary memory; small enough that CPU allocators reuse the
            temporaries instead of mapping fresh pages every outer step (4x faster on CPU at 64 MiB stages).
            An overlapped outer step (``outer_overlap_steps`` > 0) holds every bucket at once while in
            flight: one float32 copy of the stage, plus what it sends and receives.
        tied_weight: this stage's copy of a weight another stage of the column also holds (the tied
            embeddings, :mod:`hf_noloco.engine.tied`). It gets a bucket of its own, on both stages, so that
            the two copies go through the same arithmetic on the same numbers and stay bit-identical.
        tied_mirror: ``tied_weight`` is the copy counted on the other stage: the partner-distance estimate of
            the divergence leaves it out.
        tied_peer: the global rank that holds the other copy. DiLoCo's all-reduce of the copy runs on two
            process groups (the first stage's replicas and the last stage's), and a backend may sum 3 or more
            terms in a different order on each (NCCL picks ring, tree or NVLS per communicator): after every
            DiLoCo update the first stage sends its copy's slow weights and momentum to the mirror, which
            takes them, so the copies stay identical whatever the backend does.
        background_group: the process group of overlapped exchanges; ``None``:
            ``mesh.background_replica_group()`` (made on first use: collective over every rank).
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        mesh: PipelineMesh,
        settings: OuterSettings | None = None,
        p2p_timeout: float = 300.0,
        bucket_mb: float = 16.0,
        tied_weight: torch.Tensor | None = None,
        tied_mirror: bool = False,
        background_group: dist.ProcessGroup | None = None,
        tied_peer: int | None = None,
    ):
        settings = settings if settings is not None else OuterSettings()
        settings.check_replicas(mesh.num_replicas)
        # torch.optim.Optimizer bookkeeping, without param groups of our own (they are the inner optimizer's).
        torch._C._log_api_usage_once("hf_noloco.outer")
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

        self.inner = inner
        self.mesh = mesh
        self.settings = settings
        self.method = settings.outer_optimizer
        self.p2p_timeout = p2p_timeout
        self.params = list(params)
        if not self.params:
            raise ValueError("OuterOptimizer got an empty parameter list.")
        tied = [i for i, p in enumerate(self.params) if p is tied_weight]
        if tied_weight is not None and not tied:
            raise ValueError("tied_weight is not one of params.")
        self._buckets = buckets_isolating([p.numel() * 4 for p in self.params], bucket_mb * 2**20, tied)
        # The mirror's bucket is left out of the divergence estimate (the other stage counts the weight).
        self._tied_bucket = next((b for b, bucket in enumerate(self._buckets) if bucket == tied), None)
        self._uncounted_bucket = self._tied_bucket if tied_mirror else None
        self.tied_mirror, self.tied_peer = tied_mirror, tied_peer
        self.numel = sum(p.numel() for i, p in enumerate(self.params) if not (tied_mirror and i in tied))

        self.inner_step_count = 0
        self.outer_step_count = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_divergence_estimate: float | None = None
        self.last_groups: list[list[int]] | None = None
        self.just_synced = False
        self._in_flight: _InFlight | None = None
        # on_replica_loss="continue" (set by the trainer): whether this replica may exchange now (not
        # while the live replicas are changing), and what to do when a partner is lost mid-exchange (then
        # the buckets not yet averaged keep this replica's weights for this outer step: no averaging, its
        # progress carried to the next one). None: a lost partner is an error.
        self.exchange_allowed = lambda: True
        self.on_lost_partner = None
        self.skipped_outer_steps = 0
        self._background_group = background_group
        if settings.outer_overlap_steps and background_group is None and mesh.num_replicas > 1:
            self._background_group = mesh.background_replica_group()

        # Slow weights phi and outer momentum delta: one flat float32 buffer per bucket (the outer step works
        # on flat buffers), exposed per parameter as views (what the state dict holds).
        self._phi_flat: list[torch.Tensor] = []
        self._delta_flat: list[torch.Tensor] = []
        self.phi: list[torch.Tensor] = []
        self.delta: list[torch.Tensor] = []
        if settings.has_outer_step:
            state_device = torch.device("cpu") if settings.offload_outer_state else self.params[0].device
            pin = settings.offload_outer_state and torch.cuda.is_available()
            for bucket in self._buckets:
                tensors = [self.params[i] for i in bucket]
                phi = flatten(tensors, torch.float32).to(state_device)
                phi = phi.pin_memory() if pin else phi
                delta = torch.zeros_like(phi)
                self._phi_flat.append(phi)
                self._delta_flat.append(delta)
                self.phi += flat_views(phi, tensors)
                self.delta += flat_views(delta, tensors)
            numels = [sum(self.params[i].numel() for i in bucket) for bucket in self._buckets]
            sends_phi = settings.sends_slow_weights
            self.wire = Wire(settings.outer_dtype, self.method, sends_phi, numels, state_device)

    # --- the torch.optim.Optimizer surface, delegated to the inner optimizer -------------------------------

    @property
    def param_groups(self) -> list[dict]:
        # A property, not a copy: inner.load_state_dict() replaces inner.param_groups with a new list.
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.inner.param_groups = value

    @property
    def defaults(self) -> dict:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self.inner.defaults = value

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"OuterOptimizer({self.settings}, inner={self.inner!r})"

    # --- steps ----------------------------------------------------------------------------------------------

    def step(self, closure=None):
        """One inner step; every ``inner_steps`` of them (noloco, diloco) also an outer step: a blocking
        one, or with ``overlap_steps`` = tau one that starts now and is applied after the tau-th next inner
        step."""
        loss = self.inner.step() if closure is None else self.inner.step(closure)
        self.inner_step_count += 1
        self.just_synced = False
        if self._in_flight is not None and self.inner_step_count >= self._in_flight.apply_at:
            self.finish_outer_step()
        if self.settings.has_outer_step and self.inner_step_count % self.settings.inner_steps == 0:
            if self.settings.outer_overlap_steps:
                self.start_outer_step()
            else:
                self.outer_step()
        return loss

    @torch.no_grad()
    def outer_step(self) -> None:
        """Runs one blocking outer step now (normally called by :meth:`step`). Collective over the stage's
        replicas. An overlapped step still in flight is finished first."""
        self.finish_outer_step()
        if self.method == "noloco":
            self._noloco_step()
        elif self.method == "diloco":
            self._diloco_step()
            self._share_tied_state()
        else:
            return
        self.outer_step_count += 1
        self.just_synced = True

    @property
    def outer_step_in_flight(self) -> bool:
        """Whether an overlapped outer step has started and not yet been applied."""
        return self._in_flight is not None

    @torch.no_grad()
    def start_outer_step(self) -> None:
        """Posts this outer step's exchange in the background and returns at once; the update is applied by
        the ``overlap_steps``-th next :meth:`step` (or :meth:`finish_outer_step`). Collective over the
        stage's replicas, as every replica starts it at the same inner step."""
        self.finish_outer_step()
        if not self.settings.has_outer_step:
            return
        apply_at = self.inner_step_count + self.settings.outer_overlap_steps
        if self.method == "noloco":
            self._in_flight = self._start_noloco(apply_at)
        else:
            self._in_flight = self._start_diloco(apply_at)
        self.outer_step_count += 1

    @torch.no_grad()
    def finish_outer_step(self) -> None:
        """Waits for the in-flight outer step's exchange (if any) and applies its update now, keeping the
        local progress made since it started: ``theta <- phi_new + (theta_now - theta_k)``. At the end of
        training this applies the last outer step, whatever ``overlap_steps`` has left of it."""
        flight = self._in_flight
        if flight is None:
            return
        # Local progress first: the combination uses theta_k (flight.theta) as scratch space.
        progress = [
            flatten([self.params[i] for i in bucket], torch.float32).sub_(sent)
            for bucket, sent in zip(self._buckets, flight.theta)
        ]
        if not flight.combined:
            self._combine_in_flight(flight)
        if flight.method == "diloco":
            self._share_tied_state()
        for b, bucket in enumerate(self._buckets):
            now = progress[b].add_(self._phi_flat[b].to(progress[b].device))
            unflatten_into([self.params[i] for i in bucket], now)
        self._in_flight = None
        self.just_synced = True

    def _combine_in_flight(self, flight: _InFlight) -> None:
        """Waits for the exchange and folds it into phi and delta (``flight.theta`` is used up)."""
        if flight.method == "noloco":
            flight.exchange.wait(self.p2p_timeout, flight.context)
            sq_dist = 0.0
            for b in range(len(self._buckets)):
                sq_dist += self._noloco_combine(
                    b, flight.theta[b], flight.outgoing[b], flight.incoming[b], flight.peers, flight.context
                )
            self.last_divergence_estimate = divergence_from_partners(
                sq_dist, len(flight.peers), self.numel, self.mesh.num_replicas
            )
        else:
            for b, work in enumerate(flight.works):
                wait_collective(work, self.p2p_timeout, f"{flight.context} ({self.mesh.describe()})")
                self._diloco_combine(b, flight.pseudo[b], flight.own_finite[b], flight.context)
        flight.outgoing, flight.incoming, flight.works, flight.pseudo = [], [], [], []
        flight.combined = True

    def _start_noloco(self, apply_at: int) -> _InFlight:
        peers, groups = self._noloco_peers()
        context = f"NoLoCo outer step {self.outer_step_count} (overlapped) of {self.mesh.describe()}"
        flight = _InFlight("noloco", apply_at, [], context, peers=peers)
        sends, recvs = [], []
        for b, bucket in enumerate(self._buckets):
            theta = flatten([self.params[i] for i in bucket], torch.float32)
            outgoing, incoming, bucket_sends, bucket_recvs = self._noloco_messages(b, theta, peers)
            sends += bucket_sends
            recvs += bucket_recvs
            flight.theta.append(theta)
            flight.outgoing.append(outgoing)
            flight.incoming.append(incoming)
        flight.exchange = PendingExchange(sends, recvs, self._background_group, self.mesh.describe_rank)
        self.last_groups = groups
        return flight

    def _start_diloco(self, apply_at: int) -> _InFlight:
        mesh, n = self.mesh, self.mesh.num_replicas
        context = (
            f"DiLoCo all-reduce of outer step {self.outer_step_count} (overlapped) over the replicas of "
            f"stage {mesh.stage}"
        )
        flight = _InFlight("diloco", apply_at, [], context)
        for b, bucket in enumerate(self._buckets):
            theta = flatten([self.params[i] for i in bucket], torch.float32)
            pseudo, own_finite = self._diloco_pseudo(b, theta)
            work, result = self._diloco_collective(pseudo, self._background_group)
            flight.theta.append(theta)
            flight.pseudo.append(result)
            flight.own_finite.append(own_finite)
            if work is not None:
                flight.works.append(work)
        if n == 1:
            for b, pseudo in enumerate(flight.pseudo):
                self._diloco_combine(b, pseudo, flight.own_finite[b], context)
            flight.pseudo, flight.combined = [], True
        return flight

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """``ddp``: averages the gradients over the stage's replicas (call after backward, before clipping).

        A no-op for the other methods. A parameter without a gradient contributes zeros and stays without one.
        """
        n = self.mesh.num_replicas
        if self.method != "ddp" or n == 1:
            return
        for bucket in self._buckets:
            params = [self.params[i] for i in bucket]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            dtypes = {g.dtype for g in grads}
            flat = flatten(grads, dtypes.pop() if len(dtypes) == 1 else torch.float32)
            work = dist.all_reduce(flat, group=self.mesh.replica_group, async_op=True)
            wait_collective(
                work,
                self.p2p_timeout,
                f"ddp gradient all-reduce over the replicas of stage {self.mesh.stage} "
                f"({self.mesh.describe()})",
            )
            unflatten_into(grads, flat.div_(n))  # the zeros standing in for missing gradients are dropped
            traffic = ring_allreduce_bytes(_nbytes(flat), n)
            self.bytes_sent += traffic
            self.bytes_received += traffic

    def _noloco_peers(self) -> tuple[list[int], list[list[int]]]:
        """This outer step's partners (global ranks) and the gossip groups they come from."""
        mesh, settings = self.mesh, self.settings
        groups = live_gossip_groups(
            mesh.live_replicas, settings.gossip_group_size, settings.routing_seed, self.outer_step_count
        )
        partners = [r for r in group_of(groups, mesh.replica) if r != mesh.replica]
        return [mesh.rank_of(r, mesh.stage) for r in partners], groups

    def _noloco_messages(self, b: int, theta: torch.Tensor, peers: list[int]):
        """Bucket ``b``'s messages of this outer step: ``(outgoing, incoming, sends, recvs)``.

        ``outgoing``: what goes to each partner (:meth:`Wire.noloco_outgoing`); our own float32 copy
        ``theta`` stays exact, only the wire copy is rounded.
        ``incoming``: one receive buffer per partner and message. Two messages to the same peer are matched
        in the order listed: theta, then phi."""
        outgoing = self.wire.noloco_outgoing(b, theta, self._phi_flat[b])
        incoming = [[torch.empty_like(t) for t in outgoing] for _ in peers]
        sends = [(t, peer) for peer in peers for t in outgoing]
        recvs = [(t, peer) for peer, bufs in zip(peers, incoming) for t in bufs]
        return outgoing, incoming, sends, recvs

    def _noloco_step(self) -> None:
        mesh = self.mesh
        peers, groups = self._noloco_peers()
        context = f"NoLoCo outer step {self.outer_step_count} of {mesh.describe()}"
        sq_dist = 0.0
        for b, bucket in enumerate(self._buckets):
            if not self.exchange_allowed():
                self.skipped_outer_steps += 1
                return
            params = [self.params[i] for i in bucket]
            theta = flatten(params, torch.float32)
            outgoing, incoming, sends, recvs = self._noloco_messages(b, theta, peers)
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
                if self.on_lost_partner is None:
                    raise
                self.on_lost_partner(exc)
                self.skipped_outer_steps += 1
                return
            sq_dist += self._noloco_combine(b, theta, outgoing, incoming, peers, context)
            unflatten_into(params, self._phi_flat[b].to(theta.device))  # theta <- phi
        self.last_groups = groups
        self.last_divergence_estimate = divergence_from_partners(
            sq_dist, len(peers), self.numel, mesh.num_replicas
        )

    def _noloco_combine(
        self,
        b: int,
        theta: torch.Tensor,
        outgoing: list[torch.Tensor],
        incoming: list[list[torch.Tensor]],
        peers: list[int],
        context: str,
    ) -> float:
        """Folds bucket ``b``'s exchange into phi and delta; returns the squared distance to the partners (0
        for the tied mirror's bucket, which the other stage counts).
        ``theta`` (our float32 fast weights) and the receive buffers are used as scratch space."""
        mesh, settings = self.mesh, self.settings
        group_n = len(peers) + 1
        self.bytes_sent += sum(_nbytes(t) for t in outgoing) * len(peers)
        self.bytes_received += sum(_nbytes(t) for bufs in incoming for t in bufs)
        if self.wire.compressed:
            return self._noloco_combine_decoded(b, outgoing, incoming, peers, context)
        # Finite checks ride on reductions we need anyway (one pass each, no temporaries): a NaN or inf
        # anywhere makes the sum, or the squared distance to a partner, non-finite.
        check_finite([t.sum() for t in outgoing], "this replica's own weights", context)
        # mean_G theta = theta + (1/n) sum_j (theta_j - theta): computed in place, in the receive buffers
        # and our flat copy of theta (which becomes the mean), with the distances for the estimate.
        sq_dist = 0.0
        diffs = []
        for peer, bufs in zip(peers, incoming):
            diff = bufs[0].float().sub_(theta)  # in place when fp32 (.float() is then a no-op)
            dist_sq = torch.dot(diff, diff)
            check_finite(
                [dist_sq] + [t.sum() for t in bufs[1:]],
                f"the weights received from {mesh.describe_rank(peer)}",
                context,
            )
            if b != self._uncounted_bucket:  # the tied copy counted on the other stage
                sq_dist += dist_sq.item()
            diffs.append(diff)
        theta_mean = theta
        for diff in diffs:
            theta_mean.add_(diff, alpha=1.0 / group_n)
        del diffs
        phi_mean = None
        if settings.sends_slow_weights:
            phi_mean = self._phi_flat[b].to(theta.device, copy=True)
            for bufs in incoming:
                phi_mean += bufs[1].float()
            phi_mean /= group_n
            phi_mean = phi_mean.to(self._phi_flat[b].device)
        noloco_update_(
            self._phi_flat[b],
            self._delta_flat[b],
            theta_mean.to(self._phi_flat[b].device),
            settings.outer_momentum,
            settings.outer_lr,
            settings.outer_averaging,
            phi_mean,
        )
        return sq_dist

    def _noloco_combine_decoded(self, b, outgoing, incoming, peers, context) -> float:
        """:meth:`_noloco_combine` for a block-scaled ``outer_dtype``: every member of the group, this replica
        included, enters the means with its *decoded* values, summed in replica order, so all members pull
        towards bit-identical means (docs/compressed-gossip.md)."""
        mesh, s = self.mesh, self.settings
        members = sorted([(mesh.rank, outgoing)] + list(zip(peers, incoming)), key=lambda m: m[0])

        def check(rank, values):
            who = "this replica's own weights" if rank == mesh.rank else None
            who = who or f"the weights received from {mesh.describe_rank(rank)}"
            check_finite([v.sum() for v in values], who, context)

        means, sq_dists = self.wire.combine(b, members, mesh.rank, check)
        sq_dist = sum(sq_dists) if b != self._uncounted_bucket else 0.0
        phi, delta = self._phi_flat[b], self._delta_flat[b]
        means = [m.to(phi.device) for m in means]
        if len(means) == 1:  # theta only (gamma == beta)
            noloco_update_(phi, delta, means[0], s.outer_momentum, s.outer_lr, s.outer_averaging)
        else:  # Delta and phi
            noloco_update_parts_(phi, delta, *means, s.outer_momentum, s.outer_lr, s.outer_averaging)
        return sq_dist

    def _diloco_collective(self, pseudo: torch.Tensor, group) -> tuple[dist.Work | None, object]:
        """Posts one bucket's collective: ``(work, what _diloco_combine takes)``. A float pseudo-gradient is
        all-reduced in place; packets are all-gathered (a sum of int8 values from different scales would be
        wrong) and summed after decoding. One replica: no collective."""
        n = self.mesh.num_replicas
        if not self.wire.compressed:
            return (dist.all_reduce(pseudo, group=group, async_op=True) if n > 1 else None), pseudo
        if n == 1:
            return None, [pseudo]
        gathered = [torch.empty_like(pseudo) for _ in range(n)]
        return dist.all_gather(gathered, pseudo, group=group, async_op=True), gathered

    def _diloco_step(self) -> None:
        mesh = self.mesh
        what = (
            f"DiLoCo all-reduce of outer step {self.outer_step_count} over the replicas of stage {mesh.stage}"
        )
        for b, bucket in enumerate(self._buckets):
            params = [self.params[i] for i in bucket]
            theta = flatten(params, torch.float32)
            pseudo, own_finite = self._diloco_pseudo(b, theta)
            work, result = self._diloco_collective(pseudo, mesh.replica_group)
            if work is not None:
                wait_collective(work, self.p2p_timeout, f"{what} ({mesh.describe()})")
            self._diloco_combine(b, result, own_finite, what)
            unflatten_into(params, self._phi_flat[b].to(theta.device))

    def _share_tied_state(self) -> None:
        """The first stage's tied copy's phi and delta replace the mirror's (see ``tied_peer``), and the
        mirror's weights become that phi, as the first stage's did."""
        b = self._tied_bucket
        if b is None or self.tied_peer is None:
            return
        device = self.params[self._buckets[b][0]].device
        phi, delta = self._phi_flat[b].to(device), self._delta_flat[b].to(device)
        context = f"{self.mesh.describe()}: the tied copy's DiLoCo state"
        mine = [] if self.tied_mirror else [(phi, self.tied_peer), (delta, self.tied_peer)]
        theirs = [(phi, self.tied_peer), (delta, self.tied_peer)] if self.tied_mirror else []
        pending = exchange(
            mine, theirs, self.p2p_timeout, self.mesh.describe_rank, context, self.mesh.world_group
        )
        wait_sends(pending, self.p2p_timeout, context)
        if self.tied_mirror:
            self._phi_flat[b].copy_(phi)
            self._delta_flat[b].copy_(delta)
            unflatten_into([self.params[i] for i in self._buckets[b]], phi)

    def _diloco_pseudo(self, b: int, theta: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Bucket ``b``'s pseudo-gradient ``theta - phi`` on the wire, and whether it is finite."""
        pseudo = theta - self._phi_flat[b].to(theta.device)
        finite = bool(torch.isfinite(pseudo.sum()))  # a NaN/inf anywhere makes the sum non-finite
        return self.wire.diloco_outgoing(b, pseudo), finite

    def _diloco_combine(self, b: int, pseudo, own_finite: bool, what: str) -> None:
        """Folds bucket ``b``'s all-reduced pseudo-gradient sum (or its all-gathered packets) into phi and
        delta."""
        mesh, n = self.mesh, self.mesh.num_replicas
        if n > 1:
            # A ring all-gather sends each of the other n - 1 packets on once.
            gathered = self.wire.compressed
            traffic = (n - 1) * _nbytes(pseudo[0]) if gathered else ring_allreduce_bytes(_nbytes(pseudo), n)
            self.bytes_sent += traffic
            self.bytes_received += traffic
        # Check after the collective, so that no replica is left waiting for one that gave up.
        if not own_finite:
            raise FloatingPointError(
                f"{what}: this replica's own weights ({mesh.describe()}) are not finite."
            )
        mean = self.wire.diloco_mean(b, pseudo) if self.wire.compressed else pseudo.float().div_(n)
        if not bool(torch.isfinite(mean.sum())):
            raise FloatingPointError(
                f"{what}: the averaged pseudo-gradient is not finite: another replica of "
                f"stage {mesh.stage} sent NaN/inf weights ({mesh.describe()})."
            )
        mean = mean.to(self._phi_flat[b].device)
        s = self.settings
        diloco_update_(self._phi_flat[b], self._delta_flat[b], mean, s.outer_momentum, s.outer_lr)

    def _error_views(self) -> list[torch.Tensor]:
        """The error-feedback buffers, one ``(quantities, *shape)`` view per parameter (empty: none)."""
        views = []
        for b, bucket in enumerate(self._buckets if self._phi_flat else []):
            views += self.wire.error_views(b, [self.params[i] for i in bucket])
        return views

    def reset_outer_state(self) -> None:
        """phi <- the current weights, delta <- 0 (e.g. after loading weights into the model). An outer step
        in flight is waited for and dropped."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None and not flight.combined:
            if flight.exchange is not None:
                flight.exchange.wait(self.p2p_timeout, flight.context)
            for work in flight.works:
                wait_collective(work, self.p2p_timeout, flight.context)
        with torch.no_grad():
            for b, bucket in enumerate(self._buckets):
                if self._phi_flat:
                    self._phi_flat[b].copy_(flatten([self.params[i] for i in bucket], torch.float32))
                    self._delta_flat[b].zero_()
            if self._phi_flat:
                self.wire.reset()

    # --- checkpointing --------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The inner optimizer's state dict plus an ``"outer"`` entry: phi, delta (one tensor per parameter,
        in ``params`` order), the step and byte counters and the settings they were made with.

        With an overlapped outer step in flight, its exchange is waited for and folded into phi and delta
        now (as it would be when applied: same inputs, same result), and ``"in_flight"`` keeps what applying
        it still needs: the weights it sent and the step after which it is applied. A resumed run therefore
        continues exactly like an uninterrupted one."""
        flight = self._in_flight
        if flight is not None and not flight.combined:
            with torch.no_grad():
                sent = [t.clone() for t in flight.theta]
                self._combine_in_flight(flight)
                flight.theta = sent
        state = dict(self.inner.state_dict())
        state["outer"] = {
            "method": self.method,
            "inner_step_count": self.inner_step_count,
            "outer_step_count": self.outer_step_count,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "last_divergence_estimate": self.last_divergence_estimate,
            "phi": list(self.phi),
            "delta": list(self.delta),
            "error_feedback": self._error_views(),
        }
        if flight is not None:
            sent = []
            for b, bucket in enumerate(self._buckets):
                sent += flat_views(flight.theta[b], [self.params[i] for i in bucket])
            state["outer"]["in_flight"] = {"apply_at": flight.apply_at, "theta": sent}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what :meth:`state_dict` saved; phi and delta are copied into this optimizer's own buffers
        (so they keep their device, e.g. the CPU when offloaded)."""
        state_dict = dict(state_dict)
        outer = state_dict.pop("outer", None)
        errors = self._error_views()
        check_saved_outer(outer, self.method, self.phi, self.delta, errors, len(self.params))
        saved_errors = outer.get("error_feedback") or []
        self.inner.load_state_dict(state_dict)
        with torch.no_grad():
            for saved, mine in zip(outer["phi"] + outer["delta"], self.phi + self.delta):
                mine.copy_(saved)
            # Saved without (a float outer_dtype, or an older run): nothing is owed yet.
            for k, mine in enumerate(errors):
                mine.copy_(saved_errors[k]) if saved_errors else mine.zero_()
        self.inner_step_count = int(outer["inner_step_count"])
        self.outer_step_count = int(outer["outer_step_count"])
        self.bytes_sent = int(outer["bytes_sent"])
        self.bytes_received = int(outer["bytes_received"])
        self.last_divergence_estimate = outer.get("last_divergence_estimate")
        self._in_flight = None
        saved = outer.get("in_flight")
        if saved is not None:
            device = self.params[0].device
            theta = [
                flatten([saved["theta"][i] for i in bucket], torch.float32).to(device)
                for bucket in self._buckets
            ]
            context = f"outer step {self.outer_step_count - 1} of {self.mesh.describe()}"
            self._in_flight = _InFlight(self.method, int(saved["apply_at"]), theta, context, combined=True)


@torch.no_grad()
def broadcast_replica_weights(module: torch.nn.Module, mesh: PipelineMesh) -> None:
    """Makes every replica of a stage start identical: replica 0's parameters and buffers are broadcast
    within the stage's replica group. Collective over every rank; call it before building the optimizers."""
    if mesh.num_replicas == 1:
        return
    src = mesh.rank_of(0, mesh.stage)
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    for t in tensors:  # once at start-up: one message per tensor is fine
        buf = t if t.is_contiguous() else t.contiguous()
        with peer_call("the start-up broadcast of replica 0's weights"):
            dist.broadcast(buf, src=src, group=mesh.replica_group)
        if buf is not t:
            t.copy_(buf)
