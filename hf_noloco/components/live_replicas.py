"""What the trainer does when the live replicas change (``on_replica_loss="continue"``): new process groups,
routing over the live replicas, and a joined column's state.

A column that joins (:mod:`hf_noloco.resilience.joining`) gets, per stage, everything a checkpoint of its
donor's rank folder would hold, sent point to point by the donor that
:func:`~hf_noloco.resilience.joining.join_pairs` names: the weights, the inner optimizer's state, the outer
state (slow weights, momentum, error feedback), the routing counters and tokens seen, the Trainer's state and
the scheduler's. The joiner writes them as a checkpoint of its own replica into a private folder and resumes
from it as from any checkpoint, at the run's step: its dataset shard is its replica's, read from the position
the run's step gives. Its random states are its own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time

import torch

from hf_noloco.engine.comm import LOST_PEER_ERRORS, peer_call
from hf_noloco.engine.routing import Router
from hf_noloco.io import checkpoint
from hf_noloco.resilience.joining import join_pairs
from hf_noloco.resilience.transfer import recv_state, send_state

logger = logging.getLogger(__name__)


class LiveReplicas:
    """``on_change`` of the trainer's membership (:class:`~hf_noloco.resilience.membership.Membership`)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.resume_folder: str | None = None  # a joined rank's copy of its donor's state, until resumed
        self.joins: list[dict] = []  # what each join this rank took part in copied, and how long it took

    def __call__(self, view: int, live: list[int], joined: list[int], before: list[int]) -> None:
        """A new view takes effect (on every live rank, at a fence). The members have just met in the store
        but may be slow to reach the groups on a loaded machine, and a group made again after a timeout reads
        the failed attempt's addresses from the same store keys: so the groups (and the state copies) get
        ``max(60, 2 * p2p_timeout)`` seconds (at most ``ddp_timeout``)."""
        t, args = self.trainer, self.trainer.args
        with t.mesh.patient(min(args.ddp_timeout, max(60.0, 2 * args.p2p_timeout))):
            with peer_call(f"{t.mesh.describe()}: making the process groups of view {view}"):
                t.mesh.regroup(live, view)
            for donor, joiner in join_pairs(before, joined, t.mesh.num_stages):
                if t.mesh.rank == donor:
                    self._donate(joiner)
                elif t.mesh.rank == joiner:
                    try:
                        self._receive(donor)
                    except LOST_PEER_ERRORS as exc:  # no state to train from: this joiner must not train
                        raise RuntimeError(
                            f"{t.mesh.describe()}: the donor was lost while it sent this rank's state "
                            f"({exc}); start the join again."
                        ) from exc
        t.engine.router = Router(
            t.mesh.num_replicas, args.routing, args.routing_seed, live=t.mesh.live_replicas
        )
        t.mesh.set_timeout(args.p2p_timeout)

    def _donate(self, joiner: int) -> None:
        t = self.trainer
        started = time.monotonic()
        optimizer_state, pipeline_state = t.checkpointer.rank_state()
        pipeline_state["tokens_seen"] = dict(pipeline_state["tokens_seen"], pending=None)  # counted here
        state = {
            "weights": checkpoint.rank_weights(t.model, trainable_only=t.peft_config is not None),
            "optimizer": optimizer_state,
            "pipeline": pipeline_state,
            "trainer_state": json.dumps(dataclasses.asdict(t.state)),
            "scheduler": t.lr_scheduler.state_dict(),
        }
        sent = send_state(
            state, joiner, t.mesh.world_group, t.mesh.device, t.mesh.timeout, t.mesh.describe_rank
        )
        self._record("sent to", joiner, sent, started, t.state.global_step)

    def _receive(self, donor: int) -> None:
        t = self.trainer
        started = time.monotonic()
        state, received = recv_state(
            donor, t.mesh.world_group, t.mesh.device, t.mesh.timeout, t.mesh.describe_rank
        )
        folder = tempfile.mkdtemp(prefix=f"hf_noloco-join-rank{t.mesh.rank}-")
        checkpoint.save_rank_files(folder, t.mesh, state["weights"], state["optimizer"], state["pipeline"])
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            f.write(state["trainer_state"])
        torch.save(state["scheduler"], os.path.join(folder, "scheduler.pt"))
        checkpoint.write_mesh_record(folder, t.checkpointer.mesh_record())
        self.resume_folder = folder
        step = json.loads(state["trainer_state"])["global_step"]
        self._record("received from", donor, received, started, step)

    def _record(self, how: str, peer: int, nbytes: int, started: float, step: int) -> None:
        t = self.trainer
        seconds = time.monotonic() - started
        self.joins.append(
            {"view": t.mesh.view, "step": step, "peer": peer, "bytes": nbytes, "seconds": seconds}
        )
        logger.warning(
            "%s: the state of step %d %s %s: %.2f MB in %.2f s.",
            *(t.mesh.describe(), step, how, t.mesh.describe_rank(peer), nbytes / 1e6, seconds),
        )

    def resumed(self) -> None:
        """The joined rank has loaded its copy: the private folder goes."""
        if self.resume_folder is not None:
            shutil.rmtree(self.resume_folder, ignore_errors=True)
            self.resume_folder = None
