"""The step plan and the deadlock checker, in one process: the plans the engine runs cannot deadlock under
NCCL's rules, for every schedule, mesh, microbatch count and routing tried; the old posting order could."""

import itertools

import pytest

from hf_noloco.engine.routing import Router
from hf_noloco.engine.schedule import (
    Compute,
    Message,
    Post,
    find_deadlock,
    held_limit,
    mesh_plans,
    pipeline_order,
)

SEEDS_PER_CASE = 1  # a seed of its own in every case of the grid: 2016 distinct draws in all


def _routers(num_replicas, case: int):
    yield Router(num_replicas, "fixed")
    if num_replicas > 1:
        for granularity, k in itertools.product(("sample", "step"), range(SEEDS_PER_CASE)):
            yield Router(num_replicas, granularity, seed=SEEDS_PER_CASE * case + k)


def _separate(plan):
    """The order the engine used to post in: each compute's receives, then its sends, each in a batch."""
    separate = []
    for item in plan:
        if isinstance(item, Post):
            separate += [Post(item.sends, ())] if item.sends else []
            separate += [Post((), item.recvs)] if item.recvs else []
        else:
            separate.append(item)
    return separate


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "forward", "zb-h1"])
@pytest.mark.parametrize("num_stages", range(2, 9))
def test_no_plan_deadlocks(schedule, num_stages):
    checked = 0
    for num_replicas, num_micro in itertools.product(range(1, 5), range(1, 17)):
        if schedule == "zb-h1" and (num_micro + num_replicas + num_stages) % 2:
            continue  # half the grid (a checkerboard): its batches are 1F1B's, which the whole grid checks
        micro = 1 + (num_micro + num_replicas) % 3  # rows per microbatch: split over up to 3 peers
        for router in _routers(num_replicas, case=100 * num_stages + 20 * num_replicas + num_micro):
            plans = mesh_plans(schedule, num_stages, router, num_micro, micro, step=5, first_sample=7 * micro)
            problem = find_deadlock(plans) or find_deadlock(plans, atomic=False)  # both readings
            assert problem is None, (
                schedule,
                num_stages,
                num_replicas,
                router.granularity,
                num_micro,
                problem,
            )
            checked += 1
    assert checked == 16 * (1 + 3 * (1 + 2 * SEEDS_PER_CASE)) // (2 if schedule == "zb-h1" else 1)


@pytest.mark.parametrize("num_stages", range(2, 9))
def test_zb_h1_runs_1f1bs_forwards_and_backwards_with_the_weight_gradients_in_the_bubble(num_stages):
    """Per stage: 1F1B's F and B sequence; one W per microbatch after its B, in microbatch order (gradients
    accumulate as under 1F1B); the pipeline never holds more microbatches on a stage (forward done, W not)
    than 1F1B's peak, the first stage's, and the first stage holds exactly what it holds under 1F1B."""
    deferred_somewhere = False
    for num_micro in range(1, 17):
        peaks = []
        for stage in range(num_stages):
            order = pipeline_order("zb-h1", num_micro, num_stages, stage)
            assert [c for c in order if c[0] != "W"] == pipeline_order("1f1b", num_micro, num_stages, stage)
            weights = [m for phase, m in order if phase == "W"]
            assert weights == ([] if stage == 0 else list(range(num_micro)))  # stage 0: B is the backward
            held = peak = 0
            for i, (phase, m) in enumerate(order):
                if phase == "W":
                    assert order.index(("B", m)) < i
                    deferred_somewhere |= order[i - 1] != ("B", m)
                held += {"F": 1, "B": -1 if stage == 0 else 0, "W": -1}[phase]
                peak = max(peak, held)
            assert held == 0 and peak <= held_limit("zb-h1", num_micro, num_stages, stage)
            peaks.append(peak)
        assert peaks[0] == held_limit("1f1b", num_micro, num_stages, 0) == max(peaks)
        assert max(peaks) == max(held_limit("1f1b", num_micro, num_stages, s) for s in range(num_stages))
    assert deferred_somewhere  # else this would be 1F1B with a split backward


@pytest.mark.parametrize(
    "num_stages, num_replicas, granularity", [(2, 1, "fixed"), (3, 2, "sample"), (5, 3, "step")]
)
def test_zb_h1_posts_1f1bs_batches_with_each_weight_gradient_after_its_backwards_sends(
    num_stages, num_replicas, granularity
):
    """The batches (what :func:`find_deadlock` reads) are 1F1B's, in 1F1B's order; the Ws are computes in
    between, each after the batch carrying the sends of the B before it."""
    router = Router(num_replicas, granularity, seed=3)
    for num_micro in (1, 3, 8):
        ours = mesh_plans("zb-h1", num_stages, router, num_micro, micro=2, step=1)
        theirs = mesh_plans("1f1b", num_stages, router, num_micro, micro=2, step=1)
        for rank, plan in ours.items():
            assert [i for i in plan if isinstance(i, Post)] == [
                i for i in theirs[rank] if isinstance(i, Post)
            ]
            for i, item in enumerate(plan):
                if isinstance(item, Compute) and item.phase == "W":
                    before = plan[plan.index(Compute("B", item.microbatch)) + 1]
                    assert isinstance(before, Post) and before.sends[0].phase == "B", (rank, plan)
                    assert plan.index(before) < i


@pytest.mark.parametrize(
    "num_stages, num_replicas, granularity",
    [(2, 1, "fixed"), (2, 2, "sample"), (2, 2, "step"), (4, 1, "fixed")],
)
def test_the_old_posting_order_of_1f1b_deadlocks(num_stages, num_replicas, granularity):
    plans = mesh_plans("1f1b", num_stages, Router(num_replicas, granularity, seed=1), num_micro=8, micro=2)
    assert find_deadlock(plans) is None
    problem = find_deadlock({rank: _separate(plan) for rank, plan in plans.items()}, atomic=False)
    assert problem is not None and problem.startswith("deadlock: rank 0 waits to send x"), problem
    # GPipe posted separately happens to be safe: all sends of a phase come before any receive of the next.
    gpipe = mesh_plans("gpipe", num_stages, Router(num_replicas, granularity, seed=1), num_micro=8, micro=2)
    separate = {rank: _separate(plan) for rank, plan in gpipe.items()}
    assert find_deadlock(separate) is None and find_deadlock(separate, atomic=False) is None


def _merged(plan):
    """The plans the engine posted before the atomic reading: one batch between any two computes."""
    merged = []
    for item in plan:
        if isinstance(item, Post) and merged and isinstance(merged[-1], Post):
            merged[-1] = Post(merged[-1].sends + item.sends, merged[-1].recvs + item.recvs)
        else:
            merged.append(item)
    return merged


def test_the_old_gpipe_plan_fails_the_atomic_reading_and_the_new_one_passes_both():
    router = Router(2, "sample", seed=1)
    plans = mesh_plans("gpipe", 2, router, num_micro=4, micro=2)
    old = {rank: _merged(plan) for rank, plan in plans.items()}
    assert find_deadlock(old, atomic=False) is None  # safe when operations complete one by one
    problem = find_deadlock(old)
    assert problem is not None and problem.startswith("deadlock (atomic batches)"), problem
    assert find_deadlock(plans) is None and find_deadlock(plans, atomic=False) is None
    # 1F1B with fewer microbatches than stages has the same warm-up shape; its steady state stays one batch.
    short = mesh_plans("1f1b", 3, router, num_micro=1, micro=2)
    assert find_deadlock({r: _merged(p) for r, p in short.items()}) is not None
    steady = mesh_plans("1f1b", 2, router, num_micro=4, micro=2)
    assert any(isinstance(i, Post) and i.sends and i.recvs for plan in steady.values() for i in plan)


def test_the_atomic_reading_needs_partner_batches_at_their_heads_at_once():
    x = Message("F", 0, 0, 1, (0,))
    g = Message("B", 0, 1, 0, (0,))
    # One batch of rank 0 matched by two batches of rank 1: never both at rank 1's head.
    split = {0: [Post((x,), (g,))], 1: [Post((), (x,)), Post((g,), ())]}
    assert find_deadlock(split, atomic=False) is None and find_deadlock(split) is not None
    assert find_deadlock({0: [Post((x,), (g,))], 1: [Post((g,), (x,))]}) is None  # mirrored batches


def test_the_checker_follows_the_stream_rules():
    x = Message("F", 0, 0, 1, (0,))
    g = Message("B", 0, 1, 0, (0,))
    # Each rank receives before it sends, in separate batches: a cycle.
    assert (
        find_deadlock({0: [Post((), (g,)), Post((x,), ())], 1: [Post((), (x,)), Post((g,), ())]}) is not None
    )
    # The same messages batched together complete, and so does one side sending first.
    assert find_deadlock({0: [Post((x,), (g,))], 1: [Post((g,), (x,))]}) is None
    assert find_deadlock({0: [Post((x,), ()), Post((), (g,))], 1: [Post((), (x,)), Post((g,), ())]}) is None
    # Unmatched and reordered messages are reported as such.
    assert "unmatched or out of order" in find_deadlock({0: [Post((x,), ())], 1: []})
    y = Message("F", 1, 0, 1, (0,))
    assert "unmatched or out of order" in find_deadlock(
        {0: [Post((x,), ()), Post((y,), ())], 1: [Post((), (y,)), Post((), (x,))]}
    )


def test_plans_route_every_row_exactly_once():
    """A step's messages carry each row of each microbatch across each boundary once, as the router says."""
    router = Router(3, "sample", seed=4)
    plans = mesh_plans("1f1b", 3, router, num_micro=4, micro=5, step=2, first_sample=10)
    for boundary in range(2):
        for m in range(4):
            for phase in ("F", "B"):
                rows = {}
                for plan in plans.values():
                    for post in (item for item in plan if isinstance(item, Post)):
                        for msg in post.sends:
                            if (
                                msg.phase == phase
                                and msg.microbatch == m
                                and msg.src % 3 == boundary + (phase == "B")
                            ):
                                rows.setdefault(msg.src // 3, []).extend((r, msg.dst // 3) for r in msg.rows)
                for sender, sent in rows.items():
                    assert sorted(r for r, _ in sent) == list(range(5))
                    for row, receiver in sent:
                        perm = router.permutation(boundary, 2, 10 + m * 5 + row)
                        assert (perm[sender] if phase == "F" else perm.index(sender)) == receiver
