"""The pipeline engine on real gloo processes, against the unsplit model computed in this process."""

import itertools
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hf_noloco.engine.comm import PeerError
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.partition import split_model
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.routing import Router
from hf_noloco.engine.schedule import held_limit, pipeline_order
from hf_noloco.launch.local_launch import run_distributed
from hf_noloco.rules import PIPELINE_SCHEDULES as SCHEDULES
from tests.helpers.reference import origin
from tests.helpers.tiny_models import make_batch, shard, tiny_model

ROWS_PER_REPLICA, SEQ, MICRO, START = 6, 10, 2, 8


def _run_engine(pp, layers, boundaries, routings, strict=False, wire_dtype=None):
    """Each rank: identical model weights, its column's shard of one global batch, one train step per
    (routing, schedule). Returns the loss, the gradients and the sample ids seen, per routing and schedule.
    ``strict``: every posted batch is waited for before the next (NCCL's stream order: comm.strict_p2p)."""
    if strict:
        os.environ["HF_NOLOCO_STRICT_P2P"] = "1"
    mesh = PipelineMesh.build(pp)
    model = tiny_model("llama", layers, seed=5)
    stage = split_model(model, mesh.stage, pp, boundaries)
    batch = shard(
        make_batch(ROWS_PER_REPLICA * mesh.num_replicas, SEQ, seed=6), mesh.replica, mesh.num_replicas
    )
    out = {}
    for routing in routings:
        for schedule in SCHEDULES:
            stage.zero_grad(set_to_none=True)
            engine = PipelineEngine(
                stage,
                mesh,
                Router(mesh.num_replicas, routing, seed=11),
                MICRO,
                p2p_timeout=30,
                schedule=schedule,
                wire_dtype=wire_dtype,
            )
            engine.samples_seen, engine.step_index = START, 3
            result = engine.train_step(batch)
            peak = engine.peak_microbatches_held
            evaluated = engine.eval_step(batch)
            out[routing, schedule] = dict(
                loss=None if result.loss is None else result.loss.item(),
                grads={n: p.grad.clone() for n, p in stage.named_parameters()},
                sample_ids=result.sample_ids,
                samples_seen=engine.samples_seen,
                evaluated=evaluated,
                peak=peak,
            )
    return mesh.stage, mesh.replica, out


def _reference(layers, num_replicas):
    """Data parallel's numbers on the unsplit model: per-shard mean loss and gradient, averaged."""
    model = tiny_model("llama", layers, seed=5)
    full = make_batch(ROWS_PER_REPLICA * num_replicas, SEQ, seed=6)
    losses, grads, sums = [], [], []
    for r in range(num_replicas):
        model.zero_grad()
        b = shard(full, r, num_replicas)
        loss = model(**b).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        tokens = int((b["labels"][:, 1:] != -100).sum())
        sums.append((loss.item() * tokens, tokens))
    mean_grads = {n: sum(g[n] for g in grads) / num_replicas for n in grads[0]}
    return losses, grads, mean_grads, sums


@pytest.mark.parametrize("strict", [False, True], ids=["", "strict"])
@pytest.mark.parametrize(
    "pp, dp, layers, boundaries, routings",
    [
        (2, 1, 4, None, ["fixed", "sample"]),
        (2, 2, 4, None, ["fixed", "sample", "step"]),
        (3, 2, 5, [1, 4], ["fixed", "sample", "step"]),  # uneven 1/3/1
    ],
)
def test_routing_does_not_change_the_mathematics(pp, dp, layers, boundaries, routings, strict):
    results = run_distributed(_run_engine, pp * dp, pp, layers, boundaries, routings, strict, timeout_s=120)
    losses, grads, mean_grads, sums = _reference(layers, dp)
    router_of = {r: Router(dp, r, seed=11) for r in routings}
    for routing, schedule in itertools.product(routings, SCHEDULES):
        by_stage = {}
        for stage, replica, out in results:
            by_stage.setdefault(stage, {})[replica] = out[routing, schedule]
        micro_steps = ROWS_PER_REPLICA // MICRO
        for stage, replicas in by_stage.items():  # 1F1B bounds the activations a stage holds
            expected_peak = held_limit(schedule, micro_steps, pp, stage)
            assert all(replicas[r]["peak"] == expected_peak for r in range(dp))
        last = by_stage[pp - 1]
        # The loss: a replica's loss is a sum of per-shard mean losses, so the replicas' mean is DDP's.
        mean_loss = sum(last[r]["loss"] for r in range(dp)) / dp
        assert mean_loss == pytest.approx(sum(losses) / dp, rel=1e-5)
        for stage, replicas in by_stage.items():
            for name in replicas[0]["grads"]:
                got = sum(replicas[r]["grads"][name] for r in range(dp)) / dp
                torch.testing.assert_close(
                    got, mean_grads[name], rtol=1e-4, atol=1e-6, msg=f"{routing} {name}"
                )
            if routing == "fixed":  # one column is one model: exact per replica, not only on average
                for r in range(dp):
                    assert replicas[r]["samples_seen"] == START + ROWS_PER_REPLICA
                    for name, g in replicas[r]["grads"].items():
                        torch.testing.assert_close(g, grads[r][name], rtol=1e-4, atol=1e-6)
            # Integrity: every sample is processed exactly once per stage, where the router says.
            for m in range(ROWS_PER_REPLICA // MICRO):
                seen = sorted(i for r in range(dp) for i in replicas[r]["sample_ids"][m])
                expected_ids = sorted(
                    (START + m * MICRO + j) * dp + r for r in range(dp) for j in range(MICRO)
                )
                assert seen == expected_ids
                for r in range(dp):
                    for j, sample_id in enumerate(replicas[r]["sample_ids"][m]):
                        slot = START + m * MICRO + j
                        assert sample_id == slot * dp + origin(router_of[routing], stage, 3, slot, r)
        # Evaluation: fixed routing, every rank of column r returns column r's summed loss and tokens.
        for replicas in by_stage.values():
            for r in range(dp):
                loss_sum, tokens = replicas[r]["evaluated"]
                assert tokens == sums[r][1]
                assert loss_sum == pytest.approx(sums[r][0], rel=1e-5)


def test_a_bf16_wire_keeps_the_gradients_to_bf16_tolerance():
    """Under bf16 mixed precision activations and gradients travel as bfloat16: the gradients then differ from
    the float32 wire's by bfloat16 rounding at each boundary, not more."""
    exact = run_distributed(_run_engine, 4, 2, 4, None, ["sample"], False, None, timeout_s=120)
    rounded = run_distributed(_run_engine, 4, 2, 4, None, ["sample"], False, torch.bfloat16, timeout_s=120)
    for (stage, replica, a), (_, _, b) in zip(exact, rounded):
        for key in a:
            for name, grad in a[key]["grads"].items():
                other = b[key]["grads"][name]
                error = (other - grad).norm() / grad.norm()
                assert error < 2e-2, (stage, replica, key, name, error)
            if stage == 1:
                assert b[key]["loss"] == pytest.approx(a[key]["loss"], rel=1e-2)
    differs = [
        not torch.equal(b[k]["grads"][n], a[k]["grads"][n])
        for (_, _, a), (_, _, b) in zip(exact, rounded)
        for k in a
        for n in a[k]["grads"]
    ]
    assert any(differs)  # the rounding really happened on the wire


def _silent_peer(p2p_timeout):
    mesh = PipelineMesh.build(2)
    stage = split_model(tiny_model("llama", 2), mesh.stage, 2)
    engine = PipelineEngine(stage, mesh, Router(1, "fixed"), 2, p2p_timeout=p2p_timeout)
    store = dist.distributed_c10d._get_default_store()
    if mesh.stage == 0:  # never sends; alive (its sockets open) until the other has given up
        store.wait(["named"], timedelta(seconds=120))
        return "silent"
    start = time.monotonic()
    try:
        engine.train_step(make_batch(2, 8, seed=0))
    except PeerError as exc:
        return str(exc), time.monotonic() - start
    finally:
        store.set("named", "1")
    return "no error"


def test_a_silent_peer_is_named_not_waited_for_forever():
    silent, (message, waited) = run_distributed(_silent_peer, 2, 2.0, timeout_s=30)
    assert silent == "silent"
    assert "stage 1 replica 0" in message and "rank 0 (stage 0, replica 0)" in message
    assert "p2p_timeout=2s" in message
    assert 1.9 <= waited < 60  # ended by the 2 s timeout (the silent peer never closed its sockets)


def _bad_batches():
    mesh = PipelineMesh.build(1)
    stage = split_model(tiny_model("llama", 2), 0, 1)
    engine = PipelineEngine(stage, mesh, Router(1, "fixed"), 4)
    errors = []
    for batch in (
        make_batch(6, 8, seed=0),
        {**make_batch(4, 8, seed=0), "labels": torch.zeros(4, 7, dtype=torch.long)},
    ):
        try:
            engine.train_step(batch)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_bad_batches_are_refused_with_clear_errors():
    [errors] = run_distributed(_bad_batches, 1)
    assert "not a multiple of microbatch_size=4" in errors[0]
    assert "`labels` has shape (4, 7)" in errors[1]


@pytest.mark.parametrize("num_micro, num_stages", [(1, 1), (4, 2), (3, 4), (8, 3)])
def test_pipeline_orders_run_each_microbatch_forward_then_backward_once(num_micro, num_stages):
    for schedule in SCHEDULES:
        for stage in range(num_stages):
            order = pipeline_order(schedule, num_micro, num_stages, stage)
            weights = [m for op, m in order if op == "W"]  # zb-h1: each backward's weight gradient, later
            assert weights == ([] if schedule != "zb-h1" or stage == 0 else list(range(num_micro)))
            assert all(order.index(("B", m)) < order.index(("W", m)) for m in weights)
            order = [(op, m) for op, m in order if op != "W"]
            assert sorted(order) == sorted(
                [("F", m) for m in range(num_micro)] + [("B", m) for m in range(num_micro)]
            )
            assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(num_micro))
            backwards = [m for op, m in order if op == "B"]
            assert backwards == sorted(backwards)  # both ends of a link see gradients in the same order
            if schedule != "zb-h1":  # its peak, with the Ws, is test_schedule.py's
                held = peak = 0
                for op, _ in order:
                    held += 1 if op == "F" else -1
                    peak = max(peak, held)
                assert peak == held_limit(schedule, num_micro, num_stages, stage)
    with pytest.raises(ValueError, match="pipeline_schedule must be one of 1f1b, gpipe, zb-h1, got 'zb'"):
        pipeline_order("zb", 2, 2, 0)
