"""The Trainer's own objects that it makes, or replaces, while a run goes on: its ``TrainerState``, the
optimizer and the learning-rate scheduler.

``NoLoCoTrainer``'s ``state``, ``optimizer`` and ``lr_scheduler`` attributes are views of one
:class:`RunState`, so a part that holds it (the checkpointer, the exporter, the run record) always sees the
current ones, without a reference to the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import TrainerState

from hf_noloco.outer.optimizer import OuterOptimizer


@dataclass
class RunState:
    trainer_state: TrainerState | None = None
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: object | None = None

    @property
    def outer(self) -> OuterOptimizer | None:
        """The outer optimizer, once the Trainer has made its optimizer (``create_optimizer``; Accelerate then
        wraps it in an ``AcceleratedOptimizer``, whose ``optimizer`` it is)."""
        optimizer = self.optimizer
        while optimizer is not None and not isinstance(optimizer, OuterOptimizer):
            optimizer = getattr(optimizer, "optimizer", None)
        return optimizer

    @property
    def step(self) -> int:
        """The Trainer's global step (0 before training)."""
        return self.trainer_state.global_step if self.trainer_state is not None else 0
