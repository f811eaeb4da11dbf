"""One training step of this rank's stage replica: the routed pipeline's forwards and backwards, the
gradients' reductions (data parallel, tied embeddings), the column's statistics, and what a non-finite loss
or gradient does; or, when a lost replica interrupted the step, what is left of it.

Every rank of a replica column sees the same statistics (one all-reduce over the column,
:mod:`hf_noloco.components.column_stats`), so they all take the same decision. Other columns are unaffected:
under ``nonfinite="skip"`` their outer-step counters stay aligned, under ``"error"`` they fail within
``p2p_timeout`` on their next message to this column, naming this error.
"""

from __future__ import annotations

import logging

import torch
from accelerate.utils.memory import clear_device_cache

from hf_noloco.components.capacity_balance import CapacityBalance
from hf_noloco.components.column_stats import clip_gradients_, column_stats, nonfinite_report
from hf_noloco.components.metrics import PredictionStats
from hf_noloco.components.run_state import RunState
from hf_noloco.config import NoLoCoConfig
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.stage import PipelineStage
from hf_noloco.engine.tied import TiedEmbeddings

logger = logging.getLogger(__name__)


class TrainingStep:
    """Runs (or skips) training steps, and keeps what the Trainer's clipping and logs read of them.

    Args:
        args: the run's config (``nonfinite``, ``max_grad_norm``, ``torch_empty_cache_steps``).
        mesh, stage, engine, tied: the run's parts.
        run: the Trainer's objects (the outer optimizer reduces data-parallel gradients).
        predictions: where the last stage's right predictions and entropy are counted.
        capacity: measures this rank's speed and rebalances the rows (``capacity_routing``), if any.
    """

    def __init__(
        self,
        args: NoLoCoConfig,
        mesh: PipelineMesh,
        stage: PipelineStage,
        engine: PipelineEngine,
        tied: TiedEmbeddings,
        run: RunState,
        predictions: PredictionStats | None = None,
        capacity: CapacityBalance | None = None,
    ):
        self.args, self.mesh, self.stage, self.engine = args, mesh, stage, engine
        self.capacity = capacity
        self.tied, self.run = tied, run
        self.predictions = predictions or PredictionStats(counts=False)
        self.grad_norm: torch.Tensor | None = None  # this step's column gradient norm
        self.skipped_since_log = 0  # steps this rank skipped since the last log (a replica lost meanwhile)

    def counters(self) -> tuple[int, int]:
        """The routing counters before a step (what :meth:`skip` needs)."""
        return self.engine.step_index, self.engine.samples_seen

    def run_step(self, inputs: dict, step: int) -> torch.Tensor:
        """Step ``step`` on ``inputs``; returns the column's loss."""
        self.stage.train()
        result = self.engine.train_step(inputs)
        if self.capacity is not None:
            self.capacity.after_step(step)
        self.predictions.add(result.token_stats, result.target_tokens)
        self.run.outer.reduce_gradients()  # ddp: first, so the tied sum below adds replica-averaged gradients
        self.tied.sum_gradients()
        every = self.args.torch_empty_cache_steps
        if every is not None and step % every == 0:
            clear_device_cache()
        stats = column_stats(self.stage, self.mesh, result.loss, step)
        self.grad_norm = stats[1:].sum().sqrt()
        problem = nonfinite_report(stats, self.mesh, step)
        if problem is not None:
            self._on_nonfinite(problem)
        return stats[0]

    def skip(self, counters: tuple[int, int], inputs: dict) -> torch.Tensor:
        """The rest of a step whose communication failed under ``on_replica_loss="continue"``: its gradients
        are dropped (the optimizer then leaves the weights and its state untouched, as ``nonfinite="skip"``
        does), the routing counters advance as if it had run, and the logged loss leaves the step out."""
        self.engine.step_index = counters[0] + 1
        self.engine.samples_seen = counters[1] + inputs["input_ids"].shape[0]
        self._drop_gradients()
        self.grad_norm = torch.zeros((), device=self.mesh.device)
        self.skipped_since_log += 1
        return torch.zeros((), device=self.mesh.device)

    def _drop_gradients(self) -> None:
        # Optimizers leave a parameter without a gradient untouched, while OuterOptimizer.step() still counts
        # the step, so outer steps stay aligned with other replicas.
        for p in self.stage.parameters():
            p.grad = None

    def _on_nonfinite(self, what: str) -> None:
        if self.args.nonfinite == "error":
            raise FloatingPointError(
                f"{what}. Stopping (nonfinite='error'); the checkpoints already written are complete: "
                "resume from the last one (perhaps with a lower learning rate), or set nonfinite='skip' to "
                "skip such steps."
            )
        self._drop_gradients()
        if self.mesh.is_first_stage:  # one warning per column
            logger.warning(
                "%s. Skipping this step on replica %d (nonfinite='skip').", what, self.mesh.replica
            )

    def column_grad_norm(self) -> torch.Tensor:
        if self.grad_norm is None:  # only outside the training loop: a step computes it
            raise RuntimeError("The column gradient norm is computed by training_step.")
        return self.grad_norm

    def clip(self) -> torch.Tensor:
        """Clips by the column's norm, as the unsplit model would; returns the norm."""
        norm = self.column_grad_norm()
        clip_gradients_(self.stage.parameters(), norm, self.args.max_grad_norm)
        return norm
