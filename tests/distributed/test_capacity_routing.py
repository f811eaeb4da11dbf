"""Capacity routing on real gloo processes: unequal rows per replica keep the mathematics of the step (every
sample once, with its token weight), and equal speeds are today's routing bit for bit."""

import os

import pytest
import torch

from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.partition import split_model
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.routing import Router
from hf_noloco.launch.local_launch import run_distributed
from hf_noloco.rules import PIPELINE_SCHEDULES as SCHEDULES
from tests.helpers.tiny_models import make_batch, shard, tiny_model

ROWS_PER_REPLICA, SEQ, MICRO, START, LAYERS = 6, 10, 2, 8, 4
UNEQUAL = {2: [[1.0, 0.4], [0.5, 1.0]], 3: [[1.0, 0.4], [0.5, 1.0], [1.0, 1.0]]}


def _run(pp, strict):
    if strict:
        os.environ["HF_NOLOCO_STRICT_P2P"] = "1"
    mesh = PipelineMesh.build(pp)
    dp = mesh.num_replicas
    stage = split_model(tiny_model("llama", LAYERS, seed=5), mesh.stage, pp, None)
    batch = shard(make_batch(ROWS_PER_REPLICA * dp, SEQ, seed=6), mesh.replica, dp)
    out = {}
    for speeds in ("none", "equal", "unequal"):
        for schedule in SCHEDULES:
            stage.zero_grad(set_to_none=True)
            engine = PipelineEngine(stage, mesh, Router(dp, "sample", seed=11), MICRO, 30, schedule=schedule)
            engine.samples_seen, engine.step_index = START, 3
            if speeds != "none":
                engine.route_by_capacity([[1.0] * dp] * pp if speeds == "equal" else UNEQUAL[pp], floor=0.1)
            rows = engine.capacity_rows(ROWS_PER_REPLICA // MICRO)
            result = engine.train_step(batch)
            out[speeds, schedule] = dict(
                loss=None if result.loss is None else result.loss.item(),
                grads={n: p.grad.clone() for n, p in stage.named_parameters()},
                sample_ids=result.sample_ids,
                rows=rows,
            )
    return mesh.stage, mesh.replica, out


def _reference(dp):
    """Data parallel on the unsplit model: the sum over shards of each shard's mean loss, and its gradient."""
    model = tiny_model("llama", LAYERS, seed=5)
    full = make_batch(ROWS_PER_REPLICA * dp, SEQ, seed=6)
    total = 0.0
    for r in range(dp):
        loss = model(**shard(full, r, dp)).loss
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("pp,strict", [(2, False), (2, True), (3, False)], ids=["pp2", "pp2-strict", "pp3"])
def test_unequal_rows_keep_every_sample_once_and_equal_speeds_route_as_today(pp, strict):
    dp = 2
    results = run_distributed(_run, pp * dp, pp, strict, timeout_s=120)
    total, summed_grads = _reference(dp)
    by = {(s, r): out for s, r, out in results}
    for schedule in SCHEDULES:
        for s in range(pp):
            for r in range(dp):
                today, equal = by[s, r]["none", schedule], by[s, r]["equal", schedule]
                assert equal["loss"] == today["loss"] and equal["sample_ids"] == today["sample_ids"]
                for name, g in today["grads"].items():
                    assert torch.equal(equal["grads"][name], g), name  # bit for bit
        unequal = {key: out["unequal", schedule] for key, out in by.items()}
        rows = unequal[0, 0]["rows"]
        assert any(c != MICRO for wave in rows[0] for c in wave)  # the rows really are unequal
        # the replicas' losses and gradients sum to data parallel's, however the samples were routed
        assert sum(unequal[pp - 1, r]["loss"] for r in range(dp)) == pytest.approx(total, rel=1e-5)
        for s in range(pp):
            for name in unequal[s, 0]["grads"]:
                got = sum(unequal[s, r]["grads"][name] for r in range(dp))
                torch.testing.assert_close(got, summed_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            for m in range(ROWS_PER_REPLICA // MICRO):  # every sample once per stage, with the drawn rows
                for r in range(dp):
                    assert len(unequal[s, r]["sample_ids"][m]) == rows[s][m][r]
                seen = sorted(i for r in range(dp) for i in unequal[s, r]["sample_ids"][m])
                assert seen == sorted(
                    (START + m * MICRO + j) * dp + r for r in range(dp) for j in range(MICRO)
                )


def _balance(floor):
    from hf_noloco.components.capacity_balance import CapacityBalance

    mesh = PipelineMesh.build(2)
    stage = split_model(tiny_model("llama", LAYERS, seed=5), mesh.stage, 2, None)
    engine = PipelineEngine(stage, mesh, Router(mesh.num_replicas, "sample", seed=11), MICRO, 30)
    balance = CapacityBalance(mesh, engine, rebalance_steps=2, floor=floor, timeout=30)
    batch = shard(make_batch(ROWS_PER_REPLICA * mesh.num_replicas, SEQ, seed=6), mesh.replica, 2)
    seen = []
    for step in (1, 2):
        engine.train_step(batch)
        # every rank's measured speed, replaced by a known one: rank k computes (k + 1) rows per second
        engine.rows_computed = 0  # (the step's own measurement is not recorded)
        balance.estimate.per_sample_seconds = 1.0 / (mesh.rank + 1)
        balance.after_step(step)
        seen.append(None if engine.capacity is None else engine.capacity[0])
    return mesh.rank, seen, balance.log_entries(), engine.capacity_rows(ROWS_PER_REPLICA // MICRO)


def test_the_rebalance_gives_every_rank_the_same_speeds_every_rebalance_steps():
    results = run_distributed(_balance, 4, 0.3, timeout_s=120)
    speeds = [[1.0, 3.0], [2.0, 4.0]]  # [stage][replica] from rank = replica * 2 + stage
    for _, seen, entries, rows in results:
        assert seen == [None, speeds]  # nothing before the second step, then every rank's speed
        assert entries["capacity_speed_ratio"] == pytest.approx(4.0)
        assert entries["capacity_min_share"] == pytest.approx(0.3)  # stage 0: 1/4 raised to the floor
        assert rows == results[0][3]  # every rank derives the same rows
        # 4 rows per microbatch at shares 0.3 / 0.7 (quotas 1.2, 2.8); stage 1 at 1/3, 2/3 (1.33, 2.67)
        assert all(wave[0] in (1, 2) and sum(wave) == 4 for stage_rows in rows for wave in stage_rows)
