"""What a lost peer does to the run, as one object the trainer asks: ``on_replica_loss`` "stop" or "continue".

The trainer never asks which mode it runs in. It calls the same few methods in both, and the two forms answer:

- :meth:`ReplicaLossPolicy.tolerate` runs a piece of work that communicates. "stop": a lost peer raises, and
  the job ends with an error that names it. "continue": the loss is reported to the membership
  (:mod:`hf_noloco.resilience.membership`), which proposes a view without the lost column, and the work's
  fallback is returned (a skipped step, no divergence, no evaluation, an unwritten checkpoint).
- :meth:`~ReplicaLossPolicy.begin_step` (a fence under "continue": a pending view takes effect there),
  :meth:`~ReplicaLossPolicy.barrier`, :meth:`~ReplicaLossPolicy.live_sum` (a sum over the live ranks), and
  :meth:`~ReplicaLossPolicy.retry` (the export, started again after a loss).

A lost peer is recognised by the error's type alone (:func:`hf_noloco.engine.comm.is_lost_peer`): every
communication call goes through :mod:`hf_noloco.engine.comm`, which raises
:class:`~hf_noloco.engine.comm.PeerError` for what the call itself raised. Any other error, a bug included,
propagates in both modes.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from hf_noloco.engine.comm import LOST_PEER_ERRORS, PeerError, collective, is_lost_peer
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.resilience.membership import Membership, silence_limit
from hf_noloco.resilience.watch import PeerWatch

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ReplicaLossPolicy:
    """``on_replica_loss="stop"``: a lost peer is an error that ends the job (every wait is bounded by the
    mesh's timeout, ``p2p_timeout`` while training, and :class:`~hf_noloco.resilience.watch.PeerWatch` names
    the lost rank)."""

    continues = False

    def __init__(self, mesh: PipelineMesh, watch: PeerWatch, p2p_timeout: float):
        self.mesh, self.watch, self.p2p_timeout = mesh, watch, p2p_timeout
        if mesh.device.type == "cuda":  # stream waits never time out: the heartbeats find a lost peer
            watch.watch_peers(silence_limit(p2p_timeout), mesh.abort)  # every call then names the lost

    @property
    def offline(self) -> bool:
        """Whether this rank must not communicate now (a view change is pending: "continue" only)."""
        return False

    @property
    def view(self) -> int:
        """How many times the live replicas changed (0: never)."""
        return 0

    def begin_step(self) -> None:
        """Called as every training step begins (a host sync point): a peer the watcher found lost is
        named."""
        self.watch.raise_if_lost(self.mesh.describe_rank)

    def tolerate(self, what: str, work: Callable[[], T], fallback: Callable[[], T], step: int) -> T:
        """``work()``; what a lost peer during it does is this policy's to decide (here: raise)."""
        return work()

    def lost_partner(self, exc: BaseException, step: int) -> None:
        """A gossip partner was lost inside the outer exchange (raised here; "continue" skips the
        averaging)."""
        raise exc

    def barrier(self) -> None:
        """Waits for every live rank."""
        collective(
            dist.barrier,
            group=self.mesh.world_group,
            timeout=self.mesh.timeout,
            what=f"{self.mesh.describe()}: barrier of the {len(self.mesh.live_ranks())} live ranks",
        )

    @property
    def checkpoint_barrier(self) -> Callable[[], None] | None:
        """How the ranks meet while a checkpoint is written (``None``: the process group's barrier)."""
        return None

    def live_sum(self, tensor: torch.Tensor, what: str, step: int) -> int:
        """Sums ``tensor`` in place over every live rank; returns how many ranks it summed."""
        ranks = len(self.mesh.live_ranks())
        if ranks > 1:
            collective(
                dist.all_reduce,
                tensor,
                group=self.mesh.world_group,
                timeout=self.mesh.timeout,
                what=f"{self.mesh.describe()}: {what} over the {ranks} live ranks",
            )
        return ranks

    def retry(self, what: str, work: Callable[[], T], step: int) -> T:
        """``work()``, collective over the live ranks ("continue" starts it again after a loss)."""
        return work()

    def may_tear_down_groups(self) -> bool:
        """Whether the process groups can be destroyed at the end (not once operations were abandoned)."""
        return True

    def diagnosis(self, exc: Exception) -> Exception:
        """The error training ends with: ``exc``, or, when it is a lost peer's, one that names the peers that
        stopped or the job's first failure (:meth:`~hf_noloco.resilience.watch.PeerWatch.with_root_cause`).
        The heartbeat stops here: the diagnosis is done, and the process exits cleanly."""
        error = self.watch.with_root_cause(exc, self.mesh, min(self.p2p_timeout, 5.0))
        self.watch.close()
        if is_lost_peer(exc):
            self.watch.hold_store_at_exit()
        return error

    def last_barrier(self) -> None:
        """Every live rank meets at the end; a rank lost at the very end leaves nothing to wait for under
        "continue"."""
        try:
            self.barrier()
        except PeerError:
            if not self.continues:
                raise

    def tear_down(self) -> None:
        """Destroys the process groups at the end; after a replica loss, ends this process with status 0
        instead. Operations given up after the loss stay posted in gloo, threads waiting on them: destroyed
        at exit, they abort the process (status 134, a failed job to a scheduler), and all is written."""
        if not self.may_tear_down_groups():
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if dist.is_initialized():
            dist.destroy_process_group()

    def close(self) -> None:
        self.watch.close()


class ContinueAfterReplicaLoss(ReplicaLossPolicy):
    """``on_replica_loss="continue"``: a lost rank's replica column is dropped and the others train on.

    Args:
        mesh, watch, p2p_timeout: as :class:`ReplicaLossPolicy`.
        on_change: called on every live rank when a view takes effect (see
            :class:`~hf_noloco.resilience.membership.Membership`: it makes the new process groups and what
            draws over the replicas, and copies a joined column's state).
        joining / admission_timeout: this rank joins a live run (see
            :class:`~hf_noloco.resilience.membership.Membership`).
        recipe: the digest of the run's recipe, which a joining column must share.
    """

    continues = True

    def __init__(
        self,
        mesh: PipelineMesh,
        watch: PeerWatch,
        p2p_timeout: float,
        on_change: Callable[[int, list[int], list[int], list[int]], None],
        joining: bool = False,
        admission_timeout: float = 3600.0,
        recipe: str = "",
    ):
        super().__init__(mesh, watch, p2p_timeout)
        self.membership = Membership(
            watch,
            mesh.rank,
            mesh.num_stages,
            mesh.num_replicas,
            silence=silence_limit(p2p_timeout),
            on_change=on_change,
            joining=joining,
            admission_timeout=admission_timeout,
            recipe=recipe,
        )

    @property
    def offline(self) -> bool:
        return self.membership.offline

    @property
    def view(self) -> int:
        return self.membership.view

    def begin_step(self) -> None:
        # Every step starts together: a pending change of the live replicas takes effect here.
        self.membership.fence()

    def tolerate(self, what: str, work: Callable[[], T], fallback: Callable[[], T], step: int) -> T:
        if self.offline:
            logger.warning("%s: %s skipped: the live replicas are changing.", self.mesh.describe(), what)
            return fallback()
        try:
            return work()
        except LOST_PEER_ERRORS as exc:
            self.membership.failed(exc, step)
            logger.warning("%s: %s interrupted by a lost replica.", self.mesh.describe(), what)
            return fallback()

    def lost_partner(self, exc: BaseException, step: int) -> None:
        self.membership.failed(exc, step)

    def barrier(self) -> None:
        self.membership.barrier()

    @property
    def checkpoint_barrier(self) -> Callable[[], None] | None:
        return self.membership.barrier

    def live_sum(self, tensor: torch.Tensor, what: str, step: int) -> int:
        # While the live replicas change (or if a rank is lost during this very sum) the sum is this rank's
        # own.
        return self.tolerate(
            what, lambda: super(ContinueAfterReplicaLoss, self).live_sum(tensor, what, step), lambda: 1, step
        )

    def retry(self, what: str, work: Callable[[], T], step: int, attempts: int = 3) -> T:
        for _ in range(attempts):
            self.membership.fence()
            try:
                return work()
            except LOST_PEER_ERRORS as exc:
                self.membership.failed(exc, step)
                logger.warning(
                    "%s: %s interrupted by a lost replica; starting it again.", self.mesh.describe(), what
                )
        raise PeerError(f"{self.mesh.describe()}: {what} was interrupted {attempts} times by lost replicas.")

    def may_tear_down_groups(self) -> bool:
        # Tearing down groups that hold operations given up on (a wait still blocked in gloo) aborted the
        # process at exit ("terminate called without an active exception").
        return self.view == 0

    def close(self) -> None:
        self.membership.close()
        super().close()


def replica_loss_policy(
    action: str,
    mesh: PipelineMesh,
    p2p_timeout: float,
    on_change: Callable[[int, list[int], list[int], list[int]], None],
    joining: bool = False,
    admission_timeout: float = 3600.0,
    recipe: str = "",
) -> ReplicaLossPolicy:
    """The policy of ``on_replica_loss`` (``action``), with this rank's heartbeat started (and, ``joining``,
    this rank admitted into the live run, if its ``recipe`` digest is the run's)."""
    continuing = action == "continue"
    # The heartbeat has a store connection of its own: a store client runs one operation at a time, and
    # making a process group, NCCL's lazy set-up of a communicator and the store-based barrier hold the shared
    # one for seconds, which would silence the heartbeat meanwhile (and the watcher abort a healthy job).
    watch = PeerWatch(mesh.rank, mesh.world_size, own_connection=True, beating=not joining)
    if continuing:
        return ContinueAfterReplicaLoss(
            mesh, watch, p2p_timeout, on_change, joining, admission_timeout, recipe
        )
    return ReplicaLossPolicy(mesh, watch, p2p_timeout)
