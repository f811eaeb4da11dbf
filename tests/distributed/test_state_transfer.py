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
