"""Block-scaled 8- and 4-bit wire formats for the outer exchange, and error feedback (pure: tensor ops only).

A flat float32 buffer is cut into blocks of :data:`BLOCK` values (the last one zero-padded); each block is
divided by its scale ``absmax / LEVELS[fmt]`` and rounded to the format:

- ``int8``: integers in [-127, 127] (symmetric: -128 is never used, so negation is exact).
- ``float8_e4m3``: ``torch.float8_e4m3fn`` in [-448, 448] (relative rounding error at most 2**-4).
- ``int4``: integers in [-7, 7], stored with an offset of 8 as nibbles, two per byte.

A *packet* is one ``uint8`` tensor: the payload, then the float32 scales as bytes, so every quantity crosses
the network as a single message (scales counted in its bytes). :func:`dequantize` is one multiply per value,
exact in IEEE arithmetic on any device: every replica that decodes a packet gets bit-identical values.

Error feedback (:func:`encode_with_feedback_`): the sender adds the rounding error it kept from its previous
packet of the same quantity before quantizing, and keeps the new error:
``y = x + e;  send Q(y);  e <- y - D(Q(y))``. Summed over rounds the decoded values telescope to
``sum_t x_t + e_0 - e_T``: what was sent differs from what should have been sent by the last error only, at
most half a quantum per value (see docs/compressed-gossip.md).
"""

from __future__ import annotations

import math

import torch

from hf_noloco.engine.boundary_codec import (
    SCALE_BYTES,
    SCALED_BITS,
    SCALED_LEVELS,
    absmax_scale,
    pack_scaled,
    unpack_scaled,
)

BLOCK = 64  # values per scale: 4 bytes of scale per 64 values, 1/16 byte per value
_OUTER_FORMATS = ("int8", "float8_e4m3", "int4")  # the boundary's formats the outer wire takes (not e5m2)
LEVELS = {fmt: SCALED_LEVELS[fmt] for fmt in _OUTER_FORMATS}  # the largest magnitude after scaling
BITS = {fmt: SCALED_BITS[fmt] for fmt in _OUTER_FORMATS}
FLOAT_BYTES = {"float32": 4, "bfloat16": 2}  # the uncompressed formats: a cast, no scales, no feedback


def is_compressed(outer_dtype: str) -> bool:
    """Whether ``outer_dtype`` is a block-scaled format (with error feedback) rather than a float cast."""
    return outer_dtype in LEVELS


def wire_bytes(numel: int, outer_dtype: str) -> int:
    """Bytes of one packet (or one cast copy) of a flat buffer of ``numel`` values, scales included."""
    if not is_compressed(outer_dtype):
        return numel * FLOAT_BYTES[outer_dtype]
    blocks = math.ceil(numel / BLOCK)
    return blocks * (BLOCK * BITS[outer_dtype] // 8 + SCALE_BYTES)


def bytes_per_value(outer_dtype: str) -> float:
    """Wire bytes per value, scales included (4, 2, 1.0625 for the 8-bit formats, 0.5625 for int4)."""
    if not is_compressed(outer_dtype):
        return float(FLOAT_BYTES[outer_dtype])
    return BITS[outer_dtype] / 8 + SCALE_BYTES / BLOCK


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The packet of the flat float32 tensor ``x`` in format ``fmt`` (on ``x``'s device)."""
    if fmt not in LEVELS:
        raise ValueError(f"unknown wire format {fmt!r}; expected one of {', '.join(LEVELS)}.")
    blocks = math.ceil(x.numel() / BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    padded = padded.view(blocks, BLOCK)
    scale = absmax_scale(padded.abs().amax(dim=1, keepdim=True), LEVELS[fmt])
    payload = pack_scaled(padded / scale, fmt)
    return torch.cat([payload.reshape(-1), scale.reshape(-1).view(torch.uint8)])


def dequantize(packet: torch.Tensor, numel: int, fmt: str) -> torch.Tensor:
    """The float32 values of a packet made by :func:`quantize` from ``numel`` values."""
    blocks = math.ceil(numel / BLOCK)
    payload_bytes = blocks * BLOCK * BITS[fmt] // 8
    if packet.numel() != payload_bytes + blocks * SCALE_BYTES:
        expected = payload_bytes + blocks * SCALE_BYTES
        raise ValueError(f"a {fmt} packet of {numel} values has {expected} bytes, got {packet.numel()}.")
    scale = packet[payload_bytes:].view(torch.float32).view(blocks, 1)
    values = unpack_scaled(packet[:payload_bytes], fmt, blocks, BLOCK)
    return values.mul_(scale).view(-1)[:numel]


def encode_with_feedback_(x: torch.Tensor, error: torch.Tensor, fmt: str) -> torch.Tensor:
    """The packet of ``x + error``; ``error`` (float32, ``x``'s shape) becomes what that packet left out.

    After rounds ``t = 1..T`` from ``error = e_0``: ``sum_t D(packet_t) = sum_t x_t + e_0 - e_T``.

    An offloaded ``error`` (pinned host memory, ``x`` on a GPU) is copied both ways without waiting, on the
    current stream: its next reader is the next round's copy to the device, on the same stream, or the host
    after the outer step's read of its checks, which waits for the stream."""
    y = x.to(torch.float32) + error.to(x.device, non_blocking=True)
    packet = quantize(y, fmt)
    y.sub_(dequantize(packet, y.numel(), fmt))
    error.copy_(y, non_blocking=True)
    return packet


def group_sum_mean(values: list[torch.Tensor]) -> torch.Tensor:
    """The mean of ``values`` summed in the order given (a new tensor). Every member of a gossip group lists
    the group's decoded values in the same (replica) order, so each computes a bit-identical mean."""
    total = values[0].clone()
    for v in values[1:]:
        total.add_(v)
    return total.div_(len(values))
