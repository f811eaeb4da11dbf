"""The (dp, pp) process mesh: which stage and which replica this process is, and the groups it talks in.

Ranks of one pipeline column (one replica, all stages) are consecutive, ``rank = replica * pp + stage``, so a
column sits on one node when ``pp`` divides the processes per node. The mesh alone does not keep pipeline
traffic inside a node: with ``sample``/``step`` routing and ``routing_domain: global`` a sample's next replica
is drawn among all replicas of the next stage, wherever they run. ``routing_domain: node`` draws it among the
replicas of the sender's node (:class:`hf_noloco.engine.routing.Router` with a ``group_size``), and so does
``fixed`` routing trivially; then only outer syncs cross nodes (``hf_noloco.traffic`` counts the bytes).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_noloco.engine.comm import free_port, group_timeout, peers_lost, use_stream_waits
from hf_noloco.engine.shape import mesh_shape, rank_of


@dataclass
class PipelineMesh:
    """Owns every process group of a NoLoCo run.

    Attributes:
        rank: global rank of this process.
        stage: pipeline stage index of this process (0 = embeddings, last = lm head).
        replica: data-parallel replica index of this process within its stage.
        num_stages / num_replicas: the mesh shape (pp, dp).
        replica_group: the ``num_replicas`` processes that hold this stage (outer sync, ddp, divergence).
        column_group: the ``num_stages`` processes of this replica (loss broadcast, export).
        A second group over this stage's replicas, for overlapped outer syncs, is made on first use
        (:meth:`background_replica_group`).
        live_replicas: the replica columns still in the run (all of them unless ``on_replica_loss="continue"``
            dropped some, :meth:`regroup`).
        world_group: the group of every live rank, for point-to-point messages and run-wide collectives
            (``None``: the default group, while no replica was lost).
    """

    rank: int
    world_size: int
    num_stages: int
    num_replicas: int
    replica_group: dist.ProcessGroup | None
    column_group: dist.ProcessGroup | None
    device: torch.device
    timeout: float = 1800.0  # seconds every collective and message may wait now (see set_timeout)
    live_replicas: list[int] = field(default_factory=list)
    world_group: dist.ProcessGroup | None = None
    backend: str = (
        ""  # the groups' backend (gloo/nccl): the default group's, unless it is a joiner's stand-in
    )
    view: int = 0  # the view of the live replicas the groups were made for (0: the run's first)
    _background_group: dist.ProcessGroup | None = field(default=None, repr=False)
    _has_background_group: bool = field(default=False, repr=False)
    _groups: list = field(default_factory=list, repr=False)  # every group made here (None: the default one)

    def __post_init__(self):
        if not self.live_replicas:
            self.live_replicas = list(range(self.num_replicas))
        self._groups = [None, self.replica_group, self.column_group]
        if not self.backend:
            self.backend = dist.get_backend() if dist.is_initialized() else "gloo"

    def _new_group(self, ranks: list[int]) -> dist.ProcessGroup:
        """A group of the first view: made by every rank of the run together (``new_group`` is collective)."""
        group = dist.new_group(ranks, timeout=timedelta(seconds=self._backend_timeout()))
        if self.rank in ranks:
            self._groups.append(group)
        return group

    def _members_group(self, ranks: list[int], name: str) -> dist.ProcessGroup:
        """A group of a later view, made by its members only, under a name of that view. ``new_group`` with
        ``use_local_synchronization`` names a group by its ranks and the number of groups the process made
        before: a replica that joined made fewer than the others, and the same ranks recur once a lost
        column is back, so the name is ours. Through torch's private helper, as ``new_group`` does."""
        helper = getattr(dist.distributed_c10d, "_new_process_group_helper", None)
        if helper is None:
            raise RuntimeError(
                "on_replica_loss='continue' needs a torch with _new_process_group_helper (2.4+)."
            )
        group, _ = helper(
            len(ranks),
            ranks.index(self.rank),
            ranks,
            self.backend,
            dist.distributed_c10d._get_default_store(),
            dist.distributed_c10d.GroupName(f"hf_noloco/view-{self.view}/{name}"),
            timeout=timedelta(seconds=self._backend_timeout()),
        )
        dist.distributed_c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}
        self._groups.append(group)
        return group

    def _backend_timeout(self) -> float:
        return group_timeout(self.backend, self.timeout).total_seconds()

    def set_timeout(self, seconds: float) -> None:
        """Bounds every collective and message of every group this rank uses by ``seconds`` from now on (see
        :func:`~hf_noloco.engine.comm.group_timeout`: under NCCL a margin beyond it, so that our own bounded
        waits fail first and name the peer). ``timeout`` is what our waits use."""
        self.timeout = float(seconds)
        backend_timeout = timedelta(seconds=self._backend_timeout())
        for group in dict.fromkeys(self._groups):
            group = group if group is not None else dist.group.WORLD
            if hasattr(group, "set_timeout"):  # torch >= 2.6
                group.set_timeout(backend_timeout)
            else:
                dist.distributed_c10d._set_pg_timeout(backend_timeout, group)

    def abort(self, lost: list[int] | None = None) -> None:
        """A peer is lost (``lost``: the ranks the heartbeat watcher found silent): every communication call
        of :mod:`~hf_noloco.engine.comm` raises a :class:`~hf_noloco.engine.comm.PeerError` naming them from
        now on, and every communicator of this process is aborted, so that what waits on them fails now
        (NCCL), instead of after the watchdog's timeout.

        Each group is aborted by itself (``ProcessGroup.abort``) and stays registered: torch's
        ``_abort_process_group(WORLD)`` would also clear the registry and the default group, after which
        every call (building a ``P2POp``, an all-reduce) fails with ``ValueError: Default process group has
        not been initialized`` instead of naming the lost rank. The aborts run inside one NCCL group (as
        torch's own does), so that aborting one communicator never waits on another's."""
        names = self.describe_ranks(sorted(lost)) if lost else "unknown (the communicators were aborted)"
        peers_lost(f"{self.describe()}: Peers that stopped responding: {names}")
        registered = getattr(dist.distributed_c10d._world, "pg_map", {})
        groups = [g if g is not None else dist.group.WORLD for g in dict.fromkeys(self._groups)]
        groups = list(dict.fromkeys([*groups, *registered]))
        nccl = None
        with contextlib.suppress(Exception):
            backend = dist.group.WORLD._get_backend(torch.device("cuda"))
            nccl = backend if type(backend).__name__ == "ProcessGroupNCCL" else None
        with contextlib.suppress(Exception):
            if nccl is not None:
                nccl._group_start()
        for group in groups:
            with contextlib.suppress(Exception):  # best effort: the watchdog still ends what this misses
                if group is not None and hasattr(group, "abort"):
                    group.abort()
        with contextlib.suppress(Exception):
            if nccl is not None:
                nccl._group_end()

    @contextlib.contextmanager
    def patient(self, seconds: float):
        """Waits inside may take up to ``seconds`` (set-up, checkpoint and export I/O); then the timeout
        before."""
        before = self.timeout
        self.set_timeout(seconds)
        try:
            yield
        finally:
            self.set_timeout(before)

    @classmethod
    def build(
        cls,
        pipeline_stages: int,
        device: torch.device | str | None = None,
        timeout: float | None = None,
        joining: bool = False,
    ) -> PipelineMesh:
        """Builds the mesh over the default process group, which must already be initialised. ``timeout``
        (seconds) bounds the new groups' collectives; by default they get torch's default for the backend
        (NCCL: 10 minutes), not the default group's. ``joining``: this process joins a live run
        (:mod:`hf_noloco.resilience.joining`): it has no group until it is admitted (:meth:`regroup`)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: launch with `accelerate launch` or `torchrun`."
            )
        world_size = dist.get_world_size()
        num_replicas, num_stages = mesh_shape(world_size, pipeline_stages)
        device = torch.device(device) if device is not None else _default_device(joining)
        backend = ("nccl" if device.type == "cuda" else "gloo") if joining else ""
        mesh = cls(dist.get_rank(), world_size, num_stages, num_replicas, None, None, device, backend=backend)
        if joining:
            mesh._groups = []  # its default group is a stand-in that communicates with no one
        if timeout is not None:
            mesh.set_timeout(timeout)
        use_stream_waits(mesh.backend == "nccl")
        if joining:
            mesh.live_replicas = []  # none yet: the view that admits this column says
            return mesh
        # Every rank must create every group in the same order (new_group is collective).
        for stage in range(num_stages):
            ranks = [rank_of(r, stage, num_stages) for r in range(num_replicas)]
            group = mesh._new_group(ranks)
            if mesh.rank in ranks:
                mesh.replica_group = group
        for replica in range(num_replicas):
            ranks = [rank_of(replica, s, num_stages) for s in range(num_stages)]
            group = mesh._new_group(ranks)
            if mesh.rank in ranks:
                mesh.column_group = group
        # torch requires every rank of a group in its first batched point-to-point call; with tied embeddings
        # and 3+ stages the first one (the gradient sum) involves only the first and last stages. A barrier
        # makes the first operation on the default group one of every rank.
        dist.barrier()
        return mesh

    def background_replica_group(self) -> dist.ProcessGroup | None:
        """A second process group over this stage's replicas, made on first use and kept: the overlapped
        outer sync runs there, so its messages never queue behind (or ahead of) the pipeline's. Collective
        the first time: every rank of the world calls it together (a later view's is made by
        :meth:`regroup`)."""
        if not self._has_background_group and self.view > 0:
            raise RuntimeError("The overlapped outer sync's group is made in the run's first view only.")
        if not self._has_background_group:
            for stage in range(self.num_stages):
                ranks = [rank_of(r, stage, self.num_stages) for r in range(self.num_replicas)]
                group = self._new_group(ranks)
                if self.rank in ranks:
                    self._background_group = group
            self._has_background_group = True
        return self._background_group

    def regroup(self, live_replicas: list[int], view: int) -> None:
        """New groups over the live replicas of ``view`` (others lost, or joined): the run-wide group, this
        stage's replica group and this column's group, each made by its members only (a lost rank takes no
        part) and fresh, so that nothing left half-done on an old group can match a new message. Every live
        rank calls it with the same arguments. (No background group: ``on_replica_loss="continue"`` refuses
        ``outer_overlap_steps``.) After an :meth:`abort`, communication is made again, on these groups."""
        self.live_replicas, self.view = sorted(live_replicas), view
        peers_lost(None)
        self.world_group = self._members_group(self.live_ranks(), "world")
        ranks = [self.rank_of(r, self.stage) for r in self.live_replicas]
        self.replica_group = self._members_group(ranks, f"replica-{self.stage}")
        self.column_group = self._members_group(self.column_ranks(), f"column-{self.replica}")

    @property
    def num_live_replicas(self) -> int:
        return len(self.live_replicas)

    def live_ranks(self) -> list[int]:
        """Global ranks of every live replica column, in rank order."""
        return [self.rank_of(r, s) for r in self.live_replicas for s in range(self.num_stages)]

    @property
    def leader(self) -> int:
        """The rank that writes what the run writes once (checkpoint records, the export): the first stage of
        the first live replica (rank 0 while no replica was lost)."""
        return self.rank_of(self.live_replicas[0], 0)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def stage(self) -> int:
        return self.rank % self.num_stages

    @property
    def replica(self) -> int:
        return self.rank // self.num_stages

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def rank_of(self, replica: int, stage: int) -> int:
        """Global rank of ``replica`` of ``stage``."""
        return rank_of(replica, stage, self.num_stages)

    def replica_ranks(self, stage: int | None = None) -> list[int]:
        """Global ranks of all replicas of ``stage`` (default: this process's stage), by replica index."""
        stage = self.stage if stage is None else stage
        return [self.rank_of(r, stage) for r in range(self.num_replicas)]

    def column_ranks(self) -> list[int]:
        """Global ranks of this replica's column, by stage."""
        return [self.rank_of(self.replica, s) for s in range(self.num_stages)]

    def describe_rank(self, rank: int) -> str:
        """``rank 5 (stage 1, replica 2)``: how errors name a process."""
        return f"rank {rank} (stage {rank % self.num_stages}, replica {rank // self.num_stages})"

    def describe_ranks(self, ranks: list[int]) -> str:
        return ", ".join(self.describe_rank(r) for r in ranks)

    def describe(self) -> str:
        """This process, as :meth:`describe_rank` names it."""
        return self.describe_rank(self.rank)


def ensure_process_group(timeout_s: float) -> None:
    """A one-process gloo group when none was joined (a plain ``python script.py``), so that the same code
    paths run as under a launcher."""
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=timeout_s),
        )


def _default_device(joining: bool = False) -> torch.device:
    if torch.cuda.is_available() and (joining or dist.get_backend() == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
