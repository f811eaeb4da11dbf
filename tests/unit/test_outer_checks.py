"""The outer step's checks folded into one device read per outer step (outer/checks.py DeviceChecks, and
outer/wire.py's lazy combine), counted with the host-sync double: none per bucket, one per outer step, with
the same verdicts and sums as the checks made one at a time."""

import pytest
import torch

from hf_noloco.outer.checks import DeviceChecks, check_finite
from hf_noloco.outer.compression import encode_with_feedback_
from hf_noloco.outer.wire import Wire
from tests.helpers.host_syncs import HostSyncs

BUCKETS = 8


def _buckets(bad: int | None = None):
    g = torch.Generator().manual_seed(0)
    buckets = [torch.randn(64, generator=g) for _ in range(BUCKETS)]
    if bad is not None:
        buckets[bad][5] = float("nan")
    return buckets


def test_no_sync_per_bucket_and_one_per_outer_step():
    syncs, checks = HostSyncs(), DeviceChecks()
    buckets = _buckets()  # made outside the double: device tensors (a stage's weights)
    with syncs:
        for b, theta in enumerate(buckets):
            partner = theta.flip(0)
            checks.check([theta.sum()], "this replica's own weights", f"bucket {b}")
            checks.add("sq_dist", torch.dot(theta - partner, theta - partner))
        before = syncs.total()
        sums = checks.read()
    assert before == 0 and syncs.total() == 1  # the read
    expected = sum(float(((t - t.flip(0)) ** 2).double().sum()) for t in _buckets())
    assert sums["sq_dist"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("bad", [0, 3, BUCKETS - 1])
def test_the_first_bad_item_is_named_as_the_check_made_at_once_names_it(bad):
    checks = DeviceChecks()
    for b, theta in enumerate(_buckets(bad)):
        checks.check([theta.sum()], f"the weights received from rank {b}", "NoLoCo outer step 4")
    with pytest.raises(FloatingPointError) as deferred:
        checks.read()
    with pytest.raises(FloatingPointError) as at_once:
        for b, theta in enumerate(_buckets(bad)):
            check_finite([theta.sum()], f"the weights received from rank {b}", "NoLoCo outer step 4")
    assert str(deferred.value) == str(at_once.value)
    assert checks.read() == {}  # cleared by the read


def test_the_lazy_combine_gives_the_same_means_and_distances_without_a_sync():
    wire = Wire("int8", "noloco", False, [256], torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    thetas = [torch.randn(256, generator=g) for _ in range(3)]
    packets = [[encode_with_feedback_(t.clone(), torch.zeros(256), "int8")] for t in thetas]
    members = list(zip([0, 1, 2], packets))
    means, distances = wire.combine(0, members, 1, lambda key, values: None)
    syncs, checks = HostSyncs(), DeviceChecks()
    with syncs:
        lazy_means, lazy_distances = wire.combine(
            0,
            members,
            1,
            lambda key, values: checks.check([v.sum() for v in values], f"rank {key}", "x"),
            lazy=True,
        )
        for d in lazy_distances:
            checks.add("sq_dist", d)
        assert syncs.total() == 0
        sums = checks.read()
    assert all(torch.equal(a, b) for a, b in zip(means, lazy_means))
    assert sums["sq_dist"] == pytest.approx(sum(distances), rel=1e-12)
