"""The outer optimizer of one pipeline-stage replica: the inner optimizer wrapped, with an outer step every
``inner_steps`` steps over the stage's replicas.

``OuterOptimizer`` keeps the ``torch.optim.Optimizer`` surface (the Trainer keeps calling ``step()`` /
``zero_grad()``), the schedule of outer steps, their overlap, where the outer state lives (offload) and the
state dict. What an outer step sends and how it is combined is its method's, one class each:

- ``noloco`` (:class:`~hf_noloco.outer.noloco.NoLoCoExchange`): random gossip groups, pair averaging with
  modified Nesterov momentum, point to point;
- ``diloco`` (:class:`~hf_noloco.outer.diloco.DiLoCoAllReduce`): the pseudo-gradients all-reduced;
- ``ddp`` (:class:`~hf_noloco.outer.baselines.DataParallel`): no outer step, gradients averaged every step;
- ``local`` (:class:`~hf_noloco.outer.baselines.NoSync`): no synchronisation.

With ``overlap_steps`` (tau) > 0 the exchange of an outer step runs in the background, on a process group
of its own, while the next tau inner steps run. When it ends the outer update is computed from the weights
that were sent (theta_k) and applied keeping the local progress made meanwhile:
``theta <- phi_new + (theta_now - theta_k)``. tau = 0 is the blocking outer step.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

from hf_noloco.engine.buffers import flatten
from hf_noloco.engine.comm import peer_call
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.outer.algorithm import OuterAlgorithm, ReplicaLossGuard
from hf_noloco.outer.baselines import DataParallel, NoSync
from hf_noloco.outer.checks import check_saved_outer
from hf_noloco.outer.diloco import DiLoCoAllReduce
from hf_noloco.outer.noloco import NoLoCoExchange
from hf_noloco.outer.settings import OuterSettings
from hf_noloco.outer.state import InFlight, OuterState
from hf_noloco.outer.wire import flat_views

ALGORITHMS: dict[str, type[OuterAlgorithm]] = {
    "noloco": NoLoCoExchange,
    "diloco": DiLoCoAllReduce,
    "ddp": DataParallel,
    "local": NoSync,
}


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
        background_group: the process group of overlapped exchanges; ``None``:
            ``mesh.background_replica_group()`` (made on first use: collective over every rank).
        tied_peer: the global rank that holds the other copy. DiLoCo's all-reduce of the copy runs on two
            process groups (the first stage's replicas and the last stage's), and a backend may sum 3 or more
            terms in a different order on each (NCCL picks ring, tree or NVLS per communicator): after every
            DiLoCo update the first stage sends its copy's slow weights and momentum to the mirror, which
            takes them, so the copies stay identical whatever the backend does.
        replica_loss: the run's ``on_replica_loss`` policy (:mod:`hf_noloco.resilience.policy`): no averaging
            while it is ``offline`` (the live replicas are changing), and a partner lost mid-exchange is its
            to decide (``lost_partner``; the buckets not yet averaged then keep this replica's weights for
            this outer step). ``None``: a lost partner is an error.
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
        replica_loss: ReplicaLossGuard | None = None,
    ):
        settings = settings if settings is not None else OuterSettings()
        settings.check_replicas(mesh.num_replicas)
        # torch.optim.Optimizer's bookkeeping, without param groups of our own (the inner optimizer's).
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

        self.inner, self.mesh, self.settings, self.p2p_timeout = inner, mesh, settings, p2p_timeout
        self.method = settings.outer_optimizer
        self.outer_state = OuterState.build(
            list(params), settings, bucket_mb, tied_weight, tied_mirror, tied_peer
        )
        if settings.outer_overlap_steps and background_group is None and mesh.num_replicas > 1:
            background_group = mesh.background_replica_group()
        self.algorithm = ALGORITHMS[self.method](
            self.outer_state, mesh, settings, p2p_timeout, replica_loss, background_group
        )
        self.inner_step_count = 0
        self.just_synced = False
        self._in_flight: InFlight | None = None

    # --- what the logs, tests and checkpoints read of the outer state ---------------------------------------

    params = property(lambda self: self.outer_state.params)
    phi = property(lambda self: self.outer_state.phi, doc="The slow weights, one view per parameter.")
    delta = property(lambda self: self.outer_state.delta, doc="The outer momentum, one view per parameter.")
    numel = property(lambda self: self.outer_state.numel)
    wire = property(lambda self: self.outer_state.wire)
    bytes_sent = property(lambda self: self.outer_state.bytes_sent)
    bytes_received = property(lambda self: self.outer_state.bytes_received)
    outer_step_count = property(lambda self: self.outer_state.outer_step_count)
    skipped_outer_steps = property(lambda self: self.outer_state.skipped_outer_steps)
    last_divergence_estimate = property(lambda self: self.outer_state.last_divergence_estimate)
    last_groups = property(lambda self: self.outer_state.last_groups)

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
        if not self.settings.has_outer_step:
            return
        self.algorithm.step(self.inner_step_count)
        self.algorithm.after_update()
        self.outer_state.outer_step_count += 1
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
        self._in_flight = self.algorithm.start(self.inner_step_count + self.settings.outer_overlap_steps)
        self.outer_state.outer_step_count += 1

    @torch.no_grad()
    def finish_outer_step(self) -> None:
        """Waits for the in-flight outer step's exchange (if any) and applies its update now, keeping the
        local progress made since it started: ``theta <- phi_new + (theta_now - theta_k)``. At the end of
        training this applies the last outer step, whatever ``overlap_steps`` has left of it."""
        flight, outer = self._in_flight, self.outer_state
        if flight is None:
            return
        # Local progress first: the combination uses theta_k (flight.theta) as scratch space.
        progress = [outer.theta(b).sub_(sent) for b, sent in enumerate(flight.theta)]
        if not flight.combined:
            self.algorithm.combine(flight)
        self.algorithm.after_update()
        for b, local in enumerate(progress):
            outer.set_weights(b, local.add_(outer.phi_flat[b].to(local.device, non_blocking=True)))
        self._in_flight = None
        self.just_synced = True

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """``ddp``: averages the gradients over the stage's replicas (call after backward, before clipping).
        A no-op for the other methods."""
        self.algorithm.reduce_gradients()

    def reset_outer_state(self) -> None:
        """phi <- the current weights, delta <- 0 (e.g. after loading weights into the model). An outer step
        in flight is waited for and dropped."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None and not flight.combined:
            self.algorithm.drop(flight)
        self.outer_state.settle()
        with torch.no_grad():
            self.outer_state.reset()

    # --- checkpointing --------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The inner optimizer's state dict plus an ``"outer"`` entry: phi, delta (one tensor per parameter,
        in ``params`` order), the step and byte counters and the settings they were made with.

        With an overlapped outer step in flight, its exchange is waited for and folded into phi and delta
        now (as it would be when applied: same inputs, same result), and ``"in_flight"`` keeps what applying
        it still needs: the weights it sent and the step after which it is applied. A resumed run therefore
        continues exactly like an uninterrupted one."""
        flight, outer = self._in_flight, self.outer_state
        if flight is not None and not flight.combined:
            with torch.no_grad():
                sent = [t.clone() for t in flight.theta]
                self.algorithm.combine(flight)
                flight.theta = sent
        outer.settle()
        state = dict(self.inner.state_dict())
        state["outer"] = {
            "method": self.method,
            "inner_step_count": self.inner_step_count,
            "outer_step_count": outer.outer_step_count,
            "bytes_sent": outer.bytes_sent,
            "bytes_received": outer.bytes_received,
            "last_divergence_estimate": outer.last_divergence_estimate,
            "phi": list(outer.phi),
            "delta": list(outer.delta),
            "error_feedback": outer.error_views(),
        }
        if flight is not None:
            sent = []
            for b, theta in enumerate(flight.theta):
                sent += flat_views(theta, outer.bucket_params(b))
            state["outer"]["in_flight"] = {"apply_at": flight.apply_at, "theta": sent}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what :meth:`state_dict` saved; phi and delta are copied into this optimizer's own buffers
        (so they keep their device, e.g. the CPU when offloaded)."""
        state_dict, outer = dict(state_dict), self.outer_state
        saved = state_dict.pop("outer", None)
        errors = outer.error_views()
        check_saved_outer(saved, self.method, outer.phi, outer.delta, errors, len(outer.params))
        saved_errors = saved.get("error_feedback") or []
        outer.settle()
        self.inner.load_state_dict(state_dict)
        with torch.no_grad():
            for value, mine in zip(saved["phi"] + saved["delta"], outer.phi + outer.delta):
                mine.copy_(value)
            # Saved without (a float outer_dtype, or an older run): nothing is owed yet.
            for k, mine in enumerate(errors):
                mine.copy_(saved_errors[k]) if saved_errors else mine.zero_()
        self.inner_step_count = int(saved["inner_step_count"])
        outer.outer_step_count = int(saved["outer_step_count"])
        outer.bytes_sent = int(saved["bytes_sent"])
        outer.bytes_received = int(saved["bytes_received"])
        outer.last_divergence_estimate = saved.get("last_divergence_estimate")
        self._in_flight = None
        in_flight = saved.get("in_flight")
        if in_flight is not None:
            device = outer.params[0].device
            theta = [
                flatten([in_flight["theta"][i] for i in bucket], torch.float32).to(device)
                for bucket in outer.buckets
            ]
            context = f"outer step {outer.outer_step_count - 1} of {self.mesh.describe()}"
            self._in_flight = InFlight(int(in_flight["apply_at"]), theta, context, combined=True)


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
