"""The NCCL hot path in one process, with a fake NCCL work object: waits in the pipeline's and the outer
exchange's paths are stream waits (``wait()`` with no timeout, which blocks a CUDA stream, not the host), and
the heartbeat watcher still names a silent peer; gloo's waits stay bounded host waits."""

import ast
import os
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
