"""One evaluation of the live replicas: each replica column evaluated as one model (fixed routing), its loss
and token counts pooled over the replicas into the perplexity, plus the exact replica divergence unless
``divergence_steps`` schedules it elsewhere, and a user's ``compute_metrics``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from hf_noloco.components.eval_predictions import PredictionCollector, user_metrics
from hf_noloco.components.metrics import perplexity, prediction_entries
from hf_noloco.components.training_logs import TrainingLogs
from hf_noloco.config import NoLoCoConfig
from hf_noloco.engine.comm import collective
from hf_noloco.engine.losses import TOKEN_STATS
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.stage import PipelineStage
from hf_noloco.resilience.policy import ReplicaLossPolicy


def pooled_eval_loss(
    engine: PipelineEngine,
    mesh: PipelineMesh,
    batches: Iterable[dict],
    on_batch: Callable[[], None],
    on_logits: Callable | None = None,
) -> list[float]:
    """``[summed token cross-entropy, target tokens, right predictions, summed entropy]`` of ``batches``
    through this replica column (:meth:`~hf_noloco.engine.pipeline.PipelineEngine.eval_totals`, which hands
    the last stage's logits to ``on_logits``), summed over the live replicas (collective); ``on_batch`` is
    called after each batch (the progress bar)."""
    totals = torch.zeros(2 + TOKEN_STATS, dtype=torch.float64, device=mesh.device)
    for batch in batches:
        totals += engine.eval_totals(batch, on_logits=on_logits).to(totals.device)
        on_batch()
    if mesh.num_live_replicas > 1:
        what = f"{mesh.describe()}: all-reduce of the evaluation loss"
        collective(dist.all_reduce, totals, group=mesh.replica_group, timeout=mesh.timeout, what=what)
    return totals.tolist()


def evaluation_metrics(prefix: str, totals: list[float], seconds: float) -> dict[str, float]:
    """The evaluation's log entries from :func:`pooled_eval_loss`'s totals: the mean loss, the perplexity, the
    tokens, TRL's ``mean_token_accuracy`` and ``entropy``, and the time."""
    loss_sum, tokens, right, entropy = totals
    metrics = {
        f"{prefix}_loss": loss_sum / max(tokens, 1),
        f"{prefix}_perplexity": perplexity(loss_sum, max(tokens, 1)),
        f"{prefix}_tokens": int(tokens),
    }
    metrics.update(prediction_entries(right, entropy, tokens, f"{prefix}_"))
    metrics[f"{prefix}_runtime"] = seconds
    return metrics


class Evaluation:
    """Runs evaluations of the run (collective: every live rank evaluates together).

    Args:
        args: the run's config (``divergence_steps``); mesh, stage, engine: its parts.
        logs: the run's log entries (the divergence); replica_loss: what a lost replica does to an evaluation
            (under ``on_replica_loss="continue"`` it is interrupted and returns ``{}``).
    """

    def __init__(
        self,
        args: NoLoCoConfig,
        mesh: PipelineMesh,
        stage: PipelineStage,
        engine: PipelineEngine,
        logs: TrainingLogs,
        replica_loss: ReplicaLossPolicy,
    ):
        self.args, self.mesh, self.stage, self.engine = args, mesh, stage, engine
        self.logs, self.replica_loss = logs, replica_loss

    def run(
        self,
        batches: Iterable[dict],
        prefix: str,
        on_batch: Callable[[], None],
        on_metrics: Callable[[dict], None],
        compute_metrics: Callable | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
    ) -> dict[str, float]:
        """Evaluates ``batches``; ``on_batch`` after each (the progress bar), ``on_metrics`` with the result
        (the log, the Trainer's callbacks). ``compute_metrics`` and ``preprocess_logits_for_metrics``: the
        Trainer's (:mod:`~hf_noloco.components.eval_predictions`); unused under ``prediction_loss_only``."""
        policy = self.replica_loss
        if self.args.prediction_loss_only:
            compute_metrics = None

        def interrupted() -> dict:
            self.stage.train()
            return {}

        def work() -> dict:
            if policy.continues:
                policy.barrier()  # every live rank evaluates in the same view
            self.stage.eval()
            start = time.monotonic()
            collector = None
            if compute_metrics is not None and self.mesh.is_last_stage:
                collector = PredictionCollector(preprocess_logits_for_metrics)
            totals = pooled_eval_loss(self.engine, self.mesh, batches, on_batch, collector)
            metrics = evaluation_metrics(prefix, totals, time.monotonic() - start)
            if compute_metrics is not None:
                metrics.update(user_metrics(collector, compute_metrics, self.mesh, prefix))
            if self.args.divergence_steps is None:
                metrics.update(self.logs.divergence())
            self.stage.train()
            on_metrics(metrics)
            return metrics

        return policy.tolerate("evaluation", work, interrupted, self.logs.run.step)
