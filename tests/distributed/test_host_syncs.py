"""No host sync per microbatch in the pipeline's steady state (1F1B and ZB-H1, sample routing across
replicas), counted on real gloo processes made to look like NCCL (tests/helpers/host_syncs.py: every call
that would block the host on a GPU, per call site): a step of 8 microbatches makes no more of them than a
step of 4, and the NCCL path (stream waits) is the one taken."""

import pytest
import torch

from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.partition import split_model
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.routing import Router
from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.host_syncs import HostSyncs, nccl_like
from tests.helpers.tiny_models import make_batch, shard, tiny_model

SEQ, MICRO = 8, 2


def _count_syncs(schedule: str, boundary: dict | None = None):
    mesh = PipelineMesh.build(2)
    stage = split_model(tiny_model("llama", 2, seed=5), mesh.stage, 2)
    engine = PipelineEngine(
        stage,
        mesh,
        Router(mesh.num_replicas, "sample", seed=11),
        MICRO,
        p2p_timeout=30,
        schedule=schedule,
        **(boundary or {}),
    )
    syncs, per_step = HostSyncs(), []
    with nccl_like(syncs) as waits:
        for step, micro_count in enumerate((4, 4, 8)):  # a warm-up step, then 4 and 8 microbatches
            rows = micro_count * MICRO
            batch = shard(
                make_batch(rows * mesh.num_replicas, SEQ, seed=step), mesh.replica, mesh.num_replicas
            )
            batch.pop("attention_mask")  # wrapped rows, the pretraining layout: nothing for HF's mask code
            syncs.counts.clear()
            syncs.on_host(batch.values())  # a loader's batch, in host memory
            with syncs:
                engine.train_step(batch)
            per_step.append(syncs.by_site())
        with syncs:
            syncs.counts.clear()
            torch.ones(1, device=next(stage.parameters()).device).item()  # the double sees a sync
            seen = syncs.total()
    stage.zero_grad()
    return dict(rank=mesh.rank, steps=per_step, stream_waits=waits["stream waits"], seen=seen)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_no_host_sync_per_microbatch_in_the_steady_state(schedule):
    for result in run_distributed(_count_syncs, 4, schedule, timeout_s=120):
        warmup, four, eight = result["steps"]
        assert result["seen"] == 1 and result["stream_waits"] > 0, result
        assert eight == four == {}, (result["rank"], schedule, four, eight)


@pytest.mark.parametrize(
    "boundary",
    [
        dict(boundary_dtype="int4", boundary_grad_dtype="int8", boundary_grad_stochastic_rounding=True),
        dict(boundary_dtype="float8_e4m3", boundary_grad_dtype="float8_e5m2", boundary_block_size=8),
    ],
    ids=["int4-int8-stochastic", "fp8-blocks"],
)
def test_boundary_encoding_adds_no_host_sync(boundary):
    """Encoding before each send and decoding where a packet is used are tensor operations only."""
    for result in run_distributed(_count_syncs, 4, "1f1b", boundary, timeout_s=120):
        warmup, four, eight = result["steps"]
        assert result["seen"] == 1 and result["stream_waits"] > 0, result
        assert eight == four == {}, (result["rank"], boundary, four, eight)


def _outer_step_syncs(method: str, outer_dtype: str):
    """Host syncs of one outer step (after a warm-up one), for a stage cut into 2 and into 8 buckets."""
    from hf_noloco.outer.optimizer import OuterOptimizer
    from hf_noloco.outer.settings import OuterSettings

    mesh = PipelineMesh.build(1)
    counts = {}
    for buckets in (2, 8):
        torch.manual_seed(mesh.rank)
        params = [torch.nn.Parameter(torch.randn(1024)) for _ in range(8)]
        settings = OuterSettings(method, inner_steps=1, outer_dtype=outer_dtype)
        outer = OuterOptimizer(
            torch.optim.SGD(params, lr=0.1),
            params,
            mesh,
            settings,
            p2p_timeout=30,
            bucket_mb=8 * 4096 / buckets / 2**20,
        )
        syncs = HostSyncs()
        with nccl_like(syncs):
            for _step in range(2):
                for p in params:
                    p.grad = torch.ones_like(p)
                syncs.counts.clear()
                with syncs:
                    outer.step()
        assert len(outer.outer_state.buckets) == buckets
        counts[buckets] = syncs.by_site()
    return counts


@pytest.mark.parametrize(
    "method, outer_dtype", [("noloco", "float32"), ("noloco", "int8"), ("diloco", "float32")]
)
def test_no_host_sync_per_bucket_in_an_outer_step(method, outer_dtype):
    for counts in run_distributed(_outer_step_syncs, 2, method, outer_dtype, timeout_s=120):
        assert counts[8] == counts[2], counts
