"""The interface every outer method implements, and what it may ask of the run's replica-loss policy.

An :class:`OuterAlgorithm` moves one stage replica's :class:`~hf_noloco.outer.state.OuterState` over the
network: a blocking outer step (:meth:`OuterAlgorithm.step`), or one that starts now and is folded in later
(:meth:`~OuterAlgorithm.start`, then :meth:`~OuterAlgorithm.combine`), and for data parallel a gradient
reduction every step. :class:`~hf_noloco.outer.optimizer.OuterOptimizer` decides when; the methods decide
what crosses the network and how it is combined.
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist

from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.outer.settings import OuterSettings
from hf_noloco.outer.state import InFlight, OuterState


class ReplicaLossGuard(Protocol):
    """What an outer exchange asks of ``on_replica_loss`` (:mod:`hf_noloco.resilience.policy`'s policies have
    these members): ``offline``, this replica must not exchange now (the live replicas are changing); and
    ``lost_partner``, a partner was lost mid-exchange (raise, or report it and let the step go on)."""

    @property
    def offline(self) -> bool: ...

    def lost_partner(self, exc: BaseException, step: int) -> None: ...


class OuterAlgorithm:
    """One outer method over a stage's replicas (``mesh.replica_group``).

    Args:
        state: the stage replica's buckets and outer state, updated in place.
        mesh: the process mesh.
        settings: the method's hyperparameters.
        p2p_timeout: seconds to wait for a peer before raising :class:`~hf_noloco.engine.comm.PeerError`.
        replica_loss: what a lost partner does (``None``: it is an error).
        background_group: the process group of overlapped exchanges (``outer_overlap_steps`` > 0).
    """

    has_outer_step = True

    def __init__(
        self,
        state: OuterState,
        mesh: PipelineMesh,
        settings: OuterSettings,
        p2p_timeout: float,
        replica_loss: ReplicaLossGuard | None = None,
        background_group: dist.ProcessGroup | None = None,
    ):
        self.state, self.mesh, self.settings, self.p2p_timeout = state, mesh, settings, p2p_timeout
        self.replica_loss, self.background_group = replica_loss, background_group

    def step(self, step: int) -> None:
        """One blocking outer step (``step``: the inner step it follows, for the logs)."""

    def start(self, apply_at: int) -> InFlight:
        """Posts an outer step's exchange and returns at once; :meth:`combine` folds it in."""
        raise NotImplementedError(f"{type(self).__name__} has no outer step to overlap.")

    def combine(self, flight: InFlight) -> None:
        """Waits for ``flight``'s exchange and folds it into phi and delta (``flight.theta`` is used up)."""
        raise NotImplementedError

    def drop(self, flight: InFlight) -> None:
        """Waits for ``flight``'s exchange, and forgets it."""

    def after_update(self) -> None:
        """Called once an outer update is in phi and delta, before the weights are set from them."""

    def reduce_gradients(self) -> None:
        """Called after every backward, before clipping (data parallel averages the gradients here)."""
