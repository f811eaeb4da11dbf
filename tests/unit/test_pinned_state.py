"""The offloaded outer state is pinned whole: the error-feedback buffers and the momentum are allocated pinned
beside the pinned slow weights (``torch.zeros_like`` of a pinned tensor is not). No GPU here: the allocator
is asked for pinned memory, which is what is checked (``benchmarks/gpu_probe.sh`` checks ``is_pinned()`` on a
GPU)."""

from types import SimpleNamespace

import pytest
import torch

from hf_noloco.engine import buffers
from hf_noloco.outer.wire import Wire


@pytest.fixture
def allocations(monkeypatch):
    """Every ``torch.zeros`` call's ``pin_memory`` (then served unpinned: this machine has no GPU)."""
    asked, zeros = [], torch.zeros

    def recording_zeros(*args, pin_memory=False, **kwargs):
        asked.append(pin_memory)
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", recording_zeros)
    return asked


@pytest.mark.parametrize("gpu", [True, False])
def test_error_feedback_buffers_are_pinned_when_offloaded(monkeypatch, allocations, gpu):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    wire = Wire("int8", "noloco", True, [64, 128, 32], torch.device("cpu"))
    assert [tuple(e.shape) for e in wire.error] == [(2, 64), (2, 128), (2, 32)]
    assert allocations == [gpu] * 3  # pinned exactly where a GPU copies them


def test_error_feedback_on_the_device_is_not_pinned(monkeypatch, allocations):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    Wire("int4", "diloco", False, [64], torch.device("meta"))  # the state beside the weights, on the GPU
    assert allocations == [False]


@pytest.mark.parametrize("pinned", [True, False])
def test_the_momentum_beside_the_slow_weights_keeps_their_pinning(allocations, pinned):
    phi = SimpleNamespace(
        shape=(3, 5), dtype=torch.float32, device=torch.device("cpu"), is_pinned=lambda: pinned
    )
    delta = buffers.zeros_beside(phi)
    assert allocations == [pinned] and delta.shape == (3, 5) and delta.dtype == torch.float32
    assert not delta.any()
