"""Stateless wire formats for stage-boundary tensors: activations and their gradients (pure: tensor ops only).

A boundary tensor ``[..., hidden]`` is seen as rows of ``hidden`` values, one row per token. Formats:

- ``float32``: identity (the values' float32 bits); ``bfloat16``: a cast (``tensor.to(torch.bfloat16)``).
- ``float8_e4m3`` (for activations) and ``float8_e5m2`` (for gradients, wider range): each scale group is
  divided by ``absmax / 448`` (resp. ``/ 57344``) and cast; relative rounding error at most
  2**-4 (resp. 2**-3) above the subnormals.
- ``int8`` (integers in [-127, 127], scale ``absmax / 127``) and ``int4`` (integers in [-7, 7], scale
  ``absmax / 7``, two values per byte): rounding error at most half a scale per value.

A scale group is one token's row (``block_size=None``, one float32 scale per token) or each ``block_size``
consecutive values of a row (``hidden`` must be a multiple of ``block_size``; int4 needs even groups).
With a ``generator``, the scaled formats round stochastically (to one of the two neighbouring representable
values, with the probabilities that make the decoded value unbiased; error below one quantum), meant for
activation gradients, whose rounding errors then average out over the sum of the weight gradients.

A packet is a tuple of tensors: ``(payload,)`` for the float formats, ``(payload, scales)`` for the scaled
ones (``uint8 [tokens, bytes]`` and ``float32 [tokens, groups]``); :func:`bytes_per_token` is the exact
number of their bytes per token. :func:`decode` needs only the packet, the format, the shape and the dtype
(the groups are read off the scales), so any receiver decodes any sender's packet.

Shared with :mod:`hf_noloco.outer.compression` (the outer exchange's block-scaled packets, which imports
them from here, the lower layer): the scale rule (:func:`absmax_scale`) and the payload packing
(:func:`pack_scaled` / :func:`unpack_scaled`). What differs: scales per token (or per block within a
token's row) instead of fixed 64-value blocks of a flat buffer, so no padding and a token's values never
share a scale with another token; the scales travel as their own tensor; the e5m2 format and stochastic
rounding; and no error feedback: a stage's receiver changes per sample under random routing, so a sender
has no stable peer to whom a kept rounding error could be carried over, and every packet must stand alone.

The pipeline (:class:`~hf_noloco.engine.pipeline.PipelineEngine`, options ``boundary_dtype`` and
``boundary_grad_dtype``) encodes each microbatch's boundary tensor once and sends each receiver the packet
rows of its samples: a packet's tensors are cut per sample row (:func:`packet_layout` gives their dtypes and
elements per token, from which receive buffers are shaped).
"""

from __future__ import annotations

import math

import torch

SCALE_BYTES = 4  # float32 scales
FLOAT8 = {"float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}  # the 8-bit float payloads
FLOAT8_MAX = {"float8_e4m3": 448.0, "float8_e5m2": 57344.0}  # their largest finite magnitudes


def absmax_scale(absmax: torch.Tensor, level: float) -> torch.Tensor:
    """The scale ``absmax / level`` of each group; an all-zero group takes scale 1 (any scale decodes zeros),
    a NaN/inf stays in the scale, so the decoded group is non-finite and a finite check sees it."""
    return torch.where(absmax == 0, torch.ones_like(absmax), absmax / level)


def pack_scaled(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """The ``uint8`` payload of ``y`` (float32, rows of already scaled values, an even row length for int4),
    rounded to nearest in ``fmt`` (``y`` is overwritten): one byte per value, half a byte for int4."""
    if fmt == "int8":
        return y.round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    if fmt in FLOAT8:
        limit = FLOAT8_MAX[fmt]
        return y.clamp_(-limit, limit).to(FLOAT8[fmt]).view(torch.uint8)
    if fmt == "int4":
        nibbles = y.round_().clamp_(-7, 7).add_(8).to(torch.uint8)
        return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    raise ValueError(f"unknown wire format {fmt!r}; expected one of int8, int4, {', '.join(FLOAT8)}.")


def unpack_scaled(payload: torch.Tensor, fmt: str, rows: int, cols: int) -> torch.Tensor:
    """The float32 ``[rows, cols]`` scaled values of a payload made by :func:`pack_scaled`."""
    payload = payload.view(rows, -1)
    if fmt == "int8":
        return payload.view(torch.int8).float()
    if fmt in FLOAT8:
        return payload.view(FLOAT8[fmt]).float()
    low = (payload & 0x0F).to(torch.int8) - 8
    high = (payload >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=2).view(rows, cols).float()


FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # casts: no scales
SCALED_LEVELS = {"int8": 127.0, "int4": 7.0, **FLOAT8_MAX}  # the largest magnitude after scaling
SCALED_BITS = {"int8": 8, "int4": 4, "float8_e4m3": 8, "float8_e5m2": 8}
FORMATS = (*FLOAT_FORMATS, *SCALED_LEVELS)


def _groups(fmt: str, hidden: int, block_size: int | None) -> int:
    """The scale groups per token (0 for the float formats); a ValueError for a layout the format refuses."""
    if fmt in FLOAT_FORMATS:
        if block_size is not None:
            raise ValueError(f"the {fmt} boundary format has no scales, so no block_size (got {block_size}).")
        return 0
    if fmt not in SCALED_LEVELS:
        raise ValueError(f"unknown boundary format {fmt!r}; expected one of {', '.join(FORMATS)}.")
    group = hidden if block_size is None else block_size
    if group < 1 or hidden % group:
        raise ValueError(
            f"block_size {block_size} does not divide hidden size {hidden}: choose a divisor of {hidden}, "
            "or block_size=None for one scale per token."
        )
    if fmt == "int4" and group % 2:
        raise ValueError(f"int4 packs two values per byte: its scale groups need an even size, got {group}.")
    return hidden // group


def bytes_per_token(fmt: str, hidden: int, block_size: int | None = None) -> int:
    """Exact wire bytes per token of ``fmt``: payload plus float32 scales."""
    groups = _groups(fmt, hidden, block_size)
    if fmt in FLOAT_FORMATS:
        return hidden * FLOAT_FORMATS[fmt].itemsize
    return hidden * SCALED_BITS[fmt] // 8 + groups * SCALE_BYTES


def packet_layout(
    fmt: str, hidden: int, block_size: int | None = None
) -> tuple[tuple[torch.dtype, int], ...]:
    """``(dtype, elements per token)`` of each tensor of a packet, in :func:`encode`'s order; their bytes sum
    to :func:`bytes_per_token`."""
    groups = _groups(fmt, hidden, block_size)
    if fmt in FLOAT_FORMATS:
        return ((FLOAT_FORMATS[fmt], hidden),)
    return ((torch.uint8, hidden * SCALED_BITS[fmt] // 8), (torch.float32, groups))


def packet_bytes(packet: tuple[torch.Tensor, ...]) -> int:
    """The bytes the tensors of a packet occupy (what crosses the network)."""
    return sum(t.numel() * t.element_size() for t in packet)


def _stochastic_float8(y: torch.Tensor, fmt: str, generator: torch.Generator) -> torch.Tensor:
    """``y`` (scaled, within the format's range) rounded stochastically to the neighbouring float8 values."""
    dtype = FLOAT8[fmt]
    a = y.abs()
    near = a.to(dtype)  # nearest; non-negative, so the next magnitude up/down is the bit pattern +/- 1
    near_f = near.float()
    bits = near.view(torch.uint8).to(torch.int16)
    other_bits = torch.where(near_f > a, bits - 1, bits + 1).clamp_(min=0)
    other = other_bits.to(torch.uint8).view(dtype).float()
    other = torch.where(near_f == a, near_f, other)  # exact: nothing to round
    lo, hi = torch.minimum(near_f, other), torch.maximum(near_f, other)
    gap = hi - lo
    p_up = torch.where(
        gap > 0, (a - lo) / torch.where(gap > 0, gap, torch.ones_like(gap)), torch.zeros_like(a)
    )
    u = torch.rand(a.shape, generator=generator, device=a.device)
    return torch.where(u < p_up, hi, lo).copysign_(y)


def encode(
    tensor: torch.Tensor,
    fmt: str,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, ...]:
    """The packet of ``tensor`` (``[..., hidden]``) in ``fmt``; stochastic rounding with a ``generator``."""
    hidden = tensor.shape[-1]
    groups = _groups(fmt, hidden, block_size)
    if fmt in FLOAT_FORMATS:
        if generator is not None:
            raise ValueError(f"stochastic rounding needs a scaled format, not {fmt}.")
        return (tensor.detach().to(FLOAT_FORMATS[fmt]).reshape(-1, hidden).contiguous(),)
    rows = tensor.detach().reshape(-1, groups, hidden // groups).to(torch.float32)
    scale = absmax_scale(rows.abs().amax(dim=2, keepdim=True), SCALED_LEVELS[fmt])
    y = (rows / scale).clamp_(-SCALED_LEVELS[fmt], SCALED_LEVELS[fmt])
    if generator is not None:
        if fmt in FLOAT8:
            y = _stochastic_float8(y, fmt, generator)
        else:  # floor(y + u): up with probability frac(y); integers stay, so pack_scaled's round is exact
            y = y.add_(torch.rand(y.shape, generator=generator, device=y.device)).floor_()
    tokens = rows.shape[0]
    payload = pack_scaled(y.view(tokens, hidden), fmt)
    return payload.contiguous(), scale.view(tokens, groups).contiguous()


def decode(
    packet: tuple[torch.Tensor, ...], fmt: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The ``shape``/``dtype`` tensor of a packet made by :func:`encode` (its groups read off its scales)."""
    hidden = shape[-1]
    tokens = math.prod(shape[:-1])
    if fmt in FLOAT_FORMATS:
        (payload,) = packet
        if payload.dtype != FLOAT_FORMATS[fmt] or payload.numel() != tokens * hidden:
            raise ValueError(f"a {fmt} packet of shape {tuple(shape)} does not match {tuple(payload.shape)}.")
        return payload.to(dtype).reshape(shape)
    payload, scales = packet
    if scales.dim() != 2 or scales.shape[0] != tokens or hidden % max(scales.shape[1], 1):
        raise ValueError(f"{fmt} scales of shape {tuple(scales.shape)} do not fit shape {tuple(shape)}.")
    groups = scales.shape[1]
    _groups(fmt, hidden, hidden // groups)
    if payload.numel() != tokens * hidden * SCALED_BITS[fmt] // 8:
        raise ValueError(f"a {fmt} payload of {payload.numel()} bytes does not fit shape {tuple(shape)}.")
    values = unpack_scaled(payload, fmt, tokens, hidden).view(tokens, groups, hidden // groups)
    return values.mul_(scales.view(tokens, groups, 1)).to(dtype).reshape(shape)
