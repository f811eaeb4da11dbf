"""The block-scaled wire formats and error feedback (hf_noloco.outer.compression, hf_noloco.outer.wire) in
one process, against float64 references written out here: round-trip bounds per format, error feedback
loses nothing for good, a NoLoCo group's compressed outer step is the paper's update applied to the decoded
values, and packets are as large as the traffic model says."""

import math

import pytest
import torch

from hf_noloco.estimate.traffic import step_traffic
from hf_noloco.outer.compression import (
    BLOCK,
    LEVELS,
    bytes_per_value,
    dequantize,
    encode_with_feedback_,
    quantize,
    wire_bytes,
)
from hf_noloco.outer.gossip import noloco_update_, noloco_update_parts_
from hf_noloco.outer.settings import OuterSettings
from hf_noloco.outer.wire import Wire

FORMATS = list(LEVELS)


def _data(numel, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * scale
    # Blocks of very different magnitudes, a zero block and a lone outlier: scales are per block.
    x[:BLOCK] *= 1e-4
    x[BLOCK : 2 * BLOCK] = 0
    x[3 * BLOCK + 5] = 50 * scale
    return x


def _block_scales(x, fmt):
    """float64 reference of each value's scale: its block's absmax / the format's largest level."""
    blocks = math.ceil(x.numel() / BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float64)
    padded[: x.numel()] = x.double()
    scale = padded.view(blocks, BLOCK).abs().amax(1) / {"int8": 127, "float8_e4m3": 448, "int4": 7}[fmt]
    return scale.repeat_interleave(BLOCK)[: x.numel()]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("numel", [1, 63, 64, 1000])
def test_round_trip_bounds(fmt, numel):
    x = _data(numel, 1) if numel == 1000 else torch.randn(numel) * 0.01
    packet = quantize(x, fmt)
    assert packet.dtype == torch.uint8 and packet.numel() == wire_bytes(numel, fmt)
    err = (dequantize(packet, numel, fmt).double() - x.double()).abs()
    scale = _block_scales(x, fmt)
    if fmt == "float8_e4m3":
        # 3 mantissa bits: half an ulp is 2**-4 of the value; below 2**-6 (scaled) subnormals spaced 2**-9.
        bound = torch.maximum(x.double().abs() * 2**-4, scale * 2**-10)
    else:
        bound = scale / 2  # rounding to the nearest integer level
    assert (err <= bound * (1 + 1e-6) + 1e-30).all(), (err - bound).max()
    if numel == 1000:
        assert torch.equal(dequantize(packet, numel, fmt)[BLOCK : 2 * BLOCK], torch.zeros(BLOCK))
        # the block with the outlier takes it exactly (it defines the scale)
        assert dequantize(packet, numel, fmt)[3 * BLOCK + 5] == pytest.approx(
            float(x[3 * BLOCK + 5]), rel=1e-6
        )


def test_int4_packs_two_levels_per_byte_exactly():
    levels = torch.arange(-7, 8, dtype=torch.float32).repeat(10)[: 2 * BLOCK]
    levels[0] = 7  # every block's absmax is 7: scale 1, so the levels are sent as they are
    levels[BLOCK] = -7
    packet = quantize(levels, "int4")
    assert packet.numel() == 2 * BLOCK // 2 + 2 * 4
    assert torch.equal(dequantize(packet, 2 * BLOCK, "int4"), levels)


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_values_stay_visible(fmt):
    for bad in (float("nan"), float("inf")):
        x = torch.randn(3 * BLOCK)
        x[BLOCK + 3] = bad
        decoded = dequantize(quantize(x, fmt), x.numel(), fmt)
        assert not torch.isfinite(decoded.sum())


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_feedback_loses_nothing_for_good(fmt):
    """Sum of what was decoded over many rounds == sum of what should have been sent, within the last
    round's error: at most half a quantum (int formats) of the last packet, per value."""
    numel, rounds = 300, 200
    error = torch.zeros(numel)
    sent = torch.zeros(numel, dtype=torch.float64)
    true = torch.zeros(numel, dtype=torch.float64)
    plain = torch.zeros(numel, dtype=torch.float64)  # the same rounds without feedback
    g = torch.Generator().manual_seed(3)
    drift = torch.randn(numel, generator=g) * 1e-3  # steady, below one quantum: plain rounding loses it
    for _ in range(rounds):
        x = drift + torch.randn(numel, generator=g) * 1e-2
        y = x.double() + error.double()
        packet = encode_with_feedback_(x, error, fmt)
        decoded = dequantize(packet, numel, fmt).double()
        sent += decoded
        true += x.double()
        plain += dequantize(quantize(x, fmt), numel, fmt).double() - x.double()
        assert torch.allclose(error.double(), y - decoded, atol=1e-8)  # y rounded to float32 in the code
    gap = (sent - true).abs()
    quantum = _block_scales(y.float(), fmt)
    if fmt == "float8_e4m3":
        bound = torch.maximum(y.abs() * 2**-4, quantum * 2**-10)
    else:
        bound = quantum / 2
    assert (gap <= bound * (1 + 1e-5) + 1e-7).all()
    # Without feedback the same rounds drift apart by several quanta: the test can tell the two apart.
    assert plain.abs().max() > 3 * bound.max()


def _reference_noloco(phi, delta, theta_hat, phi_hat, delta_hat, i, alpha, beta, gamma):
    """arXiv 2506.10911 eq. 1-3 in float64 on the decoded values of the whole group (member ``i`` updates):
    delta_i <- alpha delta_i + beta mean_G(theta - phi) + gamma (mean_G phi - phi_i); phi_i += delta_i."""
    n = len(theta_hat)
    if phi_hat is None:  # gamma == beta: mean(theta - phi) + mean(phi) - phi_i = mean(theta) - phi_i
        pull = sum(theta_hat) / n - phi[i]
        new_delta = alpha * delta[i] + beta * pull
    else:
        new_delta = alpha * delta[i] + beta * sum(delta_hat) / n + gamma * (sum(phi_hat) / n - phi[i])
    return phi[i] + new_delta, new_delta


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gamma", [0.7, 0.2])
@pytest.mark.parametrize("group", [2, 3])
def test_compressed_noloco_step_is_the_paper_update_of_the_decoded_values(fmt, gamma, group):
    alpha, beta, numel = 0.5, 0.7, 200
    settings = OuterSettings("noloco", 4, outer_lr=beta, outer_momentum=alpha, outer_averaging=gamma)
    g = torch.Generator().manual_seed(11)
    phi = [torch.randn(numel, generator=g) for _ in range(group)]
    theta = [p + 0.01 * torch.randn(numel, generator=g) for p in phi]
    delta = [0.01 * torch.randn(numel, generator=g) for _ in range(group)]
    wires = [Wire(fmt, "noloco", settings.sends_slow_weights, [numel], "cpu") for _ in range(group)]
    for w in wires:  # errors left by an earlier round: the packets must include them
        for e in w.error:
            e.normal_(0, 1e-4, generator=g)
    errors_before = [w.error[0].clone() for w in wires]
    packets = [w.noloco_outgoing(0, theta[k], phi[k]) for k, w in enumerate(wires)]
    # Independent decoding of every member's packets (float64), and what each sent should have been.
    decoded = [[dequantize(p, numel, fmt).double() for p in member] for member in packets]
    intended = [
        [theta[k].double()]
        if not settings.sends_slow_weights
        else [(theta[k] - phi[k]).double(), phi[k].double()]
        for k in range(group)
    ]
    for k in range(group):  # error feedback: decoded + new error == intended + old error
        for s in range(len(intended[k])):
            lhs = decoded[k][s] + wires[k].error[0][s].double()
            assert torch.allclose(lhs, intended[k][s] + errors_before[k][s].double(), atol=1e-6)
    phi64, delta64 = [p.double() for p in phi], [d.double() for d in delta]
    for i in range(group):
        members = [(k, packets[k]) for k in range(group)]
        means, sq_dists = wires[i].combine(0, members, i, lambda key, values: None)
        if i == 0:
            first_means = [m.clone() for m in means]
        else:  # every member pulls towards bit-identical means
            assert all(torch.equal(a, b) for a, b in zip(means, first_means))
        new_phi, new_delta = phi[i].clone(), delta[i].clone()
        if len(means) == 1:
            noloco_update_(new_phi, new_delta, means[0], alpha, beta, gamma)
            theta_hat, phi_hat, delta_hat = [d[0] for d in decoded], None, None
        else:
            noloco_update_parts_(new_phi, new_delta, *means, alpha, beta, gamma)
            theta_hat = [d[0] + d[1] for d in decoded]
            phi_hat, delta_hat = [d[1] for d in decoded], [d[0] for d in decoded]
        ref_phi, ref_delta = _reference_noloco(
            phi64, delta64, theta_hat, phi_hat, delta_hat, i, alpha, beta, gamma
        )
        assert torch.allclose(new_phi.double(), ref_phi, atol=1e-5, rtol=0)
        assert torch.allclose(new_delta.double(), ref_delta, atol=1e-5, rtol=0)
        expected = [float(((theta_hat[k] - theta_hat[i]) ** 2).sum()) for k in range(group) if k != i]
        assert sq_dists == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", *FORMATS])
@pytest.mark.parametrize("method, gamma", [("noloco", None), ("noloco", 0.3), ("diloco", None)])
def test_bytes_per_outer_step_match_the_traffic_model(fmt, method, gamma):
    """The packets the wire makes for a stage of realistic size (several buckets) against the model."""
    numels = [262_144, 262_144, 100_003]
    settings = OuterSettings(method, 8, outer_averaging=gamma, outer_dtype=fmt)
    wire = Wire(fmt, method, settings.sends_slow_weights, numels, "cpu")
    if method == "noloco":
        sent = sum(p.numel() * p.element_size() for b, n in enumerate(numels)
                   for p in wire.noloco_outgoing(b, torch.zeros(n), torch.zeros(n)))  # fmt: skip
    else:
        packets = [wire.diloco_outgoing(b, torch.zeros(n)) for b, n in enumerate(numels)]
        packet_bytes = sum(p.numel() * p.element_size() for p in packets)
        # 4 replicas: a ring all-reduce sends 2 (n-1)/n of the buffer; a ring all-gather n-1 packets.
        sent = packet_bytes * 3 if wire.compressed else packet_bytes * 2 * 3 / 4
    model = step_traffic(
        {"model_type": "llama", "hidden_size": 8},
        seq_len=1,
        batch_size=1,
        pipeline_stages=1,
        num_replicas=4,
        procs_per_node=4,
        outer=settings,
        stage_params=[sum(numels)],
    )
    predicted = model.ranks[0].sync_cross + model.ranks[0].sync_intra
    assert sent == pytest.approx(predicted, rel=0.02)
    per_value = sent / sum(numels) / (2 if settings.sends_slow_weights else 1)
    if method == "noloco":
        assert per_value == pytest.approx(bytes_per_value(fmt), rel=1e-3)
