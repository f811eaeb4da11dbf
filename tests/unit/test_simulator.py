"""The discrete-event simulator (hf_noloco/estimate/simulator.py) against hand-computed values."""

import math
import random

import pytest

from hf_noloco.engine.routing import Router
from hf_noloco.engine.schedule import BACKWARD, FORWARD, Post, mesh_plans
from hf_noloco.estimate.simulator import (
    Link,
    Network,
    one_f_one_b_time,
    pair_exchange,
    ring_all_reduce,
    ring_all_reduce_time,
    simulate_step,
)


def test_two_process_exchange_is_latency_plus_bytes_over_bandwidth_both_directions_at_once():
    network = Network(bandwidth=1e9, latency=1e-3)
    result = pair_exchange(network, [(0, 1)], 5e8)
    assert result.blocked == {0: pytest.approx(0.501), 1: pytest.approx(0.501)}
    assert result.time == pytest.approx(0.501)  # not twice: the two directions are two links
    assert network.bytes_per_link() == {(0, 1): 5e8, (1, 0): 5e8}
    assert result.bytes_sent == {0: 5e8, 1: 5e8}


def test_a_link_queues_its_messages_fifo_latency_paid_in_flight():
    link = Link(bandwidth=100.0, latency=2.0)
    assert link.transfer(50, ready=0.0) == pytest.approx(2.5)  # latency + b / bw
    assert link.transfer(50, ready=0.0) == pytest.approx(3.0)  # behind the first: latency + 2 b / bw
    assert link.transfer(50, ready=10.0) == pytest.approx(12.5)  # the link is free again: its own time
    assert (link.bytes_sent, link.messages) == (150, 3)


def test_jitter_is_seeded_mean_one_and_never_reorders_a_link():
    def arrivals(seed):
        link = Link(bandwidth=math.inf, latency=1.0, jitter=0.5, rng=random.Random(seed))
        return [link.transfer(0, ready=float(i) * 0.01) for i in range(2000)]

    first = arrivals(3)
    assert first == arrivals(3) and first != arrivals(4)
    assert first == sorted(first)
    draws = [Link(math.inf, 1.0, 0.5, random.Random(i)).transfer(0, 0.0) for i in range(2000)]
    assert sum(draws) / len(draws) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,micro", [(1, 3), (2, 2), (3, 5), (4, 8), (4, 2)])
def test_free_links_give_the_1f1b_formula(schedule, stages, micro):
    """Equal per-microbatch times, messages free: the engine's plans (1F1B and GPipe alike) take
    ``(m + p - 1) (t_f + t_b)``, every stage idle ``(p - 1) / (m + p - 1)`` of it."""
    result = simulate_step(schedule, stages, micro, [1.0] * stages, [2.0] * stages, Network())
    assert result.step_time == pytest.approx(one_f_one_b_time(stages, micro, 1.0, 2.0))
    assert result.step_time == pytest.approx((micro + stages - 1) * 3.0)
    expected_idle = (stages - 1) / (micro + stages - 1)
    assert result.stage_idle_share == pytest.approx([expected_idle] * stages)


def test_costly_links_by_hand_two_stages_one_microbatch():
    """F0, x0 over the link, F1, B1, g0 back, B0: ``t_f0 + hop_x + t_f1 + t_b1 + hop_g + t_b0``."""
    network = Network(bandwidth=1000.0, latency=0.5)
    result = simulate_step(
        "1f1b", 2, 1, [1.0, 2.0], [3.0, 4.0], network, row_bytes={FORWARD: 1000, BACKWARD: 500}
    )
    assert result.step_time == pytest.approx(1 + (0.5 + 1.0) + 2 + 4 + (0.5 + 0.5) + 3)
    assert result.busy == {0: 4.0, 1: 6.0}
    assert result.idle_share == {0: pytest.approx(1 - 4 / 12.5), 1: pytest.approx(1 - 6 / 12.5)}
    assert result.bytes_per_link == {(0, 1): 1000, (1, 0): 500}


def test_bytes_per_link_are_the_plans_messages_summed():
    stages, micro, rows = 3, 4, 2
    router = Router(2, "sample", seed=1)
    sizes = {FORWARD: 10.0, BACKWARD: 7.0}
    result = simulate_step(
        "1f1b",
        stages,
        micro,
        [1.0] * stages,
        [2.0] * stages,
        Network(1e6, 1e-4),
        sizes,
        micro=rows,
        router=router,
    )
    expected = {}
    for plan in mesh_plans("1f1b", stages, router, micro, rows).values():
        for post in (item for item in plan if isinstance(item, Post)):
            for msg in post.sends:
                expected[msg.src, msg.dst] = expected.get((msg.src, msg.dst), 0.0) + sizes[msg.phase] * len(
                    msg.rows
                )
    assert result.bytes_per_link == pytest.approx(expected)
    # every row crosses each boundary once forward and once backward
    crossing = sum(v for (src, dst), v in expected.items() if src % stages == 0 and dst % stages == 1)
    assert crossing == 2 * micro * rows * 10.0


@pytest.mark.parametrize("n", [2, 4, 7])
def test_ring_all_reduce_matches_the_closed_formula(n):
    bandwidth, latency, nbytes = 1e9, 2e-3, 3e8
    network = Network(bandwidth, latency)
    result = ring_all_reduce(network, list(range(n)), nbytes)
    expected = 2 * (n - 1) * (latency + nbytes / (n * bandwidth))
    assert result.time == pytest.approx(expected)
    assert ring_all_reduce_time(n, nbytes, bandwidth, latency) == pytest.approx(expected)
    assert result.bytes_sent == {r: pytest.approx(2 * (n - 1) / n * nbytes) for r in range(n)}
    assert network.bytes_per_link() == {
        (r, (r + 1) % n): pytest.approx(2 * (n - 1) / n * nbytes) for r in range(n)
    }


def test_noloco_pairs_block_less_than_diloco_ring_at_many_replicas():
    n, nbytes = 16, 1e8
    pairs = pair_exchange(Network(1e9, 5e-3), [(i, i + 1) for i in range(0, n, 2)], nbytes)
    ring = ring_all_reduce(Network(1e9, 5e-3), list(range(n)), nbytes)
    assert pairs.time == pytest.approx(5e-3 + 0.1)
    assert ring.time == pytest.approx(30 * (5e-3 + nbytes / (n * 1e9)))
    assert pairs.time < ring.time


@pytest.mark.parametrize("stages,micro", [(2, 2), (3, 6), (4, 8)])
def test_zero_bubble_plan_cuts_the_bubble_to_zb_h1s(stages, micro):
    """ZB-H1's plan with F = B (input gradient) = W = 1 (the first stage's whole backward 2): a step of
    ``3 m + (p - 1)``, a bubble of ``(p - 1)(t_f + t_b - t_w)``, against 1F1B's ``(m + p - 1) * 3``."""
    zb = simulate_step(
        "zb-h1",
        stages,
        micro,
        [1.0] * stages,
        [2.0] + [1.0] * (stages - 1),
        Network(),
        weight=[0.0] + [1.0] * (stages - 1),
    )
    assert zb.step_time == pytest.approx(3 * micro + stages - 1)
    assert zb.step_time < one_f_one_b_time(stages, micro, 1.0, 2.0)
