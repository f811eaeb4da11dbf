"""SIGTERM ends training with a checkpoint at a step boundary that every rank agrees on.

SIGTERM is what Slurm sends at preemption, at a requeue and at the time limit (then SIGKILL after its
``KillWait``, 30 s by default), and what torchrun and ``accelerate launch`` send their workers when they
receive it (then SIGKILL after 30 s). A rank that receives it only sets a flag: the ranks must all save the
same step, and a signal reaches them at different moments (or reaches one of them only).

Agreement: each step posts a max all-reduce of this rank's flag as it begins and reads the result as it
ends, on the host (a gloo group: no GPU synchronisation), where it has been in flight for the whole step.
Every rank reads the same value after the same step, so a flag raised anywhere during step ``k`` stops
every rank after step ``k + 1`` (after step ``k`` when it came before the step's post): the Trainer saves
``checkpoint-<step>`` there and training stops. The trainer then reports :attr:`Preemption.stopped`, and
``hf-noloco-train`` exits with status 143 (128 + SIGTERM, what a job killed by SIGTERM reports) without
evaluating or exporting; the same command line with ``resume_from_checkpoint: auto`` resumes that checkpoint
and ends as an uninterrupted run would have.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hf_noloco.engine.comm import Posted, post_collective, wait_collective
from hf_noloco.engine.mesh import PipelineMesh

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_STATUS = 128 + signal.SIGTERM


class Preemption(TrainerCallback):
    """Turns a SIGTERM received while training into a checkpoint and the end of training (see the module);
    ``enabled``: the config's ``enable_jit_checkpoint`` (``False``: SIGTERM keeps its default action).

    The handler is installed when training begins and the previous one restored when it ends: before and
    after, SIGTERM ends the process as usual. ``replica_loss`` is the trainer's replica-loss policy: after a
    change of the live replicas the flags travel over the new group of live ranks.
    """

    def __init__(self, mesh: PipelineMesh, replica_loss, enabled: bool = True):
        self.mesh, self.replica_loss, self.enabled = mesh, replica_loss, enabled
        # Under NCCL a host-side group of its own: reading a device flag would wait for the GPU.
        gloo = mesh.backend == "gloo"
        self._group = None if gloo or not enabled or mesh.world_size == 1 else dist.new_group(backend="gloo")
        self._signalled_at: float | None = None  # monotonic time of the first SIGTERM
        self._pending: tuple[Posted, torch.Tensor, int] | None = None  # (work, flag, view) of this step
        self._previous_handler = None
        self.stopped = False  # whether training stopped for a SIGTERM (a checkpoint was written)

    def take_over(self, callback_handler) -> None:
        """Stands in for the Trainer's own ``enable_jit_checkpoint`` callback, which each rank would run by
        itself (every rank saving when its own signal came: a collective that cannot meet): that callback is
        removed from ``callback_handler``, after its own ``on_train_end`` has given SIGTERM back the handler
        it replaced."""
        for callback in list(callback_handler.callbacks):
            if type(callback).__name__ == "JITCheckpointCallback":
                callback.on_train_end(None, None, None)
                callback_handler.remove_callback(callback)

    def _handle(self, signum, frame) -> None:
        if self._signalled_at is None:
            self._signalled_at = time.monotonic()

    def _flag_group(self) -> dist.ProcessGroup | None:
        return self._group if self._group is not None else self.mesh.world_group

    def on_train_begin(self, args, state, control, **kwargs):
        # Python runs signal handlers on its main thread only: a trainer run from another thread has none.
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._handle)

    def begin_step(self, step: int) -> None:
        """Posts ``step``'s all-reduce of the flags. Called by the trainer once the step's fence is passed
        (not ``on_step_begin``, before it): a view that takes effect at the fence, admitting a column, then
        has every member post in the same group."""
        if not self.enabled or self.mesh.world_size == 1 or self.replica_loss.offline:
            return
        flag = torch.tensor([0 if self._signalled_at is None else 1], dtype=torch.int32)
        what = f"{self.mesh.describe()}: all-reduce of the SIGTERM flags, step {step}"

        def post() -> Posted:  # waited for on the host, bounded: a gloo group, even in an NCCL run
            return post_collective(
                dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=self._flag_group(), what=what
            )

        work = self.replica_loss.tolerate(what, post, lambda: None, step)
        if work is not None:
            self._pending = (work, flag, self.replica_loss.view)

    def on_step_end(self, args, state, control, **kwargs):
        if not self._agreed(state.global_step):
            return
        control.should_save = True
        control.should_training_stop = True
        self.stopped = True
        if self.mesh.rank == 0:
            logger.warning(
                "SIGTERM: saving checkpoint-%d and stopping; the same command with resume_from_checkpoint: "
                "auto resumes there.",
                state.global_step,
            )

    def _agreed(self, step: int) -> bool:
        if self.mesh.world_size == 1:
            return self._signalled_at is not None
        if self._pending is None:
            return False
        work, flag, view = self._pending
        self._pending = None
        if view != self.replica_loss.view:  # posted on a group that lost a member: it may never complete
            return False
        what = f"{self.mesh.describe()}: all-reduce of the SIGTERM flags, step {step}"
        done = self.replica_loss.tolerate(
            what, lambda: wait_collective(work, self.mesh.timeout, what) or True, lambda: False, step
        )
        return bool(done) and int(flag.item()) > 0

    def on_save(self, args, state, control, **kwargs):
        if self.stopped and self._signalled_at is not None:  # on each rank the signal reached
            logger.warning(
                "%s: SIGTERM: checkpoint-%d written %.2f s after the signal reached this rank.",
                self.mesh.describe(),
                state.global_step,
                time.monotonic() - self._signalled_at,
            )

    def on_train_end(self, args, state, control, **kwargs):
        self._pending = None
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
