"""A rank's whole state sent point to point (:mod:`hf_noloco.resilience.transfer`), as a joining column
receives it from its donor: two gloo ranks, buckets smaller than the state."""

import torch

from hf_noloco.launch.local_launch import run_distributed


def _send_and_receive():
    from hf_noloco.engine.mesh import PipelineMesh
    from hf_noloco.resilience.transfer import recv_state, send_state

    mesh = PipelineMesh.build(1)
    state = {"w": torch.randn(1000), "h": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "k": [1, "x"]}
    if mesh.rank == 0:
        return state, send_state(state, 1, None, mesh.device, 30.0, bucket_bytes=1024)
    return recv_state(0, None, mesh.device, 30.0, bucket_bytes=1024)


def test_a_state_sent_point_to_point_in_buckets_arrives_bit_for_bit():
    (sent, sent_bytes), (received, received_bytes) = run_distributed(_send_and_receive, 2)
    assert sent_bytes == received_bytes > 4000 + 24
    assert received["k"] == [1, "x"] and received["h"].dtype == torch.bfloat16
    assert torch.equal(received["w"], sent["w"]) and torch.equal(received["h"], sent["h"])


def _lying_sender_and_json_collectives():
    """Rank 0 announces a structure larger than any state may have: rank 1 refuses it before allocating (the
    bound on the tensors is tests/unit/test_no_pickle.py's). Then the JSON collectives, both directions, and a
    JSON message whose announced length is refused."""
    import torch.distributed as dist

    from hf_noloco.engine.structured import (
        PeerDataError,
        all_gather_json,
        broadcast_json,
        recv_json,
        send_json,
    )
    from hf_noloco.resilience.transfer import MAX_STRUCTURE_BYTES, recv_state

    rank, outcome = dist.get_rank(), {}
    if rank == 0:
        dist.send(torch.tensor([MAX_STRUCTURE_BYTES + 1], dtype=torch.int64), dst=1)
    else:
        try:
            recv_state(0, None, torch.device("cpu"), 30.0, max_bytes=1000)
            outcome["refused"] = None
        except PeerDataError as exc:
            outcome["refused"] = str(exc)
    outcome["gathered"] = all_gather_json({"rank": rank, "verdict": None if rank else "damaged"})
    outcome["broadcast"] = broadcast_json(["out/checkpoint-4"] if rank == 1 else None, src=1)
    if rank == 0:
        send_json([["model.embed_tokens.weight", [4, 2], "float32"]], 1)
    else:
        outcome["received"] = recv_json(0)
        dist.send(torch.tensor([1 << 40], dtype=torch.int64), dst=0)
    if rank == 0:
        try:
            recv_json(1)
        except PeerDataError as exc:
            outcome["oversized"] = str(exc)
    return outcome


def test_a_receiver_refuses_what_it_did_not_bound_and_json_values_travel():
    sender, receiver = run_distributed(_lying_sender_and_json_collectives, 2)
    assert f"a structure of {64 * 2**20 + 1} bytes" in receiver["refused"]
    expected = [{"rank": 0, "verdict": "damaged"}, {"rank": 1, "verdict": None}]
    assert sender["gathered"] == receiver["gathered"] == expected
    assert sender["broadcast"] == receiver["broadcast"] == ["out/checkpoint-4"]
    assert receiver["received"] == [["model.embed_tokens.weight", [4, 2], "float32"]]
    assert "announced 1099511627776 bytes" in sender["oversized"]
