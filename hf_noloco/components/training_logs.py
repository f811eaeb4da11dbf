"""What NoLoCo adds to the Trainer's logs, and when: the replica divergence (exact, every
``divergence_steps`` or at each evaluation), the outer step's entries, tokens per second and MFU, each summed
over the live ranks through the replica-loss policy's bounded sum (the Trainer's own gather over the default
group would wait unbounded for a lost peer)."""

from __future__ import annotations

import torch

from hf_noloco.components.capacity_balance import CapacityBalance
from hf_noloco.components.loaders import ReplicaLoaders
from hf_noloco.components.metrics import (
    PredictionStats,
    Throughput,
    mean_training_loss,
    outer_log_entries,
    replica_divergence,
)
from hf_noloco.components.run_state import RunState
from hf_noloco.config import NoLoCoConfig
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.stage import PipelineStage
from hf_noloco.resilience.policy import ReplicaLossPolicy


class TrainingLogs:
    """The entries of the run's logs.

    Args:
        args: the run's config (``divergence_steps``); mesh, stage: its parts.
        run: the Trainer's objects (its step, the outer optimizer); throughput: the token counts.
        loaders: the training stream, if any (its epoch); replica_loss: the sums over the live ranks.
        predictions: the last stage's right predictions and entropy (TRL's ``mean_token_accuracy``).
        capacity: the capacity routing's measurements (``capacity_routing``), if any.
    """

    def __init__(
        self,
        args: NoLoCoConfig,
        mesh: PipelineMesh,
        stage: PipelineStage,
        run: RunState,
        throughput: Throughput,
        loaders: ReplicaLoaders,
        replica_loss: ReplicaLossPolicy,
        predictions: PredictionStats | None = None,
        capacity: CapacityBalance | None = None,
    ):
        self.args, self.mesh, self.stage, self.run, self.throughput = args, mesh, stage, run, throughput
        self.capacity = capacity
        self.loaders, self.replica_loss = loaders, replica_loss
        self.predictions = predictions or PredictionStats(counts=False)
        self.last_divergence_step = 0

    def live_sum(self, tensor: torch.Tensor, what: str) -> int:
        """Sums ``tensor`` in place over the live ranks (collective); returns how many."""
        return self.replica_loss.live_sum(tensor, what, self.run.step)

    def divergence(self) -> dict[str, float]:
        """:func:`~hf_noloco.components.metrics.replica_divergence` over the live replicas (none while they
        are changing). Collective."""
        divergence = lambda: replica_divergence(self.stage, self.mesh)
        return self.replica_loss.tolerate("the replica divergence", divergence, dict, self.run.step)

    def training_loss(self, tr_loss: torch.Tensor, window: int, skipped: int) -> float:
        """The logged loss of the last ``window`` steps, over the live ranks (``skipped``: this rank's steps
        that a lost replica interrupted)."""
        loss_sum = lambda t: self.live_sum(t, "all-reduce of the training loss")
        return mean_training_loss(tr_loss, window, skipped, loss_sum)

    def training_entries(self) -> dict[str, float]:
        """What a training log adds (collective: every rank logs together)."""
        entries, outer, step = {}, self.run.outer, self.run.step
        if outer is not None:
            every = self.args.divergence_steps
            if every is not None and step - self.last_divergence_step >= every:
                entries.update(self.divergence())
                self.last_divergence_step = step
            entries.update(
                outer_log_entries(outer, lambda t: self.live_sum(t, "all-reduce of the logging statistics"))
            )
        token_sum = lambda t: self.live_sum(t, "all-reduce of the token counts")
        entries.update(self.throughput.log_entries(token_sum, self.args.device))
        entries["num_tokens"] = self.throughput.tokens_seen  # TRL's name of the tokens trained on so far
        entries.update(self.predictions.log_entries(token_sum, self.args.device))
        if self.capacity is not None:
            entries.update(self.capacity.log_entries())
        return entries

    def stream_epoch(self) -> float | None:
        """A stream has no length: the epoch is the fraction of ``max_steps`` done (the Trainer would restart
        its own count from 0 after a resume, skipping no batches then)."""
        state = self.run.trainer_state
        if self.loaders.train_stream is None or not state.max_steps:
            return None
        return state.global_step / state.max_steps
