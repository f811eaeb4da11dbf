"""The traffic model against independent counts: the bytes the engine really posts (real gloo processes, every
isend recorded), a walk of every sample through the router's real permutations and the real gossip groups, and
published sizes."""

import functools
import math
import os

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig

from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.partition import split_model
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.routing import Router
from hf_noloco.estimate.traffic import node_of, record_bytes_per_row, stage_parameter_counts, step_traffic
from hf_noloco.launch.local_launch import run_distributed
from hf_noloco.outer.gossip import gossip_groups
from hf_noloco.outer.optimizer import OuterOptimizer
from hf_noloco.outer.settings import OuterSettings
from tests.helpers.paths import ROOT
from tests.helpers.tiny_models import make_batch, shard, tiny_config, tiny_model

LLAMA3_8B = LlamaConfig(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)


def test_published_sizes():
    counts = stage_parameter_counts(LLAMA3_8B, 4)
    assert sum(counts) == 8_030_261_248  # Llama-3-8B's parameter count
    assert counts[3] == counts[0] + 4096 and counts[1] == counts[2]  # lm_head + final norm vs embeddings
    t = step_traffic(
        LLAMA3_8B,
        seq_len=4096,
        batch_size=8,
        pipeline_stages=4,
        num_replicas=2,
        procs_per_node=4,
        routing="fixed",
        outer=OuterSettings("noloco"),
        activation_bytes=2,
        stage_params=counts,
    )
    # The arithmetic: 32 MiB per sample and boundary (plus its 96 KiB record); pp=4 columns, one per
    # node: nothing of the pipeline crosses; the outer sync sends each stage to the partner on the other node.
    middle = t.ranks[1]
    assert middle.pipeline_cross == 0
    assert middle.pipeline_intra == 8 * (2 * 4096 * 4096 * 2 + record_bytes_per_row(4096))
    assert middle.sync_cross == counts[1] * 4 and middle.sync_every == 50
    assert t.node_egress_per_step(0) == pytest.approx(sum(counts) * 4 / 50)


def _walk(config, seq_len, batch, pp, dp, ppn, routing, group, outer, stage_params, steps, hidden):
    """Bytes per rank counted sample by sample with the router's and gossip's own draws (no expectations)."""
    world = dp * pp
    cross, intra = [0.0] * world, [0.0] * world
    router = Router(dp, routing, seed=4, group_size=group)
    fwd = seq_len * hidden * 4 + record_bytes_per_row(seq_len)
    bwd = seq_len * hidden * 4
    node = lambda rank: node_of(rank, ppn)

    def send(src, dst, nbytes):
        (cross if node(src) != node(dst) else intra)[src] += nbytes

    for step in range(steps):
        for sample in range(step * batch, (step + 1) * batch):
            for b in range(pp - 1):
                perm = router.permutation(b, step, sample)
                for r in range(dp):
                    send(r * pp + b, perm[r] * pp + b + 1, fwd)
                    send(perm[r] * pp + b + 1, r * pp + b, bwd)
        if outer.outer_optimizer == "noloco" and (step + 1) % outer.inner_steps == 0:
            for s in range(pp):
                for g in gossip_groups(
                    dp, outer.gossip_group_size, outer.routing_seed, step // outer.inner_steps
                ):
                    for i in g:
                        for j in g:
                            if i != j:
                                send(i * pp + s, j * pp + s, stage_params[s] * 4)
    return [c / steps for c in cross], [i / steps for i in intra]


@pytest.mark.parametrize(
    "dp, pp, ppn, routing, group, gossip",
    [
        (8, 2, 8, "sample", None, 2),  # 2 nodes x 8 processes, global routing
        (8, 2, 8, "sample", 4, 2),  # the same with routing_domain: node
        (6, 2, 4, "step", None, 2),  # columns straddle nodes (4 processes per node, pp 2, 6 replicas)
        (5, 3, 6, "sample", None, 2),  # odd replica count: one gossip group of three
        (4, 3, 3, "fixed", None, 3),  # one column per node
    ],
)
def test_expectations_match_a_walk_through_the_real_draws(dp, pp, ppn, routing, group, gossip):
    config = tiny_config(layers=6, hidden=32)
    stage_params = stage_parameter_counts(config, pp)
    outer = OuterSettings("noloco", 1, gossip_group_size=gossip, routing_seed=9)
    steps, batch, seq_len = 400, 4, 16
    model = step_traffic(
        config,
        seq_len=seq_len,
        batch_size=batch,
        pipeline_stages=pp,
        num_replicas=dp,
        procs_per_node=ppn,
        routing=routing,
        routing_group_size=group,
        outer=outer,
        stage_params=stage_params,
    )
    cross, intra = _walk(config, seq_len, batch, pp, dp, ppn, routing, group, outer, stage_params, steps, 32)
    for r in model.ranks:
        total = r.cross_per_step + r.intra_per_step
        # totals are not random, except who joins the group of three when pairs do not divide the replicas
        assert cross[r.rank] + intra[r.rank] == pytest.approx(total, rel=1e-12 if dp % gossip == 0 else 0.05)
        if r.cross_per_step in (0, total) and dp % gossip == 0:  # nothing random about it: exact
            assert cross[r.rank] == pytest.approx(r.cross_per_step, rel=1e-12, abs=1e-9)
        else:  # 400 steps of random draws: within 12% of the expectation (many sigmas for these sizes)
            assert cross[r.rank] == pytest.approx(r.cross_per_step, rel=0.12)
    if group is not None:
        assert all(r.pipeline_cross == 0 for r in model.ranks)


def test_ring_all_reduce_and_ddp():
    config = tiny_config(layers=2, hidden=32)
    params = stage_parameter_counts(config, 1)
    t = step_traffic(
        config,
        seq_len=8,
        batch_size=2,
        pipeline_stages=1,
        num_replicas=4,
        procs_per_node=2,
        outer=OuterSettings("ddp"),
        stage_params=params,
    )
    per_rank = 2 * 3 / 4 * params[0] * 4
    # ring 0 -> 1 (same node) -> 2 (other node) -> 3 -> 0 (other node)
    assert [(r.sync_cross, r.sync_intra) for r in t.ranks] == [
        (0, per_rank),
        (per_rank, 0),
        (0, per_rank),
        (per_rank, 0),
    ]
    assert t.cross_per_rank == per_rank / 2 and all(
        r.pipeline_cross == r.pipeline_intra == 0 for r in t.ranks
    )
    diloco = step_traffic(
        config,
        seq_len=8,
        batch_size=2,
        pipeline_stages=1,
        num_replicas=4,
        procs_per_node=2,
        outer=OuterSettings("diloco", 10, outer_dtype="bfloat16"),
        stage_params=params,
    )
    assert diloco.ranks[1].sync_cross == per_rank / 2 and diloco.ranks[1].cross_per_step == per_rank / 20
    assert step_traffic(
        config, seq_len=8, batch_size=2, pipeline_stages=1, num_replicas=4, procs_per_node=2,
        outer=OuterSettings("local"), stage_params=params,
    ).cross_per_rank == 0  # fmt: skip


def test_bad_inputs():
    config = tiny_config(layers=2, hidden=32)
    with pytest.raises(ValueError, match="routing_group_size=3 does not divide the 4 replicas"):
        step_traffic(
            config, seq_len=8, batch_size=2, pipeline_stages=1, num_replicas=4, procs_per_node=2,
            routing_group_size=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match="routing must be one of"):
        step_traffic(
            config, seq_len=8, batch_size=2, pipeline_stages=1, num_replicas=4, procs_per_node=2, routing="x"
        )


# --- the engine's real messages -----------------------------------------------------------------------------

DP, PP, PPN, ROWS, MICRO, SEQ, STEPS, H = 4, 2, 4, 4, 2, 12, 4, 2


def _count_messages(group_size):
    """Trains STEPS steps of a dp4 x pp2 NoLoCo run with every isend recorded: (destination, bytes, phase)."""
    mesh = PipelineMesh.build(PP)
    model = tiny_model(layers=4, hidden=32, seed=0)
    stage = split_model(model, mesh.stage, PP)
    router = Router(DP, "sample", seed=4, group_size=group_size)
    engine = PipelineEngine(stage, mesh, router, MICRO)
    params = list(stage.parameters())
    opt = OuterOptimizer(
        torch.optim.SGD(params, lr=0.01), params, mesh, OuterSettings("noloco", H, routing_seed=9)
    )
    sent, phase = [], ["pipeline"]
    original = dist.batch_isend_irecv

    def recording(ops):
        for op in ops:
            if op.op is dist.isend:
                sent.append((op.peer, op.tensor.numel() * op.tensor.element_size(), phase[0]))
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        for step in range(STEPS):
            batch = shard(make_batch(ROWS * DP, SEQ, seed=step), mesh.replica, DP)
            engine.train_step(batch)
            phase[0] = "sync"
            opt.step()
            opt.zero_grad()
            phase[0] = "pipeline"
    finally:
        dist.batch_isend_irecv = original
    return {"rank": mesh.rank, "sent": sent, "stage_params": sum(p.numel() for p in params)}


@functools.cache
def _messages(group_size):
    return run_distributed(_count_messages, DP * PP, group_size, timeout_s=120)


@pytest.mark.parametrize("group_size", [None, 2])
def test_model_matches_the_bytes_the_engine_sends(group_size):
    results = _messages(group_size)
    stage_params = [results[s]["stage_params"] for s in range(PP)]
    config = tiny_config(layers=4, hidden=32)
    assert stage_params == stage_parameter_counts(config, PP)
    model = step_traffic(
        config,
        seq_len=SEQ,
        batch_size=ROWS,
        pipeline_stages=PP,
        num_replicas=DP,
        procs_per_node=PPN,
        routing_group_size=group_size,
        outer=OuterSettings("noloco", H, routing_seed=9),
        stage_params=stage_params,
    )
    outer = OuterSettings("noloco", H, routing_seed=9)
    walk_cross, walk_intra = _walk(
        config, SEQ, ROWS, PP, DP, PPN, "sample", group_size, outer, stage_params, STEPS, 32
    )
    for out, r in zip(results, model.ranks):
        rank = out["rank"]
        pipeline = [(dst, n) for dst, n, phase in out["sent"] if phase == "pipeline"]
        sync = [(dst, n) for dst, n, phase in out["sent"] if phase == "sync"]
        home = node_of(rank, PPN)
        crossing = lambda msgs, home=home: sum(n for dst, n in msgs if node_of(dst, PPN) != home)
        # every byte of every sample and every outer step is counted: the totals are exact
        assert sum(n for _, n in pipeline) == STEPS * (r.pipeline_cross + r.pipeline_intra)
        assert sum(n for _, n in sync) == STEPS // H * (r.sync_cross + r.sync_intra)
        # which bytes crossed: exactly what the walk through the same draws (routing and gossip) says
        assert crossing(pipeline) + crossing(sync) == pytest.approx(walk_cross[rank] * STEPS)
        assert sum(n for _, n in pipeline + sync) == pytest.approx(
            (walk_cross[rank] + walk_intra[rank]) * STEPS
        )
        if group_size is not None:
            assert crossing(pipeline) == 0  # node routing: no activation or gradient leaves its node
    # The model fed with the samples the run trained counts the router's real draws: exact, rank by rank.
    keys = [(step, k) for step in range(STEPS) for k in range(step * ROWS, (step + 1) * ROWS)]
    realized = step_traffic(
        config,
        seq_len=SEQ,
        batch_size=ROWS,
        pipeline_stages=PP,
        num_replicas=DP,
        procs_per_node=PPN,
        routing_group_size=group_size,
        outer=outer,
        stage_params=stage_params,
        routing_seed=4,
        routing_keys=keys,
    )
    for out, r in zip(results, realized.ranks):
        home = node_of(out["rank"], PPN)
        measured = sum(
            n for dst, n, phase in out["sent"] if phase == "pipeline" and node_of(dst, PPN) != home
        )
        assert measured == pytest.approx(STEPS * r.pipeline_cross, rel=1e-12, abs=1e-6)
    if group_size is None:
        assert sum(r.pipeline_cross for r in model.ranks) > 0
    assert math.isclose(
        sum(walk_cross) * STEPS,
        sum(
            n
            for out in results
            for dst, n, _ in out["sent"]
            if node_of(dst, PPN) != node_of(out["rank"], PPN)
        ),
    )


def test_readme_tables_are_the_models_output():
    from hf_noloco.estimate.traffic import LLAMA_3_8B, traffic_table

    with open(os.path.join(ROOT, "docs", "multi-node.md")) as f:
        readme = f.read()
    for procs_per_node in (8, 4):
        table = traffic_table(LLAMA_3_8B, 4096, 8, 4, 8, procs_per_node)
        assert table in readme, table
