"""ZB-H1's split backward runs a node that computes every gradient in one call (a custom autograd Function:
the chunked loss, a compiled layer) once, in B, not again in W; the gradients stay those of one backward,
bit for bit."""

import torch
from torch import nn

from hf_noloco.engine import losses
from hf_noloco.engine.split_backward import backward_input


class _FusedLinear(torch.autograd.Function):
    """``x @ w.T`` whose backward computes both gradients whatever is asked, as a compiled region's does."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        _FusedLinear.calls += 1
        x, w = ctx.saved_tensors
        return grad @ w, grad.flatten(0, -2).t() @ x.flatten(0, -2)


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = nn.Linear(8, 8)
        self.fused = nn.Parameter(torch.randn(8, 8) / 3)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(_FusedLinear.apply(torch.tanh(self.plain(x)), self.fused))


def _gradients(split: bool, microbatches: int = 3):
    torch.manual_seed(0)
    stage = _Stage()
    inputs, sent, deferred = [], [], []
    _FusedLinear.calls = 0
    for m in range(microbatches):
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(m)).requires_grad_()
        y = stage(x)
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + m))
        if split:
            x_grad, w = backward_input(y, grad, x, stage.parameters())
            deferred.append(w)
        else:
            torch.autograd.backward(y, grad)
            x_grad = x.grad
        inputs.append(x)
        sent.append(x_grad)
    for w in deferred:  # every W after every B, as far from its B as a schedule puts it
        w()
    return {n: p.grad for n, p in stage.named_parameters()}, sent, _FusedLinear.calls


def test_a_node_that_computes_every_gradient_in_one_call_runs_once_per_microbatch():
    whole, whole_sent, whole_calls = _gradients(split=False)
    split, split_sent, split_calls = _gradients(split=True)
    assert whole_calls == 3 and split_calls == 3  # once per microbatch, not once in B and once in W
    for name, grad in whole.items():
        assert torch.equal(grad, split[name]), name
    for a, b in zip(whole_sent, split_sent):
        assert torch.equal(a, b)


def test_the_chunked_loss_runs_its_backward_once_under_the_split(monkeypatch):
    calls = []
    backward = losses._ChunkedHeadCrossEntropy.backward

    def counted(ctx, grad):
        calls.append(ctx.needs_input_grad[:2])
        return backward(ctx, grad)

    monkeypatch.setattr(losses._ChunkedHeadCrossEntropy, "backward", staticmethod(counted))
    torch.manual_seed(0)
    head = nn.Linear(8, 16, bias=False)
    results = []
    for split in (False, True):
        head.weight.grad = None
        hidden = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
        labels = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(2))
        loss = losses.next_token_losses(hidden, labels, head, chunk_tokens=4).sum()
        if split:
            hidden_grad, w = backward_input(loss, None, hidden, head.parameters())
            w()
        else:
            loss.backward()
            hidden_grad = hidden.grad
        results.append((hidden_grad, head.weight.grad.clone()))
    assert calls == [(True, True), (True, True)]  # B computed both gradients; W had nothing left to run
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_stage_with_compiled_layers_splits_without_retaining_a_compiled_backward():
    """A compiled region's backward donates its buffers and refuses ``retain_graph``: B takes every gradient
    (W is empty), the gradients are one backward's, bit for bit. (aot_eager: AOTAutograd's compiled
    function, without code generation.)"""
    torch.manual_seed(0)
    first, second, norm = (
        nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)),
        nn.Linear(8, 8),
        nn.LayerNorm(8),
    )
    compiled = torch.compile(first, backend="aot_eager")  # saves an intermediate: a donated buffer
    params = [*first.parameters(), *second.parameters(), *norm.parameters()]
    results = []
    for split in (False, True):
        for p in params:
            p.grad = None
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
        y = norm(second(torch.tanh(compiled(x)))).sum()
        if split:
            x_grad, w = backward_input(y, None, x, params)
            left_for_w = bool(w._groups)
            w()
            assert not left_for_w  # B took every gradient
        else:
            y.backward()
            x_grad = x.grad
        results.append([x_grad] + [p.grad.clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))
