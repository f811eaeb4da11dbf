"""What a rank does when the live replicas change (``on_replica_loss="continue"``): new process groups,
routing over the live replicas, and a joined column's state.

A column that joins (:mod:`hf_noloco.resilience.joining`) gets, per stage, everything a checkpoint of its
donor's rank folder would hold, sent point to point by the donor that
:func:`~hf_noloco.resilience.joining.join_pairs` names: the weights, the inner optimizer's state, the outer
state (slow weights, momentum, error feedback), the routing counters and tokens seen, the Trainer's state and
the scheduler's. The joiner writes them as a checkpoint of its own replica into a private folder and resumes
from it as from any checkpoint, at the run's step: its dataset shard is its replica's, read from the position
the run's step gives. Its random states are its own.

What that state is, and how it becomes a checkpoint folder, is the run's checkpointer's
(:class:`JoinState`, implemented by :class:`~hf_noloco.components.checkpointer.RunCheckpointer`); this module
only moves it.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Protocol

from hf_noloco.engine.comm import LOST_PEER_ERRORS, peer_call
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.resilience.joining import join_pairs
from hf_noloco.resilience.transfer import recv_state, send_state

logger = logging.getLogger(__name__)


def state_bound(stage) -> int:
    """The most bytes of tensors a joiner accepts from its donor: its stage's weights in float32, 16 times
    (the weights, their float32 masters, the inner optimizer's moments, the slow weights, the momentum and
    the error feedback of each quantity sent, with room to spare), plus 64 MiB of small state."""
    return 16 * 4 * sum(t.numel() for t in stage.state_dict().values()) + (64 << 20)


class JoinState(Protocol):
    """A rank's whole state as a joining column needs it."""

    def join_state(self) -> tuple[dict, int]:
        """This rank's state (tensors, numbers and strings: what :mod:`~hf_noloco.resilience.transfer` sends)
        and its step."""
        ...

    def write_join_state(self, state: dict) -> tuple[str, int]:
        """Writes a received state as a checkpoint folder of this rank; returns the folder and its step."""
        ...


class LiveReplicas:
    """``on_change`` of the run's membership (:class:`~hf_noloco.resilience.membership.Membership`).

    Args:
        mesh: the process mesh (its groups are made again for each view).
        engine: the pipeline engine (its routing follows the live replicas).
        states: what a donor sends and a joiner keeps.
        p2p_timeout, ddp_timeout: the run's timeouts (the groups of a new view get more, see ``__call__``).
    """

    def __init__(
        self,
        mesh: PipelineMesh,
        engine: PipelineEngine,
        states: JoinState,
        p2p_timeout: float,
        ddp_timeout: float,
    ):
        self.mesh, self.engine, self.states = mesh, engine, states
        self.p2p_timeout, self.ddp_timeout = p2p_timeout, ddp_timeout
        self.resume_folder: str | None = None  # a joined rank's copy of its donor's state, until resumed
        self.joins: list[dict] = []  # what each join this rank took part in copied, and how long it took

    def __call__(self, view: int, live: list[int], joined: list[int], before: list[int]) -> None:
        """A new view takes effect (on every live rank, at a fence). The members have just met in the store
        but may be slow to reach the groups on a loaded machine, and a group made again after a timeout reads
        the failed attempt's addresses from the same store keys: so the groups (and the state copies) get
        ``max(60, 2 * p2p_timeout)`` seconds (at most ``ddp_timeout``)."""
        mesh = self.mesh
        with mesh.patient(min(self.ddp_timeout, max(60.0, 2 * self.p2p_timeout))):
            with peer_call(f"{mesh.describe()}: making the process groups of view {view}"):
                mesh.regroup(live, view)
            for donor, joiner in join_pairs(before, joined, mesh.num_stages):
                if mesh.rank == donor:
                    self._donate(joiner)
                elif mesh.rank == joiner:
                    try:
                        self._receive(donor)
                    except LOST_PEER_ERRORS as exc:  # no state to train from: this joiner must not train
                        raise RuntimeError(
                            f"{mesh.describe()}: the donor was lost while it sent this rank's state "
                            f"({exc}); start the join again."
                        ) from exc
        self.engine.route_over(mesh.live_replicas)
        mesh.set_timeout(self.p2p_timeout)

    def _donate(self, joiner: int) -> None:
        mesh, started = self.mesh, time.monotonic()
        state, step = self.states.join_state()
        sent = send_state(state, joiner, mesh.world_group, mesh.device, mesh.timeout, mesh.describe_rank)
        self._record("sent to", joiner, sent, started, step)

    def _receive(self, donor: int) -> None:
        mesh, started = self.mesh, time.monotonic()
        bound = state_bound(self.engine.stage)
        state, received = recv_state(
            donor, mesh.world_group, mesh.device, mesh.timeout, mesh.describe_rank, max_bytes=bound
        )
        self.resume_folder, step = self.states.write_join_state(state)
        self._record("received from", donor, received, started, step)

    def _record(self, how: str, peer: int, nbytes: int, started: float, step: int) -> None:
        mesh, seconds = self.mesh, time.monotonic() - started
        self.joins.append(
            {"view": mesh.view, "step": step, "peer": peer, "bytes": nbytes, "seconds": seconds}
        )
        logger.warning(
            "%s: the state of step %d %s %s: %.2f MB in %.2f s.",
            *(mesh.describe(), step, how, mesh.describe_rank(peer), nbytes / 1e6, seconds),
        )

    def resumed(self) -> None:
        """The joined rank has loaded its copy: the private folder goes."""
        if self.resume_folder is not None:
            shutil.rmtree(self.resume_folder, ignore_errors=True)
            self.resume_folder = None
