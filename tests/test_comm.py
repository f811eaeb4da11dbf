"""Bounded waits and batches of messages, as NCCL returns them (one Work per batch), and the NCCL settings."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hf_noloco.comm import NCCL_WATCHDOG_MARGIN, PeerError, exchange, group_timeout, wait_sends
from hf_noloco.config import NCCL_ENVIRONMENT, NoLoCoConfig


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
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer: (op, tensor, peer))
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
