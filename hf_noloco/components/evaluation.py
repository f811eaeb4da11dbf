"""One evaluation of the live replicas: each replica column evaluated as one model (fixed routing), its loss
and token counts pooled over the replicas into the perplexity, plus the exact replica divergence unless
``divergence_steps`` schedules it elsewhere."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hf_noloco.components.metrics import perplexity
from hf_noloco.engine.comm import collective


def evaluate_pipeline(trainer, eval_dataset, metric_key_prefix: str) -> dict[str, float]:
    trainer.model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=trainer.args.device)
    start = time.monotonic()
    loader = trainer.get_eval_dataloader(eval_dataset)
    trainer.callback_handler.eval_dataloader = loader  # the progress bar's length (shown on rank 0)
    for batch in loader:
        loss_sum, tokens = trainer.engine.eval_step(batch)
        totals += torch.tensor([loss_sum, tokens], dtype=torch.float64, device=totals.device)
        trainer.control = trainer.callback_handler.on_prediction_step(
            trainer.args, trainer.state, trainer.control
        )
    if trainer.mesh.num_live_replicas > 1:
        what = f"{trainer.mesh.describe()}: all-reduce of the evaluation loss"
        collective(
            dist.all_reduce, totals, group=trainer.mesh.replica_group, timeout=trainer.mesh.timeout, what=what
        )
    loss_sum, tokens = totals.tolist()
    metrics = {
        f"{metric_key_prefix}_loss": loss_sum / max(tokens, 1),
        f"{metric_key_prefix}_perplexity": perplexity(loss_sum, max(tokens, 1)),
        f"{metric_key_prefix}_tokens": int(tokens),
        f"{metric_key_prefix}_runtime": time.monotonic() - start,
    }
    if trainer.args.divergence_steps is None:
        metrics.update(trainer._divergence())
    trainer.model.train()
    trainer.log(metrics)
    trainer.control = trainer.callback_handler.on_evaluate(
        trainer.args, trainer.state, trainer.control, metrics
    )
    return metrics
