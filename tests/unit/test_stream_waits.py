"""The NCCL hot path in one process, with a fake NCCL work object: waits in the pipeline's and the outer
exchange's paths are stream waits (``wait()`` with no timeout, which blocks a CUDA stream, not the host), and
the heartbeat watcher still names a silent peer; gloo's waits stay bounded host waits, in an NCCL run too
(each operation's wait is chosen by its own group's backend), and the heartbeat has a store client of its
own."""

import ast
import contextlib
import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hf_noloco.engine import comm
from hf_noloco.resilience.watch import PeerWatch
from tests.helpers.paths import ROOT


class FakeWork:
    """What NCCL's Work offers: ``wait()`` blocks the current stream; ``wait(timeout=...)`` blocks the host
    until the operation is done, the call a hot path must never make."""

    def __init__(self):
        self.calls = []

    def wait(self, timeout=None):
        self.calls.append(timeout)
        return True


@pytest.fixture
def nccl(monkeypatch):
    monkeypatch.setattr(comm, "_stream_waits", False)
    comm.use_stream_waits(True)
    works = []

    def batch_isend_irecv(ops):
        works.extend(FakeWork() for _ in ops)
        return works[-len(ops) :]

    monkeypatch.setattr(comm.dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(comm.dist, "P2POp", lambda op, tensor, peer, group: (op, tensor, peer))
    yield works
    comm.use_stream_waits(False)


def test_the_pipelines_and_outer_exchanges_waits_are_stream_waits(nccl):
    x, y = torch.zeros(4), torch.zeros(4)
    pending = comm.exchange([(x, 1)], [(y, 1)], timeout=30.0)  # the pipeline's posting and waiting
    comm.wait_sends(pending, 30.0)
    exchange = comm.PendingExchange([(x, 1)], [(y, 1)], group=None)  # the overlapped outer exchange
    exchange.wait(30.0)
    collective = FakeWork()
    comm.wait_collective(collective, 30.0, "an all-reduce")  # diloco, ddp, the column statistics
    assert nccl and all(work.calls == [None] for work in [*nccl, collective])


def test_gloo_keeps_bounded_host_waits():
    work = FakeWork()
    comm.wait_collective(work, 7.0, "an all-reduce")
    assert work.calls == [timedelta(seconds=7.0)]


def test_the_hot_paths_never_wait_themselves():
    """Every wait of the pipeline and the outer optimizer goes through comm (which picks the kind of wait)."""
    for module in ("engine/pipeline.py", "outer/optimizer.py", "engine/tied.py"):
        with open(os.path.join(ROOT, "hf_noloco", module)) as f:
            tree = ast.parse(f.read())
        calls = [
            n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "wait"
        ]
        waits = [ast.unparse(c.func.value) for c in calls]
        assert all(w in ("flight.exchange", "exchange") for w in waits), (module, waits)


def test_the_watcher_names_a_peer_whose_heartbeat_stops():
    port = comm.free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    mine = PeerWatch(0, 2, interval=0.05, store=server)
    peer = PeerWatch(1, 2, interval=0.05, store=client)
    lost = []
    mine.watch_peers(silence=0.5, on_lost=lost.append)
    time.sleep(0.3)
    mine.raise_if_lost(lambda r: f"rank {r}")  # alive: nothing to raise
    peer.close()  # its heartbeat stops, as a killed or frozen rank's
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == [[1]]
    with pytest.raises(comm.PeerError, match="Peers that stopped responding: rank 1"):
        mine.raise_if_lost(lambda r: f"rank {r}")
    mine.close()


def test_each_wait_is_chosen_by_its_own_groups_backend(nccl, monkeypatch):
    """An NCCL run (stream waits on) that also posts on a gloo group (the SIGTERM flags): the NCCL
    operations are stream waits, the gloo one a host wait bounded by the deadline."""
    monkeypatch.setattr(comm, "_backend_name", lambda group, device: "gloo" if group == "flags" else "nccl")
    works = []

    def all_reduce(tensor, async_op, group=None, op=None):
        works.append(FakeWork())
        return works[-1]

    x, y = torch.zeros(4), torch.zeros(4)
    comm.wait_sends(comm.exchange([(x, 1)], [(y, 1)], 30.0, group="world"), 30.0)
    flags = comm.post_collective(all_reduce, x, group="flags", what="the SIGTERM flags")
    loss = comm.post_collective(all_reduce, x, group="column", what="the column's loss")
    comm.wait_collective(flags, 7.0, "the SIGTERM flags")
    comm.wait_collective(loss, 7.0, "the column's loss")
    comm.PendingExchange([(x, 1)], [(y, 1)], group="flags").wait(5.0)
    assert [w.calls for w in works] == [[timedelta(seconds=7.0)], [None]]
    assert [w.calls for w in nccl] == [[None], [None], [timedelta(seconds=5.0)], [timedelta(seconds=5.0)]]


class _ClosedWork(FakeWork):
    def wait(self, timeout=None):
        super().wait(timeout)
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:34723")


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_closed_connection_is_a_lost_peer_whatever_the_kind_of_wait(nccl, monkeypatch, backend):
    monkeypatch.setattr(comm, "_backend_name", lambda group, device: backend)
    work = comm.post_collective(lambda t, async_op, group: _ClosedWork(), torch.zeros(1), group="g", what="x")
    with pytest.raises(comm.PeerError, match="the SIGTERM flags: failed to complete .*Connection closed"):
        comm.wait_collective(work, 7.0, "the SIGTERM flags")
    assert work.calls == [timedelta(seconds=7.0) if backend == "gloo" else None]


def test_the_sigterm_flags_of_an_nccl_run_are_waited_for_on_the_host_with_a_bound(nccl, monkeypatch):
    """resilience/preemption.py: its flag group is gloo (a device flag would wait for the GPU)."""
    from types import SimpleNamespace

    from hf_noloco.resilience import preemption

    monkeypatch.setattr(preemption.dist, "new_group", lambda backend: f"{backend} flag group")
    # raising=False: the same test runs against a comm without per-operation waits, and fails there
    monkeypatch.setattr(
        comm, "_backend_name", lambda group, device: "gloo" if "gloo" in str(group) else "nccl", raising=False
    )
    works = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        works.append(FakeWork())
        return works[-1]

    monkeypatch.setattr(preemption.dist, "all_reduce", all_reduce)
    mesh = SimpleNamespace(
        backend="nccl", world_size=2, timeout=9.0, world_group=None, describe=lambda: "rank 0"
    )
    policy = SimpleNamespace(offline=False, view=0, tolerate=lambda what, work, fallback, step: work())
    flags = preemption.Preemption(mesh, policy)
    flags.begin_step(1)
    assert not flags._agreed(1)  # no signal anywhere
    assert [w.calls for w in works] == [[timedelta(seconds=9.0)]]


def test_the_heartbeat_keeps_beating_while_the_process_groups_store_client_is_held(monkeypatch):
    """Making a group, NCCL's lazy communicator set-up and the store-based barrier hold the process group's
    store client for seconds (a client runs one operation at a time): the heartbeat has a client of its own,
    so a watcher with a shorter silence limit does not take this rank for lost."""
    from types import SimpleNamespace

    from hf_noloco.resilience.policy import replica_loss_policy

    port = comm.free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    shared = dist.TCPStore("127.0.0.1", port, is_master=False)  # the process group's client
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: shared)
    mesh = SimpleNamespace(rank=1, world_size=2, device=torch.device("cpu"))
    policy = replica_loss_policy("stop", mesh, p2p_timeout=1.5, on_change=None)
    watcher = PeerWatch(0, 2, interval=0.05, store=server, beating=False)
    lost = []
    watcher.watch_peers(silence=1.5, on_lost=lost.append)
    time.sleep(0.7)  # both started: the watcher has seen a beat

    def hold():  # what a store-based barrier does to the shared client
        with contextlib.suppress(Exception):
            shared.wait(["hf_noloco/test/never"], timedelta(seconds=3.5))

    holder = threading.Thread(target=hold)
    holder.start()
    holder.join()
    assert lost == []
    assert policy.watch.store is not shared
    policy.close()
    watcher.close()
