"""Tied input and output embeddings across pipeline stages: two copies of one weight, kept bit-identical.

With ``tie_word_embeddings=True`` (Qwen2.5 0.5B-3B, Qwen3 0.6B-4B, Llama-3.2 1B/3B, SmolLM2) and several
stages, the first stage holds ``model.embed_tokens`` and the last ``lm_head``: two copies of one matrix, as in
Megatron and torchtitan. They are built equal (:func:`~hf_noloco.engine.loading.build_stage`) and stay equal:

- after every backward the two gradients are summed inside each replica column, with one pair of point to
  point messages between the column's first and last stage (never across replicas), so each copy gets the
  tied model's gradient, the sum of the embedding's and the head's;
- both copies then take the same optimizer step on the same numbers: ``a + b == b + a`` exactly in floating
  point, the optimizer states start equal, the column clips both by one norm, and the outer step gives the
  copy a bucket of its own on both stages (:class:`~hf_noloco.outer.optimizer.OuterOptimizer`), so both run
  the same arithmetic on the same partners' equal copies.

The last stage's copy is the *mirror* (:attr:`~hf_noloco.engine.stage.PipelineStage.mirrored_names`): the
column's gradient norm, the divergence metrics and the export leave it out, so the weight counts once.
"""

from __future__ import annotations

import torch

from hf_noloco.engine.buffers import squared_norm
from hf_noloco.engine.comm import exchange, wait_sends
from hf_noloco.engine.mesh import PipelineMesh


class TiedEmbeddings:
    """This rank's side of the tied-embedding pair of its replica column (inactive on middle stages, with one
    stage, or without tied embeddings).

    Args:
        stage: this rank's :class:`~hf_noloco.engine.stage.PipelineStage`.
        mesh: the process mesh; its timeout bounds the wait for the other end (``ddp_timeout`` during the
            set-up, ``p2p_timeout`` while training), which then fails with an error that names it.
    """

    def __init__(self, stage, mesh: PipelineMesh):
        self.weight: torch.nn.Parameter | None = stage.tied_weight
        self.mesh = mesh
        self.is_mirror = self.weight is not None and stage.is_last
        other_stage = mesh.num_stages - 1 if stage.is_first else 0
        self.peer = mesh.rank_of(mesh.replica, other_stage)

    @property
    def active(self) -> bool:
        return self.weight is not None

    @property
    def trains(self) -> bool:
        """Whether the copies train (frozen under LoRA adapters: then they never change, nothing to sum)."""
        return self.active and self.weight.requires_grad

    def _swap(self, mine: torch.Tensor, what: str) -> torch.Tensor:
        """Sends ``mine`` to the other end and returns its tensor of the same shape and dtype."""
        theirs = torch.empty_like(mine)
        context = f"{self.mesh.describe()}: {what} with the other end of the tied embeddings"
        pending = exchange(
            [(mine, self.peer)],
            [(theirs, self.peer)],
            self.mesh.timeout,
            self.mesh.describe_rank,
            context,
            group=self.mesh.world_group,
        )
        wait_sends(pending, self.mesh.timeout, context)
        return theirs

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Both ends' gradient becomes the sum of the two. Call after the backward (and after a ``ddp``
        gradient average, so the sum is of two identical-on-every-replica terms) and before clipping."""
        if not self.trains:
            return
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        grad = self.weight.grad
        grad.add_(self._swap(grad.contiguous(), "summing the gradients"))

    @torch.no_grad()
    def check_equal(self) -> None:
        """Raises if the two copies differ, comparing three float64 checksums (a start-up and resume guard: a
        difference here would otherwise train two different matrices silently)."""
        if not self.active:
            return
        w = self.weight.detach()
        # reductions in float64, a slice of rows at a time (no float64 copy of the matrix)
        rows = torch.cat([piece.sum(dim=1, dtype=torch.float64) for piece in w.split(4096)])
        positions = torch.arange(1, len(rows) + 1, dtype=torch.float64, device=w.device)
        mine = torch.stack([rows.sum(), (rows * positions).sum(), squared_norm(w, torch.float64)])
        theirs = self._swap(mine, "comparing the copies")
        if not torch.equal(mine, theirs):
            raise RuntimeError(
                f"{self.mesh.describe()}: the two copies of the tied embedding matrix differ from "
                f"{self.mesh.describe_rank(self.peer)}'s (checksums {mine.tolist()} vs {theirs.tolist()}); "
                "the stages were not built from the same weights."
            )
