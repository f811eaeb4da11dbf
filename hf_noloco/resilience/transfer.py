"""A rank's state sent to one other rank point to point: nested dicts and lists of tensors and numbers.

The structure goes first, as bytes that ``torch.load(weights_only=True)`` reads (tensors replaced by their
index, shape and dtype: no pickled code), then the tensors' bytes in buckets of at most ``bucket_bytes``, one
message each, on the process group given. Nothing goes through rank 0 or the store, and the receiver never
holds more than the state and one bucket. Every wait is bounded by ``timeout`` and names the peer
(:func:`hf_noloco.engine.comm.exchange`).

The receiver trusts none of the sender's numbers: the structure may be at most :data:`MAX_STRUCTURE_BYTES`
long, every tensor's dtype must be one of :data:`~hf_noloco.engine.structured.DTYPES` and its shape bounded,
their indices must be 0, 1, 2, ... once each, and the tensors together at most ``max_bytes``, all checked
before anything is allocated for them (:class:`~hf_noloco.engine.structured.PeerDataError` otherwise).
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.distributed as dist

from hf_noloco.engine.comm import exchange, wait_sends
from hf_noloco.engine.structured import PeerDataError, checked_dtype, checked_shape, dtype_name

BUCKET_BYTES = 64 << 20
MAX_STRUCTURE_BYTES = 64 << 20  # the structure without its tensors: names, numbers, the Trainer's state
MAX_STATE_BYTES = 1 << 40  # the tensors, unless the receiver gives a tighter bound
_TENSOR = "__hf_noloco_tensor__"


def _split(state, tensors: list[torch.Tensor]):
    """``state`` with each tensor replaced by a marker (its index in ``tensors``, shape and dtype)."""
    if isinstance(state, torch.Tensor):
        tensors.append(state.detach())
        return {_TENSOR: len(tensors) - 1, "shape": list(state.shape), "dtype": dtype_name(state.dtype)}
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


def _checked_markers(structure, max_bytes: int, what: str) -> tuple[list[dict], list[int]]:
    """The tensor markers of a received structure, in index order, with their sizes in bytes: each index
    0..n-1 exactly once, each dtype allowed and shape bounded, the sum at most ``max_bytes``."""
    markers = _markers(structure, [])
    indices = [m.get(_TENSOR) for m in markers]
    if sorted(indices, key=lambda i: i if isinstance(i, int) else -1) != list(range(len(markers))):
        raise PeerDataError(f"{what}: the tensor indices are not 0..{len(markers) - 1} once each")
    markers.sort(key=lambda m: m[_TENSOR])
    sizes, total = [], 0
    for marker in markers:
        dtype = checked_dtype(marker.get("dtype"), what)
        numel = 1
        for n in checked_shape(marker.get("shape"), what):
            numel *= n
        sizes.append(numel * dtype.itemsize)
        total += sizes[-1]
        if total > max_bytes:
            raise PeerDataError(f"{what}: the sender announced more than the {max_bytes} bytes accepted")
    return markers, sizes


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
    max_bytes: int = MAX_STATE_BYTES,
):
    """Receives what :func:`send_state` sent from global rank ``src`` (the same ``bucket_bytes``), its tensors
    on ``device``, at most ``max_bytes`` of them; returns ``(state, bytes received)``."""
    what = f"the state received from {describe_peer(src)}"
    header = torch.zeros(1, dtype=torch.int64, device=device)
    exchange([], [(header, src)], timeout, describe_peer, what, group)
    length = int(header.item())
    if not 0 < length <= MAX_STRUCTURE_BYTES:
        raise PeerDataError(
            f"{what}: a structure of {length} bytes announced (at most {MAX_STRUCTURE_BYTES})"
        )
    skeleton = torch.empty(length, dtype=torch.uint8, device=device)
    exchange([], [(skeleton, src)], timeout, describe_peer, what, group)
    try:
        structure = torch.load(io.BytesIO(skeleton.cpu().numpy().tobytes()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes are, they are not a state
        raise PeerDataError(f"{what}: the structure does not load ({type(exc).__name__})") from None
    markers, sizes = _checked_markers(structure, max_bytes, what)
    tensors: list[torch.Tensor] = []
    for bucket in _buckets(sizes, bucket_bytes):
        flat = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8, device=device)
        exchange([], [(flat, src)], timeout, describe_peer, what, group)
        offset = 0
        for i in bucket:
            marker = markers[i]
            dtype = checked_dtype(marker["dtype"], what)
            tensor = torch.empty(marker["shape"], dtype=dtype, device=device)
            tensor.view(-1).view(torch.uint8).copy_(flat[offset : offset + sizes[i]])
            tensors.append(tensor)
            offset += sizes[i]
    return _join(structure, tensors), skeleton.numel() + header.numel() * 8 + sum(sizes)
