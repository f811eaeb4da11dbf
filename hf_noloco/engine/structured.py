"""Small structured values (JSON) moved between ranks as bytes in tensors: broadcast, all-gather, and one
point-to-point message. Never pickle.

torch's object collectives (``broadcast_object_list``, ``all_gather_object``, ``send_object_list``...)
unpickle what a peer sent, so a rank that takes another's place could run code on every rank that receives
from it. Here a value is JSON text: a length first (one int64), then its UTF-8 bytes (uint8), and the receiver
reads at most ``max_bytes`` of them before it allocates anything (a larger length is refused:
:class:`PeerDataError`).
JSON has no tuples: a tuple sent arrives as a list.

Every call goes through :func:`~hf_noloco.engine.comm.peer_call`, so a lost peer is a
:class:`~hf_noloco.engine.comm.PeerError`; these calls have no bounded form, the group's timeout bounds them.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from hf_noloco.engine.comm import peer_call

# What one value may hold, by default: the package sends verdicts, paths, tensor names and shapes.
MAX_BYTES = 4 << 20


class PeerDataError(RuntimeError):
    """A peer sent data outside the bounds the receiver accepts (too long, not JSON, a bad shape or dtype)."""


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a group's messages live: the current CUDA device under NCCL, else the CPU (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def encode(value) -> bytes:
    """``value`` as compact JSON bytes (no NaN or infinity: not JSON)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes, what: str = "a peer's message"):
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise PeerDataError(f"{what}: not JSON ({type(exc).__name__})") from None


def _checked_length(length: int, max_bytes: int, what: str) -> int:
    if not 0 <= length <= max_bytes:
        raise PeerDataError(f"{what}: a peer announced {length} bytes, more than the {max_bytes} accepted")
    return length


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.cpu().numpy().tobytes()


def broadcast_json(
    value,
    src: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    max_bytes: int = MAX_BYTES,
    what: str = "a broadcast value",
):
    """``value`` as global rank ``src`` holds it, on every rank of ``group`` (collective)."""
    device = comm_device(group) if device is None else device
    mine = dist.get_rank() == src
    data = encode(value) if mine else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    with peer_call(what):
        dist.broadcast(length, src=src, group=group)
    n = _checked_length(int(length.item()), max_bytes, what)
    buffer = _bytes_tensor(data, device) if mine else torch.empty(n, dtype=torch.uint8, device=device)
    if n:
        with peer_call(what):
            dist.broadcast(buffer, src=src, group=group)
    return value if mine else decode(_as_bytes(buffer), what)


def all_gather_json(
    value,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    max_bytes: int = MAX_BYTES,
    what: str = "an all-gather of values",
) -> list:
    """Every rank's ``value``, in the group's rank order (collective)."""
    device = comm_device(group) if device is None else device
    size = dist.get_world_size(group)
    data = encode(value)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    with peer_call(what):
        dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    sizes = [_checked_length(int(t.item()), max_bytes, what) for t in lengths]
    longest = max(sizes)  # (never 0: JSON text is never empty)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: len(data)] = _bytes_tensor(data, device)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    with peer_call(what):
        dist.all_gather(gathered, padded, group=group)
    return [decode(_as_bytes(t[:n]), what) for t, n in zip(gathered, sizes)]


def send_json(
    value,
    dst: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    what: str = "a message",
) -> None:
    """Sends ``value`` to global rank ``dst`` (two blocking sends: its length, then its bytes)."""
    device = comm_device(group) if device is None else device
    data = encode(value)
    with peer_call(what):
        dist.send(torch.tensor([len(data)], dtype=torch.int64, device=device), dst=dst, group=group)
        dist.send(_bytes_tensor(data, device), dst=dst, group=group)


def recv_json(
    src: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    max_bytes: int = MAX_BYTES,
    what: str = "a message",
):
    """What :func:`send_json` sent from global rank ``src``, at most ``max_bytes`` long."""
    device = comm_device(group) if device is None else device
    length = torch.zeros(1, dtype=torch.int64, device=device)
    with peer_call(what):
        dist.recv(length, src=src, group=group)
    n = _checked_length(int(length.item()), max_bytes, what)
    buffer = torch.empty(n, dtype=torch.uint8, device=device)
    with peer_call(what):
        dist.recv(buffer, src=src, group=group)
    return decode(_as_bytes(buffer), what)


# ----------------------------------------------------------------------------------- tensor descriptions

# The dtypes a peer may name for a tensor it sends (by torch's name without "torch."): no other is accepted.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
    if hasattr(torch, name)
}
MAX_DIMS = 8
MAX_NUMEL = 1 << 36  # 64 Gi elements: beyond any stage's tensor


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"cannot describe a tensor of dtype {name} to a peer (not in the allow-list)")
    return name


def checked_dtype(name, what: str) -> torch.dtype:
    """The dtype a peer named, if it is in :data:`DTYPES`."""
    if not isinstance(name, str) or name not in DTYPES:
        raise PeerDataError(f"{what}: a peer named the dtype {str(name)[:40]!r}, which is not accepted")
    return DTYPES[name]


def checked_shape(shape, what: str, max_numel: int = MAX_NUMEL) -> tuple[int, ...]:
    """A shape a peer sent: at most :data:`MAX_DIMS` non-negative integers, at most ``max_numel`` elements."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise PeerDataError(f"{what}: a peer sent a malformed shape")
    numel = 1
    for n in shape:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise PeerDataError(f"{what}: a peer sent a malformed shape")
        numel *= n
    if numel > max_numel:
        raise PeerDataError(f"{what}: a peer sent a tensor of {numel} elements, more than {max_numel}")
    return tuple(shape)
