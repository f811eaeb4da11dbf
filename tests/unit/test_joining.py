"""Joining a live run, in one process: who copies whom, which requests are complete, the state's wire form,
and the admission protocol of :class:`~hf_noloco.resilience.membership.Membership` over a real store (threads
stand in for processes)."""

import threading
import time

import torch
import torch.distributed as dist

from hf_noloco.resilience.joining import join_pairs
from hf_noloco.resilience.membership import Membership, complete_requests
from hf_noloco.resilience.transfer import _buckets, _join, _markers, _split


def test_each_joined_stage_copies_the_same_stage_of_a_replica_that_was_live():
    assert join_pairs([1, 3], [0], 2) == [(2, 0), (3, 1)]
    # Two joiners draw on two donors; stages keep their index.
    assert join_pairs([3, 1], [2, 0], 3) == [(3, 0), (4, 1), (5, 2), (9, 6), (10, 7), (11, 8)]
    assert join_pairs([0, 1, 2], [], 2) == []


def test_a_column_is_admitted_once_every_stage_asked_and_it_is_not_live():
    asked = {0: {0, 1}, 2: {1}, 3: {0, 1}}
    assert complete_requests(asked, [1, 3], 2) == [0]
    assert complete_requests(asked, [1], 2) == [0, 3]
    assert complete_requests({}, [0], 2) == []


def test_the_state_splits_into_a_plain_structure_and_tensors_and_back():
    state = {
        "w": torch.arange(6.0).reshape(2, 3),
        "opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, dtype=torch.bfloat16)}}},
        "names": ["a", "b"],
        "pair": (1, torch.zeros(0, dtype=torch.int64)),
        "n": 7,
    }
    tensors = []
    skeleton = _split(state, tensors)
    assert len(tensors) == 4 and not any(isinstance(v, torch.Tensor) for v in _flatten(skeleton))
    assert [m["dtype"] for m in _markers(skeleton, [])] == ["float32", "float32", "bfloat16", "int64"]
    back = _join(skeleton, tensors)
    assert back["n"] == 7 and back["names"] == ["a", "b"] and isinstance(back["pair"], tuple)
    assert torch.equal(back["opt"]["state"][0]["exp_avg"], state["opt"]["state"][0]["exp_avg"])


def _flatten(tree):
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _flatten(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _flatten(v)]
    return [tree]


def test_buckets_are_consecutive_and_at_most_the_limit_unless_one_tensor_is_larger():
    assert _buckets([10, 10, 100, 5, 5], 20) == [[0, 1], [2], [3, 4]]
    assert _buckets([], 20) == []
    sizes = [3, 8, 1, 9, 9, 2]
    buckets = _buckets(sizes, 10)
    assert [i for b in buckets for i in b] == list(range(6))
    assert all(sum(sizes[i] for i in b) <= 10 for b in buckets)


class _Watch:
    """What Membership reads from comm.PeerWatch."""

    def __init__(self, store):
        self.store, self.prefix, self.interval = store, "hf_noloco/0", 0.05

    def start_beating(self):
        pass


def test_a_joiner_is_admitted_at_a_fence_that_every_member_takes_without_going_offline():
    """Three one-stage replicas; replica 2 was dropped (view 1). A joiner of replica 2 asks; the leader
    (rank 0) proposes view 2 at the fence after next, every member adopts it there, none is interrupted (no
    step skipped), on_change names the joined column and the columns live before, and the three then meet
    at the same fences."""
    from hf_noloco.engine.comm import interrupt_waits_on

    store = dist.HashStore()
    changes = {0: [], 1: [], 2: []}
    offline = []

    def member(rank, **kwargs):
        return Membership(
            _Watch(store),
            rank,
            1,
            3,
            silence=3600,
            poll=0.01,
            on_change=lambda *a: changes[rank].append(a),
            **kwargs,
        )

    members = {r: member(r) for r in (0, 1)}
    interrupt_waits_on(None)
    try:
        members[0].propose([2], "rank 2 lost")
        fences = {0: 0, 1: 0}
        stop = threading.Event()

        def train(r):  # fences as training steps, watching for an interruption
            while not stop.is_set() and fences[r] < 40:
                members[r].fence()
                fences[r] += 1
                if members[r].offline:
                    offline.append((r, fences[r]))
                time.sleep(0.02)

        threads = [threading.Thread(target=train, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while members[0].view < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        joined = {}
        joiner = threading.Thread(target=lambda: joined.update(m=member(2, joining=True)))
        joiner.start()
        joiner.join(20)
        assert "m" in joined, "the joiner was not admitted"
        members[2] = joined["m"]
        for _ in range(3):
            members[2].fence()
        stop.set()
        for t in threads:
            t.join(10)
        assert not offline
        assert changes[0] == changes[1] == [(1, [0, 1], [], [0, 1, 2]), (2, [0, 1, 2], [2], [0, 1])]
        assert changes[2] == [(2, [0, 1, 2], [2], [0, 1])]
        assert all(m.view == 2 and m.live == [0, 1, 2] for m in members.values())
        assert not store.check(["hf_noloco/0/live/ask/2/0"])  # the request is gone once admitted
    finally:
        stop.set()
        for m in members.values():
            m.close()


def test_a_column_launch_with_rejoin_starts_its_failed_column_again_as_a_joiner(tmp_path, monkeypatch):
    """``column_launch --rejoin 1``: the column's first start fails (one worker exits 9); once all its
    processes have left, both start again with the join flag set, and the launch ends with their status."""
    from hf_noloco.launch.column_launch import main

    monkeypatch.setenv("HF_NOLOCO_RUN_SECRET", "a-test-secret-" + "0" * 32)  # (these workers never check it)
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys\n"
        f"open({str(tmp_path)!r} + '/starts', 'a').write(os.environ['RANK'] + ':' + "
        "os.environ.get('HF_NOLOCO_JOIN', '0') + '\\n')\n"
        "sys.exit(9 if os.environ['RANK'] == '3' and os.environ.get('HF_NOLOCO_JOIN') != '1' else 0)\n"
    )
    store = ["--store", "127.0.0.1:1", "--column", "1", "--columns", "2", "--stages", "2"]
    assert main([*store, "--rejoin", "1", str(script)]) == 0
    starts = (tmp_path / "starts").read_text().split()
    assert sorted(starts[:2]) == ["2:0", "3:0"] and sorted(starts[2:]) == ["2:1", "3:1"]
    (tmp_path / "starts").unlink()
    assert main([*store, str(script)]) == 9  # without --rejoin: the failure is the launch's status
