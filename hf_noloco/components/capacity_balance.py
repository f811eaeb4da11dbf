"""Capacity routing's measurements: each rank's speed, smoothed over steps, shared every few steps, and the
engine's row shares set from them (``capacity_routing``).

After every training step a rank records its compute seconds per row (the engine's host time not spent
waiting for peers, over the rows it computed) in a :class:`~hf_noloco.engine.capacity.SpeedEstimate`. Every
``capacity_rebalance_steps`` steps, at the step boundary, every rank's estimate is all-gathered over the
world group (one float64 per rank) and every rank gives the engine the same speeds, so all derive the same row
counts and pairings without further messages. A replica held at ``capacity_floor`` for three rebalances in a
row is named in a warning (by the first rank). The Trainer's logs carry the last rebalance's smallest share
and the fastest replica's speed over the slowest's.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from hf_noloco.engine.capacity import SpeedEstimate, floored_shares
from hf_noloco.engine.comm import collective
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.pipeline import PipelineEngine

logger = logging.getLogger(__name__)

_FLOOR_WARNING_REBALANCES = 3


class CapacityBalance:
    """Measures this rank's speed and rebalances the engine's rows.

    Args:
        mesh: the process mesh.
        engine: the pipeline engine whose rows follow the speeds.
        rebalance_steps: steps between two rebalances.
        floor: the least share of a routing group's rows a replica gets.
        timeout: seconds to wait for the all-gather (the run's ``p2p_timeout``).
    """

    def __init__(
        self, mesh: PipelineMesh, engine: PipelineEngine, rebalance_steps: int, floor: float, timeout: float
    ):
        self.mesh, self.engine = mesh, engine
        self.rebalance_steps, self.floor, self.timeout = rebalance_steps, floor, timeout
        self.estimate = SpeedEstimate()
        self.speeds: list[list[float]] | None = None  # [stage][replica] rows per second, last shared
        self.shares: list[list[float]] | None = None  # [stage][replica], within each routing group
        self._at_floor = {}  # (stage, replica) -> rebalances in a row at the floor

    def after_step(self, step: int) -> None:
        """Records the step just run; rebalances at every ``rebalance_steps``-th step."""
        engine = self.engine
        if engine.rows_computed > 0 and engine.compute_seconds > 0:
            self.estimate.update(engine.compute_seconds, engine.rows_computed)
        if step % self.rebalance_steps == 0:
            self.rebalance()

    def rebalance(self) -> None:
        mesh = self.mesh
        mine = self.estimate.speed or 0.0
        gathered = torch.zeros(mesh.world_size, dtype=torch.float64, device=mesh.device)
        collective(
            dist.all_gather_single,
            gathered,
            torch.tensor([mine], dtype=torch.float64, device=mesh.device),
            group=mesh.world_group,
            timeout=self.timeout,
            what="the capacity routing's speeds",
        )
        speeds = gathered.tolist()
        if any(s <= 0 for s in speeds):  # a rank has not measured a step yet: rows stay equal
            return
        by_stage = [
            [speeds[mesh.rank_of(r, s)] for r in range(mesh.num_replicas)] for s in range(mesh.num_stages)
        ]
        self.speeds = by_stage
        self.engine.route_by_capacity(by_stage, self.floor)
        group, floor = self.engine.router.group_size, self.engine.capacity_floor()  # the floor the rows use
        self.shares = []
        for s, row in enumerate(by_stage):
            shares = []
            for start in range(0, len(row), group):
                shares += [float(x) for x in floored_shares(row[start : start + group], floor)]
            self.shares.append(shares)
            for r, share in enumerate(shares):
                floored = floor > 0 and share <= floor
                self._at_floor[s, r] = self._at_floor.get((s, r), 0) + 1 if floored else 0
                if self._at_floor[s, r] == _FLOOR_WARNING_REBALANCES and mesh.rank == 0:
                    logger.warning(
                        "capacity_routing: replica %d of stage %d (%s) has been held at capacity_floor=%g "
                        "for %d rebalances: it runs at %.3g rows/s against a median of %.3g.",
                        r, s, mesh.describe_rank(mesh.rank_of(r, s)), float(floor), _FLOOR_WARNING_REBALANCES,
                        row[r], sorted(row)[len(row) // 2],
                    )  # fmt: skip

    def log_entries(self) -> dict[str, float]:
        """The last rebalance, the same on every rank: the smallest share any replica got and the fastest
        replica's speed over the slowest's."""
        if self.shares is None:
            return {}
        speeds = [s for row in self.speeds for s in row]
        return {
            "capacity_min_share": min(s for row in self.shares for s in row),
            "capacity_speed_ratio": max(speeds) / min(speeds),
        }
