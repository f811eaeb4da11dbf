"""Bounded waits and batches of messages, as NCCL returns them (one Work per batch), and the NCCL settings."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hf_noloco.config import NCCL_ENVIRONMENT, NoLoCoConfig
from hf_noloco.engine.comm import (
    NCCL_WATCHDOG_MARGIN,
    PeerError,
    PendingExchange,
    exchange,
    group_timeout,
    post,
    wait_sends,
)


class _BatchWork:
    """What NCCL's batch_isend_irecv returns: one Work for the whole batch (gloo: one per operation)."""

    def __init__(self, fails: bool):
        self.fails, self.waited = fails, 0

    def wait(self, timeout):
        self.waited += 1
        if self.fails:
            raise RuntimeError("Watchdog caught collective operation timeout")
        return True


def _describe(rank):
    return f"rank {rank} (stage {rank % 2}, replica {rank // 2})"


@pytest.fixture
def one_work_per_batch(monkeypatch):
    works = []

    def batch(ops):
        works.append(_BatchWork(fails=batch.fails))
        return works[-1:]

    batch.fails = False
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None: (op, tensor, peer))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    return batch, works


def test_a_failed_batch_names_every_peer_in_it(one_work_per_batch):
    batch, works = one_work_per_batch
    t = torch.zeros(2)
    batch.fails = True
    with pytest.raises(PeerError) as info:
        exchange([(t, 1), (t, 1), (t, 3)], [(t, 2)], 5.0, _describe, "stage 0 replica 0, step 7, forward")
    message = str(info.value)
    assert message.startswith("stage 0 replica 0, step 7, forward: failed completing a batch of sends to ")
    assert (
        "sends to rank 1 (stage 1, replica 0), rank 3 (stage 1, replica 1) and receives from rank 2"
        in message
    )
    assert "p2p_timeout=5s" in message and "Watchdog" in message


def test_a_batch_with_receives_is_waited_for_whole_and_one_of_sends_later(one_work_per_batch):
    batch, works = one_work_per_batch
    t = torch.zeros(2)
    assert exchange([(t, 1)], [(t, 2)], 5.0, _describe) == []  # the receives are needed now: waited for
    assert works[-1].waited == 1
    pending = exchange([(t, 1), (t, 3)], [], 5.0, _describe)  # sends alone: left in flight
    assert works[-1].waited == 0 and [what for _, what in pending] == [
        "completing a batch of sends to rank 1 (stage 1, replica 0), rank 3 (stage 1, replica 1)"
    ]
    batch.fails = True
    pending = exchange([(t, 1), (t, 3)], [], 5.0, _describe)
    with pytest.raises(PeerError, match="failed completing a batch of sends to rank 1 .*, rank 3"):
        wait_sends(pending, 5.0, "step 3")


def test_strict_mode_waits_for_every_batch_before_returning(one_work_per_batch, monkeypatch):
    _, works = one_work_per_batch
    monkeypatch.setenv("HF_NOLOCO_STRICT_P2P", "1")
    assert exchange([(torch.zeros(1), 1)], [], 5.0, _describe) == [] and works[-1].waited == 1


def test_a_pending_exchange_posts_now_and_waits_later_for_its_whole_batch(one_work_per_batch):
    batch, works = one_work_per_batch
    t = torch.zeros(2)
    pending = PendingExchange([(t, 1)], [(t, 1)], None, _describe)  # the overlapped outer sync's exchange
    assert len(works) == 1 and works[-1].waited == 0  # posted, not waited for: compute goes on
    pending.wait(5.0, "outer step 3")
    assert works[-1].waited == 1
    batch.fails = True
    pending = PendingExchange([(t, 3)], [(t, 3)], None, _describe)
    with pytest.raises(PeerError, match="outer step 4: failed completing a batch of sends to rank 3 .* and "):
        pending.wait(5.0, "outer step 4")


class _OpWork:
    def __init__(self, op):
        self.op, self.waited = op, 0

    def wait(self, timeout):
        self.waited += 1
        return True


@pytest.mark.parametrize("receives_first", [False, True])
def test_each_work_is_matched_to_its_own_operation_in_either_posting_order(monkeypatch, receives_first):
    """gloo returns one Work per operation, in the order posted: receives first (the outer sync) or sends
    first (the pipeline) must name and wait for the right ones."""
    posted = []

    def batch(ops):
        posted.extend(ops)
        return [_OpWork(op) for op in ops]

    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None: (op, tensor, peer, group))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    received, sent = post([(a, 1), (b, 3)], [(c, 2)], _describe, "group", receives_first)
    kinds = [op[0] for op in posted]
    assert kinds == (
        [dist.irecv, dist.isend, dist.isend] if receives_first else [dist.isend] * 2 + [dist.irecv]
    )
    assert all(op[3] == "group" for op in posted)
    assert [(w.op[0], w.op[1] is c, what) for w, what in received] == [
        (dist.irecv, True, f"receiving from {_describe(2)}")
    ]
    assert [(w.op[0], w.op[2], what) for w, what in sent] == [
        (dist.isend, 1, f"sending to {_describe(1)}"),
        (dist.isend, 3, f"sending to {_describe(3)}"),
    ]
    pending = exchange([(a, 1)], [(c, 2)], 5.0, _describe, receives_first=receives_first)
    assert [w.op[0] for w, _ in pending] == [
        dist.isend
    ]  # the receive was waited for, the send left in flight
    assert posted[-2 if receives_first else -1][0] == dist.irecv


def test_group_timeouts_leave_nccl_a_margin_after_our_own_waits():
    assert group_timeout("gloo", 300) == timedelta(seconds=300)
    assert group_timeout("nccl", 300) == timedelta(seconds=300 + NCCL_WATCHDOG_MARGIN)
    assert NCCL_WATCHDOG_MARGIN >= 10  # the lost-peer diagnosis needs a few seconds


def test_the_config_asks_nccl_to_raise_instead_of_killing_the_process(monkeypatch, tmp_path):
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    assert {name: "2"} == NCCL_ENVIRONMENT  # 2: abort the communicator and raise in the waiting rank
    monkeypatch.delenv(name, raising=False)
    NoLoCoConfig(output_dir=str(tmp_path), report_to="none", outer_optimizer="local")
    import os

    assert os.environ[name] == "2"
    monkeypatch.setenv(name, "3")  # a user's own choice stays
    NoLoCoConfig(output_dir=str(tmp_path), report_to="none", outer_optimizer="local")
    assert os.environ[name] == "3"
