"""The methods without an outer step: ``ddp`` (the gradients all-reduced over the stage's replicas every step,
the paper's "FSDP" baseline at small scale) and ``local`` (no synchronisation: the ablation)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_noloco.engine.buffers import flatten, unflatten_into
from hf_noloco.engine.comm import post_collective, wait_collective
from hf_noloco.outer.algorithm import OuterAlgorithm
from hf_noloco.outer.state import nbytes
from hf_noloco.outer.wire import ring_allreduce_bytes


class NoSync(OuterAlgorithm):
    """``outer_optimizer="local"``: every replica trains on its own."""

    has_outer_step = False


class DataParallel(NoSync):
    """``outer_optimizer="ddp"``: gradients averaged over the stage's replicas after every backward."""

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """A parameter without a gradient contributes zeros and stays without one."""
        state, mesh, n = self.state, self.mesh, self.mesh.num_replicas
        if n == 1:
            return
        for b in range(len(state.buckets)):
            params = state.bucket_params(b)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            dtypes = {g.dtype for g in grads}
            flat = flatten(grads, dtypes.pop() if len(dtypes) == 1 else torch.float32)
            what = f"ddp gradient all-reduce over the replicas of stage {mesh.stage} ({mesh.describe()})"
            work = post_collective(dist.all_reduce, flat, group=mesh.replica_group, what=what)
            wait_collective(work, self.p2p_timeout, what)
            unflatten_into(grads, flat.div_(n))  # the zeros standing in for missing gradients are dropped
            traffic = ring_allreduce_bytes(nbytes(flat), n)
            state.bytes_sent += traffic
            state.bytes_received += traffic
