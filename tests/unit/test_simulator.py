"""The discrete-event simulator (hf_noloco/estimate/simulator.py) against hand-computed values."""

import math
import random

import pytest

from hf_noloco.engine.routing import Router
from hf_noloco.engine.schedule import BACKWARD, FORWARD, Post, mesh_plans
from hf_noloco.estimate.simulator import (
    Link,
    Network,
    group_exchange,
    one_f_one_b_time,
    pair_exchange,
    ring_all_reduce,
    ring_all_reduce_time,
    ring_collective,
    simulate_outer_periods,
    simulate_step,
    tree_all_reduce,
    tree_all_reduce_time,
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


# ----------------------------------------------------------------- nodes, collectives, outer periods


def test_a_nodes_ranks_share_its_uplink_and_talk_inside_for_free():
    network = Network(bandwidth=100.0, latency=1.0, procs_per_node=2)
    # ranks 0 and 1 (node 0) each send 100 bytes to node 1 at t = 0: one after the other on the uplink
    assert network.link(0, 2).transfer(100, 0.0) == pytest.approx(2.0)
    assert network.link(1, 3).transfer(100, 0.0) == pytest.approx(3.0)
    assert network.link(0, 1).transfer(1e9, 0.0) == 0.0  # inside the node: infinite bandwidth, no latency
    assert network.link(2, 0).transfer(50, 0.0) == pytest.approx(1.5)  # node 1's own uplink is free
    assert network.bytes_per_uplink() == {0: 200, 1: 50}
    assert network.bytes_per_link() == {(0, 1): 1e9}


def test_group_exchange_waits_for_the_later_partner_and_counts_messages():
    network = Network(bandwidth=100.0, latency=1.0)
    done = group_exchange(network, [(0, 1)], 100, {0: 0.0, 1: 5.0})
    assert done == {0: pytest.approx(5 + 1 + 1), 1: pytest.approx(5.0)}  # 0 waits for 1's send at 5
    # a group of three, two messages per partner: each link carries 2 * 100 bytes back to back
    network = Network(bandwidth=100.0, latency=1.0)
    done = group_exchange(network, [(0, 1, 2)], 100, dict.fromkeys(range(3), 0.0), messages=2)
    assert done == {r: pytest.approx(1 + 2.0) for r in range(3)}
    assert network.bytes_per_link() == {(a, b): 200 for a in range(3) for b in range(3) if a != b}


@pytest.mark.parametrize("n", [2, 3, 6])
def test_ring_collectives_match_their_closed_forms(n):
    bandwidth, latency, nbytes = 1e3, 0.5, 600.0
    ready = dict.fromkeys(range(n), 0.0)
    done = ring_collective(Network(bandwidth, latency), [list(range(n))], nbytes, ready)
    assert max(done.values()) == pytest.approx(ring_all_reduce_time(n, nbytes, bandwidth, latency))
    network = Network(bandwidth, latency)
    gathered = ring_collective(network, [list(range(n))], nbytes, ready, kind="all_gather")
    assert max(gathered.values()) == pytest.approx((n - 1) * (latency + nbytes / bandwidth))
    assert network.bytes_per_link() == {(r, (r + 1) % n): pytest.approx((n - 1) * nbytes) for r in range(n)}


def test_two_rings_sharing_uplinks_interleave_one_chunk_behind():
    """Two stages' rings over four nodes (one column per node): each step a node's uplink carries both
    rings' chunks, the second one ``c = chunk / bw`` behind; with ``latency >= c`` every step takes
    ``latency + c`` and the second ring ends ``c`` later: ``K (latency + c)`` and ``K (latency + c) + c``,
    ``K = 2 (n - 1)``."""
    n, bandwidth, latency, nbytes = 4, 100.0, 2.0, 400.0
    network = Network(bandwidth, latency, procs_per_node=2)
    rings = [[r * 2 + s for r in range(n)] for s in range(2)]
    done = ring_collective(network, rings, nbytes, dict.fromkeys(range(2 * n), 0.0))
    c, k = nbytes / n / bandwidth, 2 * (n - 1)
    assert max(done[r] for r in rings[0]) == pytest.approx(k * (latency + c))
    assert max(done[r] for r in rings[1]) == pytest.approx(k * (latency + c) + c)
    assert network.bytes_per_uplink() == {r: pytest.approx(2 * 2 * (n - 1) / n * nbytes) for r in range(n)}


@pytest.mark.parametrize("n,segments", [(2, 1), (3, 4), (5, 4), (8, 8), (13, 3)])
def test_tree_all_reduce_matches_its_pipeline_formula(n, segments):
    """Depth ``D = floor(log2 n)``: ``2 D latency + (2 D + S - 1) nbytes / (S bw)``."""
    bandwidth, latency, nbytes = 1e3, 0.25, 800.0
    network = Network(bandwidth, latency)
    done = tree_all_reduce(network, list(range(n)), nbytes, dict.fromkeys(range(n), 0.0), segments)
    depth = math.floor(math.log2(n))
    expected = 2 * depth * latency + (2 * depth + segments - 1) * nbytes / segments / bandwidth
    assert max(done.values()) == pytest.approx(expected)
    assert tree_all_reduce_time(n, nbytes, bandwidth, latency, segments) == pytest.approx(expected)
    sent = {}
    for (src, _), b in network.bytes_per_link().items():
        sent[src] = sent.get(src, 0.0) + b
    # the root sends to its children only; every other rank once up and once per child
    for i in range(n):
        kids = sum(1 for c in (2 * i + 1, 2 * i + 2) if c < n)
        assert sent.get(i, 0.0) == pytest.approx(nbytes * (kids + (i > 0)))


def test_blocking_outer_period_by_hand():
    """One NoLoCo period, two replicas of one stage: ``H T + latency + b / bw + c``; blocked the exchange."""
    h, t, bw, lat, b, c = 5, 0.2, 1000.0, 0.1, 300.0, 0.05
    result = simulate_outer_periods("noloco", 2, 1, t, [b], Network(bw, lat), h, outer_compute=c)
    x = lat + b / bw
    assert result.time == pytest.approx(h * t + x + c)
    assert result.blocked == [pytest.approx(x)] and result.exchange == [pytest.approx(x)]
    assert result.bytes_per_link == {(0, 1): b, (1, 0): b}


@pytest.mark.parametrize("tau", [1, 3, 5])
def test_overlapped_periods_hide_what_tau_steps_cover(tau):
    """Two periods, tau inner steps of overlap: the first exchange (``x``) is waited for only past
    ``tau T``; the second is the run's last, applied at its end (all of it waited for)."""
    h, t, bw, lat, b, c = 5, 0.2, 1000.0, 0.1, 300.0, 0.05
    x = lat + b / bw  # 0.4 = two steps
    result = simulate_outer_periods(
        "noloco", 2, 1, t, [b], Network(bw, lat), h, overlap_steps=tau, periods=2, outer_compute=c
    )
    first = max(0.0, x - tau * t)
    assert result.blocked == [pytest.approx(first), pytest.approx(x)]
    assert result.time == pytest.approx(2 * h * t + first + c + x + c)


def test_a_slow_replica_holds_its_partner_under_noloco_and_everyone_under_diloco():
    """Replica 0 runs at half speed. NoLoCo: only its partner waits (``H T + x``), the other pair ``x``.
    DiLoCo's ring: a rank's step ``k`` chunk leaves when its predecessor's step ``k - 1`` chunk arrives, so
    the slow rank's start reaches everyone; the last rank done is ``2 H T + 2 (n - 1) hop``."""
    n, h, t, bw, lat, b = 4, 4, 1.0, 1000.0, 0.1, 200.0
    slow = {0: 2.0}
    pairs = simulate_outer_periods("noloco", n, 1, t, [b], Network(bw, lat), h, slow=slow, seed=3)
    x = lat + b / bw
    from hf_noloco.outer.gossip import gossip_groups

    partner = next(g for g in gossip_groups(n, 2, 3, 0) if 0 in g)
    partner = partner[1] if partner[0] == 0 else partner[0]
    waits = {r: (h * t + x if r == partner else 0.0 if r == 0 else x) for r in range(n)}
    assert pairs.blocked == [pytest.approx(sum(waits.values()) / n)]
    assert pairs.blocked_max == [pytest.approx(h * t + x)]
    ring = simulate_outer_periods("diloco", n, 1, t, [b], Network(bw, lat), h, slow=slow)
    hop = lat + b / n / bw
    assert max(ring.clocks) == pytest.approx(2 * h * t + 2 * (n - 1) * hop)
    assert min(ring.clocks) >= 2 * h * t  # every replica waited for the slow one
    coupled = simulate_outer_periods("local", n, 1, t, [b], Network(bw, lat), h, slow=slow, coupled=True)
    assert coupled.clocks == [pytest.approx(2 * h * t)] * n


@pytest.mark.parametrize("tau", [0, 2, 3])
def test_a_window_from_one_apply_to_the_next(tau):
    """``phase = tau``: the outer step starts after step ``H - tau`` and is applied after step ``H``: the
    window takes ``H T + max(0, x - tau T) + c``."""
    h, t, bw, lat, b, c = 6, 0.2, 1000.0, 0.1, 300.0, 0.05
    x = lat + b / bw
    result = simulate_outer_periods(
        "noloco", 2, 1, t, [b], Network(bw, lat), h, overlap_steps=tau, outer_compute=c, phase=tau
    )
    assert result.time == pytest.approx(h * t + max(0.0, x - tau * t) + c)
    assert result.blocked == [pytest.approx(max(0.0, x - tau * t))]


def test_a_dropped_replica_is_left_out_of_the_exchange():
    """Replica 2 of 4 dropped. NoLoCo: the 3 live ones form one group of three (pairs, an odd count), each
    receiving its two partners' copies on two links at once: ``latency + b / bw``; replica 2 waits for
    nobody and sends nothing. DiLoCo: a ring of 3, ``2 * 2 * (latency + b / (3 bw))``."""
    h, t, bw, lat, b = 4, 0.5, 1000.0, 0.1, 300.0
    network = Network(bw, lat)
    pairs = simulate_outer_periods("noloco", 4, 1, t, [b], network, h, live=[0, 1, 3])
    x = lat + b / bw
    assert pairs.blocked == [pytest.approx(3 * x / 4)]
    assert pairs.clocks == [pytest.approx(h * t + x)] * 2 + [pytest.approx(h * t), pytest.approx(h * t + x)]
    assert set(pairs.bytes_per_link) == {(a, c) for a in (0, 1, 3) for c in (0, 1, 3) if a != c}
    ring = simulate_outer_periods("diloco", 4, 1, t, [b], Network(bw, lat), h, live=[0, 1, 3])
    assert max(ring.clocks) == pytest.approx(h * t + 4 * (lat + b / 3 / bw))
    assert ring.clocks[2] == pytest.approx(h * t)
