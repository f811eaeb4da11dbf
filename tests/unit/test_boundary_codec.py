"""Stage-boundary wire formats against a float64 reference: error bounds, exact bytes, unbiased rounding."""

from __future__ import annotations

import pytest
import torch

from hf_noloco.engine import boundary_codec as bc

TOKENS, HIDDEN = 32, 96
MANTISSA = {"float8_e4m3": 3, "float8_e5m2": 2}
SUBNORMAL_STEP = {"float8_e4m3": 2.0**-9, "float8_e5m2": 2.0**-16}  # spacing of the smallest values


def _activations(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g) * torch.logspace(-3, 2, TOKENS).unsqueeze(1)
    x[3] = 0.0  # an all-zero token
    x[5, 7] = 40.0  # an outlier
    return x


def _scales(x: torch.Tensor, fmt: str, block_size: int | None) -> torch.Tensor:
    """The float64 reference scale of each value (absmax of its group / the format's largest level)."""
    group = x.shape[-1] if block_size is None else block_size
    absmax = x.double().view(x.shape[0], -1, group).abs().amax(dim=2, keepdim=True)
    return (absmax / bc.SCALED_LEVELS[fmt]).expand(-1, -1, group).reshape(x.shape)


def _bound(x: torch.Tensor, fmt: str, block_size: int | None, stochastic: bool) -> torch.Tensor:
    """Per-value error bound: half a quantum (nearest) or one quantum (stochastic), plus float32 slack."""
    x64 = x.double()
    scale = _scales(x, fmt, block_size)
    if fmt in MANTISSA:
        ulp = 2.0 ** -MANTISSA[fmt]
        bound = ulp * x64.abs() + SUBNORMAL_STEP[fmt] * scale
        bound = bound if stochastic else bound / 2
    else:
        bound = scale if stochastic else scale / 2
    return bound * (1 + 1e-5) + 1e-6 * x64.abs()


def _relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    x64 = x.double()
    return ((y.double() - x64).norm() / x64.norm()).item()


SCALED = ["int8", "int4", "float8_e4m3", "float8_e5m2"]
LAYOUTS = [None, 32]


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("block_size", LAYOUTS)
@pytest.mark.parametrize("fmt", SCALED)
def test_scaled_round_trip_within_bound_and_exact_bytes(fmt, block_size, stochastic):
    x = _activations()
    generator = torch.Generator().manual_seed(1) if stochastic else None
    packet = bc.encode(x, fmt, block_size=block_size, generator=generator)
    assert bc.packet_bytes(packet) == bc.bytes_per_token(fmt, HIDDEN, block_size) * TOKENS
    y = bc.decode(packet, fmt, x.shape, torch.float32)
    assert y.shape == x.shape and y.dtype == torch.float32
    err = (y.double() - x.double()).abs()
    assert bool((err <= _bound(x, fmt, block_size, stochastic)).all()), float(
        (err - _bound(x, fmt, block_size, stochastic)).max()
    )
    assert bool((y[3] == 0).all())
    rel = _relative_error(x, y)
    print(f"{fmt} block_size={block_size} stochastic={stochastic}: relative error {rel:.3e}")


def test_float32_is_bit_identical_and_bfloat16_is_the_cast():
    x = _activations().view(4, 8, HIDDEN)
    packet = bc.encode(x, "float32")
    assert bc.packet_bytes(packet) == bc.bytes_per_token("float32", HIDDEN) * TOKENS == 4 * HIDDEN * TOKENS
    y = bc.decode(packet, "float32", x.shape, torch.float32)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))
    packet = bc.encode(x, "bfloat16")
    assert bc.packet_bytes(packet) == bc.bytes_per_token("bfloat16", HIDDEN) * TOKENS == 2 * HIDDEN * TOKENS
    ref = x.to(torch.bfloat16)
    assert torch.equal(
        bc.decode(packet, "bfloat16", x.shape, torch.bfloat16).view(torch.int16), ref.view(torch.int16)
    )
    assert torch.equal(bc.decode(packet, "bfloat16", x.shape, torch.float32), ref.float())
    print(f"bfloat16: relative error {_relative_error(x, ref):.3e}; float32: 0")


def test_bytes_per_token_values():
    assert bc.bytes_per_token("int8", 4096) == 4096 + 4
    assert bc.bytes_per_token("int8", 4096, 128) == 4096 + 32 * 4
    assert bc.bytes_per_token("int4", 4096, 64) == 2048 + 64 * 4
    assert bc.bytes_per_token("float8_e5m2", 4096) == 4096 + 4


@pytest.mark.parametrize("block_size", LAYOUTS)
@pytest.mark.parametrize("fmt", SCALED)
def test_stochastic_rounding_is_unbiased(fmt, block_size):
    draws = 4000
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 64, generator=g)
    x[0, 0] = 4.0  # the same absmax in every draw, so the same scale
    generator = torch.Generator().manual_seed(3)
    many = x.repeat(draws, 1)  # the same tokens, each rounded with its own draws
    y = bc.decode(
        bc.encode(many, fmt, block_size=block_size, generator=generator), fmt, many.shape, torch.float32
    )
    mean = y.double().view(draws, 2, 64).mean(dim=0)
    # each draw lands on one of two neighbours g apart: variance <= g**2 / 4, g bounded by _bound's quantum
    gap = _bound(x, fmt, block_size, stochastic=True)
    standard_error = gap / 2 / draws**0.5
    assert bool(((mean - x.double()).abs() <= 5 * standard_error + 1e-7).all())
    nearest = bc.decode(bc.encode(x, fmt, block_size=block_size), fmt, x.shape, torch.float32).double()
    # the mean's error is far below the nearest rounding's on average
    assert (mean - x.double()).abs().mean() < (nearest - x.double()).abs().mean() / 4


def test_stochastic_rounding_is_reproducible_from_the_seed():
    x = _activations()
    a = bc.encode(x, "int8", generator=torch.Generator().manual_seed(7))
    b = bc.encode(x, "int8", generator=torch.Generator().manual_seed(7))
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_any_receiver_decodes_any_sender_layout_from_the_packet_alone():
    x = _activations()
    for block_size in (None, 8, 48):
        packet = bc.encode(x, "int4", block_size=block_size)
        y = bc.decode(packet, "int4", x.shape, torch.float32)  # no block_size passed
        assert bool(((y.double() - x.double()).abs() <= _bound(x, "int4", block_size, False)).all())


def test_bad_layouts_are_refused_with_a_clear_error():
    x = torch.randn(4, 100)
    with pytest.raises(ValueError, match="does not divide hidden size 100"):
        bc.encode(x, "int8", block_size=64)
    with pytest.raises(ValueError, match="does not divide hidden size 100"):
        bc.bytes_per_token("int8", 100, 64)
    with pytest.raises(ValueError, match="even size"):
        bc.encode(torch.randn(4, 99), "int4")
    with pytest.raises(ValueError, match="even size"):
        bc.encode(x, "int4", block_size=25)
    with pytest.raises(ValueError, match="unknown boundary format"):
        bc.encode(x, "int2")
    with pytest.raises(ValueError, match="no scales"):
        bc.encode(x, "bfloat16", block_size=4)
    with pytest.raises(ValueError, match="stochastic rounding needs a scaled format"):
        bc.encode(x, "float32", generator=torch.Generator())
    packet = bc.encode(x, "int8", block_size=20)
    with pytest.raises(ValueError, match="do not fit"):
        bc.decode(packet, "int8", (8, 50), torch.float32)
    # hidden not divisible by any chosen block: one scale per token always fits
    y = bc.decode(bc.encode(torch.randn(3, 97), "int8"), "int8", (3, 97), torch.float32)
    assert y.shape == (3, 97)


@pytest.mark.parametrize("fmt", bc.FORMATS)
@pytest.mark.parametrize("block_size", [None, 32])
def test_packet_layout_is_what_encode_makes(fmt, block_size):
    """Receive buffers are shaped from packet_layout: it must name each packet tensor's dtype and elements per
    token, and its bytes must be bytes_per_token's (written out: payload bits / 8 + 4 per scale group)."""
    if fmt in bc.FLOAT_FORMATS and block_size is not None:
        pytest.skip("float formats have no scales")
    packet = bc.encode(_activations(), fmt, block_size)
    layout = bc.packet_layout(fmt, HIDDEN, block_size)
    assert [(t.dtype, t.shape[1]) for t in packet] == list(layout)
    assert all(t.shape[0] == TOKENS for t in packet)
    bits = {"float32": 32, "bfloat16": 16, "int8": 8, "float8_e4m3": 8, "float8_e5m2": 8, "int4": 4}[fmt]
    groups = 0 if fmt in bc.FLOAT_FORMATS else HIDDEN // (block_size or HIDDEN)
    expected = HIDDEN * bits // 8 + 4 * groups
    assert (
        sum(dtype.itemsize * n for dtype, n in layout)
        == expected
        == bc.bytes_per_token(fmt, HIDDEN, block_size)
    )
