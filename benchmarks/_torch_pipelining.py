"""PyTorch's own pipelining (``torch.distributed.pipelining``) as a benchmark arm: the engine a user would
otherwise pick, run on the stages, batch, loss and optimizer our engine runs.

Each stage module is our :class:`~hf_noloco.engine.stage.PipelineStage` (the same decoder layers, built from
the same seed): token ids in on the first stage, hidden states between stages, logits out of the last one.
Torch's schedule cuts the batch into equal microbatches along the rows and hands the last stage's logits to
:func:`loss_fn`, which weighs every token by 1 / (target tokens of the whole batch), the weight our engine's
last stage gives a token of the one replica; with ``scale_grads=False`` the gradients are then the same
function of the same weights in both engines (:func:`step0_check` measures it).

Schedules, by our name: ``1f1b`` is ``Schedule1F1B``; ``zb-h1`` is ``ScheduleInterleavedZeroBubble`` with one
stage per rank. The latter implements the paper's ZB1P, the interleaved form of ZB-H1; with a single local
stage its order is ZB-H1's (1F1B's order, each backward split into the input gradient and a deferred weight
gradient, ``I`` and ``W``). ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` need two stages per rank
(the V placement: a different split of the model), so they are not the analogue of a one-stage-per-rank zb-h1.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import schedules as torch_schedules

from hf_noloco.engine.losses import next_token_losses

TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble"}


class _WaitTimer:
    """Host seconds spent in torch's p2p posting and waiting (``_batch_p2p``, ``_wait_batch_p2p``): what
    ``PipelineEngine.wait_seconds`` counts for ours (its ``exchange`` posts and waits), so that the idle
    fractions of the two engines compare. Installed once per process; both functions are module globals that
    the schedules look up at call time."""

    seconds = 0.0
    installed = False

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        for name in ("_batch_p2p", "_wait_batch_p2p"):
            setattr(torch_schedules, name, cls._timed(getattr(torch_schedules, name)))
        cls.installed = True

    @classmethod
    def _timed(cls, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cls.seconds += time.perf_counter() - start

        return timed


def loss_fn_for(target_tokens: int):
    """The loss of one microbatch as our engine's last stage computes it for one replica: each row's summed
    next-token cross-entropy over the target tokens of the whole batch, summed over the rows."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (next_token_losses(logits, labels).sum(1) / target_tokens).sum()

    return loss_fn


class TorchPipelineStep:
    """One training step (zero_grad, the schedule's forward and backward of every microbatch, AdamW step) of
    one stage under ``torch.distributed.pipelining``; calling it returns the loss on the last stage.

    ``stage`` is our stage module (shared by every torch arm of the rank, with ``optimizer``); ``group`` the
    process group of the pipeline's ranks, stage ``i`` on its group rank ``i``.
    """

    def __init__(self, stage, optimizer, group, schedule: str, microbatch_size: int, batch: dict):
        _WaitTimer.install()
        input_ids = batch["input_ids"]
        rows, seq_len = input_ids.shape
        self.microbatches = rows // microbatch_size
        self.stage, self.optimizer, self.input_ids = stage, optimizer, input_ids
        # One torch stage per arm: it keeps buffers shaped for its microbatches; the weights are shared.
        self.torch_stage = TorchStage(
            stage, stage.stage_index, stage.num_stages, torch.device("cpu"), group=group
        )
        schedule_class = getattr(torch_schedules, TORCH_SCHEDULES[schedule])
        loss_fn = loss_fn_for(rows * (seq_len - 1))
        stages = self.torch_stage if schedule_class is torch_schedules.Schedule1F1B else [self.torch_stage]
        self.schedule = schedule_class(stages, self.microbatches, loss_fn=loss_fn, scale_grads=False)
        self.wait_seconds = 0.0  # of the last step, as PipelineEngine.wait_seconds

    def __call__(self) -> float | None:
        self.optimizer.zero_grad(set_to_none=True)
        start = _WaitTimer.seconds
        losses = []
        if self.stage.is_first:
            self.schedule.step(self.input_ids, return_outputs=False)
        elif self.stage.is_last:
            self.schedule.step(target=self.input_ids, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        self.wait_seconds = _WaitTimer.seconds - start
        self.optimizer.step()
        return sum(loss.item() for loss in losses) if self.stage.is_last else None


def order(schedule, stage_index: int, num_stages: int, num_micro: int) -> list[tuple[str, int]]:
    """The order of computes of stage ``stage_index`` under torch's ``schedule`` (a schedule object), in our
    notation (:func:`~hf_noloco.engine.schedule.pipeline_order`).

    ``Schedule1F1B`` runs a loop of its own (``_step_microbatches``): ``num_stages - stage`` forwards, then a
    backward and a forward in turn, then the remaining backwards; its ``pipeline_order`` is a drawing for the
    visualizer, which in torch 2.13 numbers the later stages' microbatches one too high, so the loop is
    written out here. The zero-bubble schedules run their ``pipeline_order``: its ``I`` (the input gradient)
    is our ``B``; on the first stage ``I`` computes nothing and ``W`` runs the whole backward, our first
    stage's ``B``."""
    if isinstance(schedule, torch_schedules.Schedule1F1B):
        warmup = min(num_micro, num_stages - stage_index)
        computes = [("F", m) for m in range(warmup)]
        for m in range(num_micro - warmup):
            computes += [("B", m), ("F", warmup + m)]
        return computes + [("B", m) for m in range(num_micro - warmup, num_micro)]
    computes = []
    for action in schedule.pipeline_order[stage_index]:
        kind = None if action is None else action.computation_type.value
        if kind not in ("F", "I", "W", "B") or (stage_index == 0 and kind == "I"):
            continue
        kind = {"I": "B", "W": "B" if stage_index == 0 else "W"}.get(kind, kind)
        computes.append((kind, action.microbatch_index))
    return computes


def step0_check(make_stage, group, engine_step, schedule: str, microbatch_size: int, batch: dict) -> dict:
    """Step 0 of each engine from equal weights (``make_stage()`` builds this rank's stage from the same seed
    each call): the loss (on the last stage) and the largest difference between the two engines' gradients
    on this rank. ``engine_step(stage)`` runs our engine's forward and backward of ``batch`` and returns the
    loss (None off the last stage)."""
    ours = make_stage()
    our_loss = engine_step(ours)
    theirs = make_stage()
    optimizer = torch.optim.AdamW(theirs.parameters())  # unused: the check stops before the update
    step = TorchPipelineStep(theirs, optimizer, group, schedule, microbatch_size, batch)
    losses = []
    if theirs.is_first:
        step.schedule.step(batch["input_ids"], return_outputs=False)
    else:
        step.schedule.step(target=batch["input_ids"], losses=losses, return_outputs=False)
    scale, difference = 0.0, 0.0
    for a, b in zip(ours.parameters(), theirs.parameters()):
        scale = max(scale, a.grad.abs().max().item())
        difference = max(difference, (a.grad - b.grad).abs().max().item())
    return dict(
        ours_loss=our_loss,
        torch_loss=sum(loss.item() for loss in losses) if theirs.is_last else None,
        grad_max_abs_difference=difference,
        grad_max_abs=scale,
    )
