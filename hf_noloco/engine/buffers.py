"""Flat buffers: tensors packed one after the other into one 1-D buffer, moved or reduced as one message, and
copied back; a norm that never copies a whole tensor; and host buffers allocated pinned where a GPU copies
them (offloaded state), so that copies to and from it run asynchronously. Pure tensor code: no communication.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# squared_norm reduces at most this many elements at once, so it never doubles a large tensor's memory.
_CHUNK_NUMEL = 1 << 24


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One new 1-D buffer holding ``tensors`` one after the other (in ``dtype``, default their own)."""
    return torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])


def unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copies consecutive slices of ``flat`` back into ``tensors`` (the inverse of :func:`flatten`)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def consecutive_buckets(sizes: Sequence[int], limit: float) -> list[list[int]]:
    """Indices of consecutive items grouped so that each group's total size stays within ``limit`` (an item
    larger than ``limit`` gets a group of its own): one message per group instead of one per tensor."""
    buckets, current, total = [], [], 0
    for i, size in enumerate(sizes):
        if current and total + size > limit:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        buckets.append(current)
    return buckets


def squared_norm(tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``||tensor||^2`` reduced in ``dtype``, a slice at a time: ``vector_norm(t, dtype=...)`` converts the
    whole tensor first, a float32 copy of a bf16 gradient (1 GiB for Llama-3's embedding matrix at 1B)."""
    flat = tensor.detach().reshape(-1)
    total = torch.zeros((), dtype=dtype, device=tensor.device)
    for piece in flat.split(_CHUNK_NUMEL):
        total += torch.linalg.vector_norm(piece, dtype=dtype) ** 2
    return total


def pins_host_memory(device: torch.device | str) -> bool:
    """Whether buffers on ``device`` are allocated pinned: host memory on a machine whose GPU copies them (an
    offloaded state). A pinned buffer's copies to and from the GPU run asynchronously (``non_blocking``); a
    pageable one's block the host until the copy is done."""
    return torch.device(device).type == "cpu" and torch.cuda.is_available()


def state_zeros(shape, device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros of a state buffer on ``device``, pinned where :func:`pins_host_memory` says."""
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pins_host_memory(device))


def zeros_beside(like: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``like``, on its device, and pinned when ``like`` is: ``torch.zeros_like`` of a
    pinned tensor is not pinned (the offloaded momentum beside the pinned slow weights)."""
    return torch.zeros(like.shape, dtype=like.dtype, device=like.device, pin_memory=like.is_pinned())
