"""A lost peer's communicators aborted mid-run (what the heartbeat watcher does on NCCL), on real gloo
processes: every group stays registered, and every communication call afterwards (point-to-point batches,
collectives, object collectives, a wait for a receive posted before the loss) raises the one lost-peer error,
naming the rank that went silent, whatever torch itself would raise."""

import time

import torch
import torch.distributed as dist

from hf_noloco.engine import comm
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.launch.local_launch import run_distributed
from hf_noloco.resilience.policy import replica_loss_policy

LOST = "rank 1 (stage 1, replica 0)"


def _abort_mid_run():
    mesh = PipelineMesh.build(2)
    store = dist.distributed_c10d._get_default_store()
    # As a GPU rank builds it: the policy watches the heartbeats and aborts the mesh on a silent peer.
    device, mesh.device = mesh.device, torch.device("cuda")
    policy = replica_loss_policy("stop", mesh, p2p_timeout=1.0, on_change=None)
    mesh.device = device
    t = torch.full((4,), float(mesh.rank))
    received = torch.zeros(4)
    peer = 1 - mesh.rank
    comm.wait_sends(comm.exchange([(t, peer)], [(received, peer)], 30.0), 30.0)  # training, mid-run
    if mesh.rank == 1:
        policy.close()  # silent from here on (frozen, cut off), but alive: its connections stay open
        store.wait(["test/done"])
        return None
    early, _ = comm.post([], [(torch.zeros(4), 1)])  # a receive posted before the loss, never matched
    deadline = time.monotonic() + 30
    while not policy.watch.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    registered = set(dist.distributed_c10d._world.pg_map)
    calls = {
        "exchange": lambda: comm.exchange([(t, 1)], [(received, 1)], 30.0, mesh.describe_rank, "step 2"),
        "post": lambda: comm.post([(t, 1)], []),
        "pending exchange": lambda: comm.PendingExchange([(t, 1)], [(received, 1)], None),
        "wait for an earlier receive": lambda: comm.wait_sends(early, 30.0, "step 2"),
        "all-reduce": lambda: comm.collective(
            dist.all_reduce, t, group=mesh.column_group, timeout=30.0, what="the column's loss"
        ),
        "live sum": lambda: policy.live_sum(t, "the logged loss", 2),
        "object broadcast": lambda: _object_broadcast(),
        "step begin": lambda: policy.begin_step(),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - what each call raised is the result
            errors[name] = (type(exc).__name__, comm.is_lost_peer(exc), str(exc))
    groups_kept = {mesh.replica_group, mesh.column_group, dist.group.WORLD} <= registered
    store.set("test/done", "1")
    policy.close()
    return dict(
        lost=policy.watch.lost,
        initialized=dist.is_initialized(),
        world_size=dist.get_world_size(),
        groups_kept=groups_kept,
        errors=errors,
    )


def _object_broadcast():
    with comm.peer_call("the export's verdict"):
        dist.broadcast_object_list(["verdict"], src=0)


def test_after_an_abort_every_call_names_the_lost_rank_and_the_groups_stay_registered():
    result, _ = run_distributed(_abort_mid_run, 2, timeout_s=60)
    assert result["lost"] == [1]
    assert result["initialized"] and result["world_size"] == 2 and result["groups_kept"]
    for name, error in result["errors"].items():
        assert error is not None, f"{name} did not raise"
        kind, lost_peer, message = error
        assert kind == "PeerError" and lost_peer, (name, error)
        assert f"Peers that stopped responding: {LOST}" in message, (name, message)
