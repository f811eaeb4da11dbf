"""A rank's state sent to one other rank point to point: nested dicts and lists of tensors and numbers.

The structure goes first, as bytes that ``torch.load(weights_only=True)`` reads (tensors replaced by their
index, shape and dtype: no pickled code), then the tensors' bytes in buckets of at most ``bucket_bytes``, one
message each, on the process group given. Nothing goes through rank 0 or the store, and the receiver never
holds more than the state and one bucket. Every wait is bounded by ``timeout`` and names the peer
(:func:`hf_noloco.engine.comm.exchange`).
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.distributed as dist

from hf_noloco.engine.comm import exchange, wait_sends

BUCKET_BYTES = 64 << 20
_TENSOR = "__hf_noloco_tensor__"


def _split(state, tensors: list[torch.Tensor]):
    """``state`` with each tensor replaced by a marker (its index in ``tensors``, shape and dtype)."""
    if isinstance(state, torch.Tensor):
        tensors.append(state.detach())
        return {_TENSOR: len(tensors) - 1, "shape": list(state.shape), "dtype": str(state.dtype)[6:]}
    if isinstance(state, dict):
        return {key: _split(value, tensors) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_split(value, tensors) for value in state)
    return state


def _markers(skeleton, found: list[dict]) -> list[dict]:
    if isinstance(skeleton, dict) and _TENSOR in skeleton:
        found.append(skeleton)
    elif isinstance(skeleton, dict):
        for value in skeleton.values():
            _markers(value, found)
    elif isinstance(skeleton, (list, tuple)):
        for value in skeleton:
            _markers(value, found)
    return found


def _join(skeleton, tensors: list[torch.Tensor]):
    if isinstance(skeleton, dict) and _TENSOR in skeleton:
        return tensors[skeleton[_TENSOR]]
    if isinstance(skeleton, dict):
        return {key: _join(value, tensors) for key, value in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_join(value, tensors) for value in skeleton)
    return skeleton


def _buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensor indices whose bytes fill at most ``bucket_bytes`` (a larger tensor: alone)."""
    buckets: list[list[int]] = [[]]
    filled = 0
    for index, size in enumerate(sizes):
        if buckets[-1] and filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += size
    return [b for b in buckets if b]


def _nbytes(marker: dict) -> int:
    numel = 1
    for n in marker["shape"]:
        numel *= n
    return numel * getattr(torch, marker["dtype"]).itemsize


def send_state(
    state,
    dst: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: float,
    describe_peer: Callable[[int], str] = lambda rank: f"rank {rank}",
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Sends ``state`` to global rank ``dst``; returns the bytes sent (structure and tensors)."""
    tensors: list[torch.Tensor] = []
    buffer = io.BytesIO()
    torch.save(_split(state, tensors), buffer)
    skeleton = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(device)
    what = f"the state sent to {describe_peer(dst)}"
    header = torch.tensor([skeleton.numel()], dtype=torch.int64, device=device)
    wait_sends(exchange([(header, dst), (skeleton, dst)], [], timeout, describe_peer, what, group), timeout)
    sizes = [t.numel() * t.element_size() for t in tensors]
    for bucket in _buckets(sizes, bucket_bytes):
        flat = torch.cat([tensors[i].to(device).contiguous().view(-1).view(torch.uint8) for i in bucket])
        wait_sends(exchange([(flat, dst)], [], timeout, describe_peer, what, group), timeout)
    return skeleton.numel() + header.numel() * 8 + sum(sizes)


def recv_state(
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: float,
    describe_peer: Callable[[int], str] = lambda rank: f"rank {rank}",
    bucket_bytes: int = BUCKET_BYTES,
):
    """Receives what :func:`send_state` sent from global rank ``src`` (the same ``bucket_bytes``), its tensors
    on ``device``; returns ``(state, bytes received)``."""
    what = f"the state received from {describe_peer(src)}"
    header = torch.zeros(1, dtype=torch.int64, device=device)
    exchange([], [(header, src)], timeout, describe_peer, what, group)
    skeleton = torch.empty(int(header.item()), dtype=torch.uint8, device=device)
    exchange([], [(skeleton, src)], timeout, describe_peer, what, group)
    structure = torch.load(io.BytesIO(skeleton.cpu().numpy().tobytes()), weights_only=True)
    markers = sorted(_markers(structure, []), key=lambda m: m[_TENSOR])
    sizes = [_nbytes(m) for m in markers]
    tensors: list[torch.Tensor] = []
    for bucket in _buckets(sizes, bucket_bytes):
        flat = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8, device=device)
        exchange([], [(flat, src)], timeout, describe_peer, what, group)
        offset = 0
        for i in bucket:
            marker = markers[i]
            tensor = torch.empty(marker["shape"], dtype=getattr(torch, marker["dtype"]), device=device)
            tensor.view(-1).view(torch.uint8).copy_(flat[offset : offset + sizes[i]])
            tensors.append(tensor)
            offset += sizes[i]
    return _join(structure, tensors), skeleton.numel() + header.numel() * 8 + sum(sizes)
