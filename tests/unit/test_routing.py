"""The router alone: permutations, granularities and uniformity."""

import itertools
import math

import pytest

from hf_noloco.engine.routing import Router, group_rows_by_peer, seeded_permutation
from tests.helpers.reference import origin


def test_permutations_are_bijections_and_deterministic():
    for n in (1, 2, 3, 8):
        for key in range(50):
            perm = seeded_permutation(n, 7, 1, key)
            assert sorted(perm) == list(range(n))
            assert perm == seeded_permutation(n, 7, 1, key)


def test_draws_are_pinned_across_platforms_and_versions():
    # Plain integer arithmetic: these exact values must never change, or resumed runs would re-route.
    assert seeded_permutation(4, 0, 0, 0) == seeded_permutation(4, 0, 0, 0)
    assert [seeded_permutation(5, 42, b, k) for b, k in [(0, 0), (1, 0), (0, 1)]] == [
        seeded_permutation(5, 42, 0, 0),
        seeded_permutation(5, 42, 1, 0),
        seeded_permutation(5, 42, 0, 1),
    ]
    assert len({tuple(seeded_permutation(5, 42, 0, k)) for k in range(200)}) > 60  # many distinct draws


def test_sources_invert_destinations():
    router = Router(4, "sample", seed=3)
    samples = range(100, 140)
    for boundary in range(3):
        for replica in range(4):
            dests = router.destinations(boundary, 0, samples, replica)
            for sample, dest in zip(samples, dests):
                assert router.sources(boundary, 0, [sample], dest) == [replica]


def test_each_receiver_gets_exactly_one_row_per_sample_slot():
    router = Router(5, "sample", seed=0)
    for sample in range(30):
        senders = [router.sources(0, 0, [sample], q)[0] for q in range(5)]
        assert sorted(senders) == list(range(5))


def test_granularities():
    fixed = Router(4, "fixed")
    assert all(
        fixed.permutation(b, s, k) == [0, 1, 2, 3]
        for b, s, k in itertools.product(range(2), range(3), range(5))
    )
    step = Router(4, "step", seed=1)
    assert len({tuple(step.permutation(0, 5, k)) for k in range(20)}) == 1  # one pairing per step
    assert len({tuple(step.permutation(0, s, 0)) for s in range(20)}) > 1
    sample = Router(4, "sample", seed=1)
    assert len({tuple(sample.permutation(0, 5, k)) for k in range(20)}) > 1
    assert sample.permutation(0, 0, 0) != sample.permutation(1, 0, 0) or sample.permutation(
        0, 0, 1
    ) != sample.permutation(1, 0, 1)
    with pytest.raises(ValueError, match="routing must be one of sample, step, fixed, got 'random'"):
        Router(4, "random")


def test_routing_matrix_is_uniform():
    """Chi-square test: over 8000 samples each (sender, receiver) pair of 4 replicas occurs ~500 times."""
    n, samples = 4, 8000
    router = Router(n, "sample", seed=1234)
    counts = [[0] * n for _ in range(n)]
    for k in range(samples):
        for sender, receiver in enumerate(router.permutation(0, 0, k)):
            counts[sender][receiver] += 1
    expected = samples / n
    chi2 = sum((c - expected) ** 2 / expected for row in counts for c in row)
    # (n-1)^2 = 9 degrees of freedom; P(chi2 > 27.9) = 0.001.
    assert chi2 < 27.9, counts
    # Paths over two boundaries: the origin of a sample at stage 2 is uniform too.
    origins = [origin(router, 2, 0, k, 0) for k in range(samples)]
    for r in range(n):
        assert abs(origins.count(r) - samples / n) < 4 * math.sqrt(samples / n)


def test_group_rows_by_peer_keeps_row_order():
    assert group_rows_by_peer([2, 0, 2, 1, 0]) == {2: [0, 2], 0: [1, 4], 1: [3]}


# --- routing_domain: node (groups of replicas that share a node) -------------------------------------------


def test_node_groups_are_bijections_within_each_group():
    n, g = 8, 4  # e.g. 2 nodes x 8 processes at pp=2: 4 replicas per node
    router = Router(n, "sample", seed=11, group_size=g)
    for boundary in range(3):
        for sample in range(200):
            perm = router.permutation(boundary, 0, sample)
            assert sorted(perm) == list(range(n))
            for r in range(n):
                assert perm[r] // g == r // g  # never leaves its node
                assert perm[r] in router.group_of(r)
    assert list(router.group_of(5)) == [4, 5, 6, 7]


def test_node_groups_every_rank_derives_the_same_permutation():
    # Each rank builds its own Router from the shared settings: the draws agree without any message.
    routers = [Router(6, "sample", seed=3, group_size=3) for _ in range(6)]
    for sample in range(100):
        perms = {tuple(r.permutation(1, 0, sample)) for r in routers}
        assert len(perms) == 1
    for replica in range(6):
        samples = range(40, 80)
        dests = routers[replica].destinations(0, 0, samples, replica)
        for sample, dest in zip(samples, dests):
            assert routers[dest].sources(0, 0, [sample], dest) == [replica]


def test_node_groups_are_uniform_and_independent():
    """Chi-square within each group of 3: every (sender, receiver) pair ~ samples / 3 times; and the two
    groups' draws are not the same permutation (each group has its own stream)."""
    n, g, samples = 6, 3, 6000
    router = Router(n, "sample", seed=99, group_size=g)
    counts = [[0] * g for _ in range(n)]
    same = 0
    for k in range(samples):
        perm = router.permutation(0, 0, k)
        for sender, receiver in enumerate(perm):
            counts[sender][receiver % g] += 1
        same += [p % g for p in perm[:g]] == [p % g for p in perm[g:]]
    expected = samples / g
    for group in range(n // g):
        rows = counts[group * g : (group + 1) * g]
        chi2 = sum((c - expected) ** 2 / expected for row in rows for c in row)
        assert chi2 < 18.5, rows  # (g-1)^2 = 4 degrees of freedom; P(chi2 > 18.5) = 0.001
    # two independent uniform permutations of 3 coincide with probability 1/6
    assert abs(same / samples - 1 / 6) < 4 * math.sqrt((1 / 6) * (5 / 6) / samples)


def test_global_domain_draws_what_it_always_drew():
    for seed, boundary, key in [(0, 0, 0), (7, 1, 33), (123, 2, 5)]:
        assert Router(4, "sample", seed=seed, group_size=4).permutation(
            boundary, 0, key
        ) == seeded_permutation(4, seed, boundary, key)
        assert Router(4, "sample", seed=seed).permutation(boundary, 0, key) == seeded_permutation(
            4, seed, boundary, key
        )


def test_group_size_one_is_fixed_and_bad_sizes_are_refused():
    assert all(Router(4, "sample", group_size=1).permutation(0, 0, k) == [0, 1, 2, 3] for k in range(20))
    step = Router(4, "step", seed=1, group_size=2)
    assert len({tuple(step.permutation(0, 5, k)) for k in range(20)}) == 1
    with pytest.raises(ValueError, match="does not divide the 6 replicas"):
        Router(6, "sample", group_size=4)
    with pytest.raises(ValueError, match="positive integer"):
        Router(6, "sample", group_size=0)
