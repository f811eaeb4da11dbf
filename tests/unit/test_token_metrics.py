"""The last stage's extra arithmetic against plain torch written out: the right predictions and the entropy
counted from the logits the loss computes anyway (chunked or not), and TRL's dft loss, whose gradient is the
cross-entropy's weighted by the target's probability."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_noloco.engine.losses import TOKEN_STATS, next_token_losses


def _reference(hidden, weight, labels):
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:].flatten()
    logits = (hidden.flatten(0, 1) @ weight.t()).double()
    scored = targets != -100
    right = ((logits.argmax(-1) == targets) & scored).sum().item()
    logp = torch.log_softmax(logits, -1)
    entropy = (-(logp.exp() * logp).sum(-1))[scored].sum().item()
    return right, entropy, int(scored.sum())


@pytest.mark.parametrize("chunk", [None, 5])
def test_right_predictions_and_entropy_are_counted_from_the_losss_logits(chunk):
    torch.manual_seed(0)
    head = nn.Linear(16, 40, bias=False)
    hidden = torch.randn(3, 9, 16)
    labels = torch.randint(0, 40, (3, 9))
    labels[0, 4:] = -100
    stats = torch.zeros(TOKEN_STATS, dtype=torch.float64)
    plain = next_token_losses(hidden, labels, head)
    counted = next_token_losses(hidden, labels, head, chunk, stats=stats)
    right, entropy, scored = _reference(hidden, head.weight.detach(), labels)
    assert right > 0 and stats[0].item() == right
    assert stats[1].item() == pytest.approx(entropy, rel=1e-5)
    torch.testing.assert_close(counted, plain)  # counting changes nothing of the loss
    assert 0 < scored < labels.numel()  # some positions carry no target


@pytest.mark.parametrize("chunk", [None, 5])
def test_dft_weights_each_tokens_loss_by_its_probability_held_constant(chunk):
    torch.manual_seed(1)
    head = nn.Linear(16, 40, bias=False)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 7))
    dft = next_token_losses(hidden, labels, head, chunk, loss_type="dft")
    dft.sum().backward()
    mine = hidden.grad.clone()
    hidden.grad = None
    ce = next_token_losses(hidden, labels, head, chunk)
    weight = torch.exp(-ce.detach())
    torch.testing.assert_close(dft, ce * weight)
    (ce * weight).sum().backward()
    torch.testing.assert_close(mine, hidden.grad)
    nll = torch.autograd.grad(next_token_losses(hidden, labels, head, chunk).sum(), hidden)[0]
    assert not torch.allclose(mine, nll)  # it is not plain nll's
