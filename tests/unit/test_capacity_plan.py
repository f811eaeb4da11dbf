"""Capacity routing's message plan: unequal rows per replica, matched across each boundary, never deadlock and
reduce to today's plan when the rows are equal."""

import itertools
from collections import Counter

import pytest

from hf_noloco.engine.capacity import boundary_pairs, wave_counts
from hf_noloco.engine.routing import Router
from hf_noloco.engine.schedule import (
    BACKWARD,
    FORWARD,
    Post,
    capacity_links,
    find_deadlock,
    mesh_plans,
    routed_links,
)
from hf_noloco.engine.shape import rank_of

SCHEDULES = ["1f1b", "gpipe", "zb-h1"]


def _rows(speeds_per_stage, micro, num_micro, group_size, step=0, floor=0.0):
    """rows[stage][m][replica], drawn as the engine would from each stage's speeds."""
    return [
        [wave_counts(speeds, micro, group_size, 7, step, stage, m, floor=floor) for m in range(num_micro)]
        for stage, speeds in enumerate(speeds_per_stage)
    ]


def test_pairs_place_every_row_once_and_meet_the_receivers_counts():
    senders, receivers = [5, 6, 3, 2], [2, 7, 4, 3]
    for key in range(50):
        pairs = boundary_pairs(senders, receivers, 4, key)
        sent = Counter((r, i) for (r, _), p in pairs.items() for i, _ in p)
        got = Counter((q, j) for (_, q), p in pairs.items() for _, j in p)
        assert sent == Counter((r, i) for r, c in enumerate(senders) for i in range(c))
        assert got == Counter((q, j) for q, c in enumerate(receivers) for j in range(c))
        for p in pairs.values():
            assert [i for i, _ in p] == sorted(i for i, _ in p)  # both ends list rows in sender order


def test_pairs_keep_rows_inside_their_routing_group():
    senders, receivers = [3, 1, 2, 2], [1, 3, 4, 0]  # groups {0, 1} and {2, 3}: 4 rows each side
    for key in range(30):
        for r, q in boundary_pairs(senders, receivers, 2, key):
            assert r // 2 == q // 2
    with pytest.raises(ValueError, match="sum to the same number"):
        boundary_pairs([3, 1, 2, 2], [2, 3, 3, 0], 2, 0)


def test_pairings_are_uniform_over_all_placements_with_the_counts():
    """Which receiver each of the sender rows reaches: every sequence of receivers with the right counts is
    equally likely (chi-square against the uniform, 5 rows over counts (2, 2, 1): 30 sequences)."""
    senders, receivers = [3, 2, 0], [2, 2, 1]
    draws = 6000
    seen = Counter()
    for key in range(draws):
        pairs = boundary_pairs(senders, receivers, 3, key)
        where = {(r, i): q for (r, q), p in pairs.items() for i, _ in p}
        seen[tuple(where[r, i] for r in range(3) for i in range(senders[r]))] += 1
    outcomes = set(itertools.permutations([0, 0, 1, 1, 2]))
    assert set(seen) == outcomes
    expected = draws / len(outcomes)
    chi2 = sum((seen[o] - expected) ** 2 / expected for o in outcomes)
    assert chi2 < 58.3  # 29 degrees of freedom, p = 0.001


@pytest.mark.parametrize("granularity", ["sample", "step"])
@pytest.mark.parametrize("num_replicas,num_stages,group", [(2, 2, 2), (4, 2, 4), (4, 3, 2), (3, 4, 3)])
def test_equal_rows_give_todays_plan_exactly(granularity, num_replicas, num_stages, group):
    router = Router(num_replicas, granularity, seed=3, group_size=group)
    rows = [[[2] * num_replicas for _ in range(4)] for _ in range(num_stages)]
    for schedule in SCHEDULES:
        ours = mesh_plans(schedule, num_stages, router, 4, 2, step=5, first_sample=10, rows=rows)
        assert ours == mesh_plans(schedule, num_stages, router, 4, 2, step=5, first_sample=10)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    "speeds,num_stages,group,num_micro",
    [
        ([1.0, 1.0, 0.5, 0.25], 2, 4, 4),
        ([1.0, 1.0, 0.5, 0.25], 3, 4, 5),
        ([3.0, 1.0, 1.0, 0.4, 2.0, 1.0], 4, 3, 6),
        ([1.0, 0.1], 2, 2, 1),
        ([0.2, 1.0, 1.0, 1.0, 1.0, 0.7, 1.0, 1.0], 2, 8, 3),
    ],
)
def test_unequal_rows_never_deadlock(schedule, speeds, num_stages, group, num_micro):
    router = Router(len(speeds), "sample", seed=1, group_size=group)
    for step in range(3):
        # each stage's replicas at their own speeds (a stage's column need not be uniformly slow)
        per_stage = [speeds[s:] + speeds[:s] for s in range(num_stages)]
        rows = _rows(per_stage, 4, num_micro, group, step, floor=1 / (4 * len(speeds)))
        plans = mesh_plans(schedule, num_stages, router, num_micro, 4, step=step, rows=rows)
        assert find_deadlock(plans) is None
        assert find_deadlock(plans, atomic=False) is None


def test_rows_flow_through_every_stage_and_back_to_where_they_came_from():
    """Follow each sample through the plans' messages: every row of every stage receives exactly one sample
    per microbatch, the samples of a wave are those the first stage started, and every gradient goes back to
    the row its activation came from."""
    speeds, num_stages, micro, num_micro = [1.0, 1.0, 0.5, 0.25], 3, 4, 3
    router = Router(4, "sample", seed=5)
    per_stage = [speeds, speeds[::-1], [1.0, 0.5, 1.0, 0.5]]
    rows = _rows(per_stage, micro, num_micro, 4, floor=1 / 16)
    plans = mesh_plans("1f1b", num_stages, router, num_micro, micro, rows=rows)
    held = {}  # (stage, replica, m) -> [sample id per row]
    for m in range(num_micro):
        for r in range(4):
            held[0, r, m] = [(r, m, i) for i in range(rows[0][m][r])]
    for stage in range(1, num_stages):
        for m in range(num_micro):
            for q in range(4):
                slots = [None] * rows[stage][m][q]
                rank = rank_of(q, stage, num_stages)
                for post in (item for item in plans[rank] if isinstance(item, Post)):
                    for msg in post.recvs:
                        if msg.phase == FORWARD and msg.microbatch == m:
                            src_replica = msg.src // num_stages
                            for i, j in zip(msg.rows, msg.into or msg.rows):
                                assert slots[j] is None
                                slots[j] = held[stage - 1, src_replica, m][i]
                assert None not in slots
                held[stage, q, m] = slots
        for m in range(num_micro):
            wave = sorted(s for r in range(4) for s in held[stage, r, m])
            assert wave == sorted(s for r in range(4) for s in held[0, r, m])
    for stage in range(num_stages - 1):  # backward: a gradient row lands where its activation was sent from
        for r in range(4):
            rank = rank_of(r, stage, num_stages)
            forward_sent = {
                (msg.microbatch, msg.dst, j): i
                for post in plans[rank]
                if isinstance(post, Post)
                for msg in post.sends
                if msg.phase == FORWARD
                for i, j in zip(msg.rows, msg.into or msg.rows)
            }
            backward_got = {
                (msg.microbatch, msg.src, i): j
                for post in plans[rank]
                if isinstance(post, Post)
                for msg in post.recvs
                if msg.phase == BACKWARD
                for i, j in zip(msg.rows, msg.into or msg.rows)
            }
            assert forward_sent == backward_got


def test_fixed_routing_is_refused():
    with pytest.raises(ValueError, match="random routing"):
        capacity_links(Router(2, "fixed"), [[[2, 2]], [[3, 1]]], 2, 0, 0, 0, 0, 2)


def test_capacity_links_with_equal_rows_are_routed_links():
    router = Router(4, "sample", seed=9)
    rows = [[[3] * 4] * 2] * 3
    for stage, replica in itertools.product(range(3), range(4)):
        ours = capacity_links(router, rows, 3, stage, replica, 2, 6, 3)
        theirs = routed_links(router, 3, stage, replica, 2, 6, 3)
        assert [ours(m) for m in range(2)] == [theirs(m) for m in range(2)]
