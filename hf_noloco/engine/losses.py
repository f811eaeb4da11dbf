"""The last stage's loss: ``<Model>ForCausalLM``'s next-token cross-entropy, optionally ``lm_head`` chunk by
chunk.

Labels are shifted inside, logits upcast to float32, positions whose target is ``-100`` contribute 0, as
transformers' ``ForCausalLMLoss`` computes it; a family's logit arithmetic
(:class:`~hf_noloco.engine.stage.ForwardExtras`: multipliers, divisors, soft-capping) is applied before the
loss, in both the plain and the chunked path. From the same logits, without another ``lm_head`` pass, it can
count the predictions that were right and sum their entropy (TRL's ``mean_token_accuracy`` and ``entropy``),
and weight each token's loss by its predicted probability (TRL's ``loss_type="dft"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_noloco.engine.stage import ForwardExtras

IGNORE_INDEX = -100


TOKEN_STATS = 2  # the length of next_token_losses' ``stats``: right predictions, summed entropy


def next_token_losses(
    outputs: torch.Tensor,
    labels: torch.Tensor,
    lm_head: nn.Module | None = None,
    chunk_tokens: int | None = None,
    extras: ForwardExtras | None = None,
    stats: torch.Tensor | None = None,
    loss_type: str = "nll",
) -> torch.Tensor:
    """The cross-entropy of every position's next-token prediction, shape ``(rows, tokens)``. Summed and
    divided by :func:`target_token_count` it is ``<Model>ForCausalLM``'s loss.

    ``outputs`` are the logits, or, given ``lm_head``, the final hidden states that ``lm_head`` (then
    ``extras``' logit arithmetic) turns into logits. With ``lm_head`` and ``chunk_tokens`` (fewer than the
    positions), positions are scored ``chunk_tokens`` at a time, in the forward pass and again in the backward
    pass, which rebuilds each chunk's logits to compute its gradients: at most one chunk's float32 logits
    exist at any time, instead of ``rows * tokens * vocab`` floats (8 GiB for 4 x 4096 tokens of Llama-3's
    128k vocabulary, and the backward of a cross-entropy holds three such tensors), for one more ``lm_head``
    matrix multiply.

    ``stats``: a float64 tensor of :data:`TOKEN_STATS` values to which the target positions add, from the
    logits the loss computes anyway (no gradient): how many predictions (argmax) were the target, and the sum
    of the predictions' entropies. ``loss_type="dft"`` weights each position's cross-entropy by its target's
    predicted probability, held constant (dynamic fine-tuning, as TRL's ``loss_type``); ``"nll"``: not.
    """
    extras = extras or ForwardExtras()
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    flat_targets = targets.flatten()
    hidden = outputs.flatten(0, 1)
    chunked = lm_head is not None and chunk_tokens and chunk_tokens < hidden.shape[0]
    if chunked and getattr(lm_head, "bias", None) is None:
        losses = _ChunkedHeadCrossEntropy.apply(
            hidden, lm_head.weight, flat_targets, chunk_tokens, extras, stats
        )
    else:
        logits = hidden if lm_head is None else extras.logits(lm_head(hidden))
        losses = _token_cross_entropy(logits, flat_targets)
        if stats is not None:
            with torch.no_grad():
                add_token_stats(stats, logits.float(), flat_targets, losses)
    if loss_type == "dft":
        losses = losses * torch.exp(-losses.detach())  # p(target) = exp(-cross-entropy)
    return losses.view(targets.shape)


def add_token_stats(
    stats: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor
) -> None:
    """Adds to ``stats`` the target positions' right predictions and their entropies, from float32 ``logits``
    and their cross-entropies ``losses`` (``-log p(target)``: the log-sum-exp is ``losses + logit(target)``,
    so the entropy ``lse - sum(p * logits)`` needs one more pass over the vocabulary, not two)."""
    scored = targets != IGNORE_INDEX
    right = (logits.argmax(dim=-1) == targets) & scored
    picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    lse = losses + picked
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    stats[0] += right.sum()
    stats[1] += entropy.masked_fill(~scored, 0.0).sum(dtype=torch.float64)


def target_token_count(labels: torch.Tensor) -> torch.Tensor:
    """The number of positions :func:`next_token_losses` scores (targets other than ``-100``)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def _token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # (positions, vocab) rows: three times faster on CPU than the class dimension in the middle
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")


def _chunk_logits(raw: torch.Tensor, extras: ForwardExtras) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``extras``' logits of a chunk's raw ``lm_head`` output (in float32), and ``tanh`` of the soft-capping
    (what its derivative needs), or ``None`` without it."""
    logits = raw.float()
    if extras.logit_multiplier is not None:
        logits = logits * extras.logit_multiplier
    if extras.logit_divisor is not None:
        logits = logits / extras.logit_divisor
    tanh = None
    if extras.final_logit_softcapping is not None:
        tanh = torch.tanh(logits / extras.final_logit_softcapping)
        logits = tanh * extras.final_logit_softcapping
    return logits, tanh


def _raw_gradient(grad: torch.Tensor, tanh: torch.Tensor | None, extras: ForwardExtras) -> torch.Tensor:
    """The gradient with respect to the raw ``lm_head`` output, from that with respect to the logits
    (the chain rule through :func:`_chunk_logits`, in reverse), in place."""
    if tanh is not None:
        grad = grad.mul_(1 - tanh.square_())  # d(c tanh(z / c)) / dz = 1 - tanh^2
    if extras.logit_divisor is not None:
        grad = grad.div_(extras.logit_divisor)
    if extras.logit_multiplier is not None:
        grad = grad.mul_(extras.logit_multiplier)
    return grad


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """``cross_entropy(extras.logits(hidden @ weight.T))`` per position, ``chunk`` positions at a time in both
    passes.

    The forward keeps only its inputs. The backward rebuilds a chunk's logits, turns them into their gradient
    in place (``grad_loss * (softmax - one_hot)``, zero where the target is ``-100``, then back through the
    logit arithmetic) and adds the chunk's share to the gradients of ``hidden`` and ``weight``; the weight's
    gradient is accumulated in the weight's dtype, as gradients of microbatches are. Matrix multiplies run in
    autocast's dtype when autocast is on (as ``lm_head`` would), softmax and loss in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, extras, stats=None):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        ctx.dtype, ctx.chunk, ctx.extras = dtype, chunk, extras
        ctx.save_for_backward(hidden, weight, targets)
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        w = weight.to(dtype)
        with torch.autocast(device, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                t = targets[start : start + chunk]
                logits, _ = _chunk_logits(hidden[start : start + chunk].to(dtype) @ w.t(), extras)
                picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
                loss = torch.logsumexp(logits, dim=-1).sub_(picked)
                losses[start : start + chunk] = loss.masked_fill_(t == IGNORE_INDEX, 0.0)
                if stats is not None:
                    add_token_stats(stats, logits, t, losses[start : start + chunk])
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, targets = ctx.saved_tensors
        dtype, chunk, extras = ctx.dtype, ctx.chunk, ctx.extras
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                t = targets[start : start + chunk]
                h = hidden[start : start + chunk].to(dtype)
                logits, tanh = _chunk_logits(h @ w.t(), extras)
                grad = torch.softmax(logits, dim=-1)  # then, in place, d loss / d logits
                grad.scatter_add_(1, t.clamp(min=0).unsqueeze(1), grad.new_full((len(t), 1), -1.0))
                scale = grad_losses[start : start + chunk].float().masked_fill(t == IGNORE_INDEX, 0.0)
                grad = _raw_gradient(grad.mul_(scale.unsqueeze(1)), tanh, extras).to(dtype)
                if need_hidden:
                    grad_hidden[start : start + chunk] = grad @ w
                if need_weight and grad_weight.dtype == dtype:
                    grad_weight.addmm_(grad.t(), h)
                elif need_weight:  # autocast: float32 weights, bf16 products
                    grad_weight.add_(grad.t() @ h)
        return grad_hidden, grad_weight, None, None, None, None
