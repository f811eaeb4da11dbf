"""Stage-boundary wire formats (``boundary_dtype``, ``boundary_grad_dtype``) in the pipeline engine, on real
gloo processes: the float formats reproduce today's wire bit for bit, a quantized format equals a
single-process simulation that rounds the boundary tensor the same way, and the bytes sent equal the traffic
model's."""

import pytest
import torch

import hf_noloco.engine.pipeline as pipeline
from hf_noloco.engine import boundary_codec as bc
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.partition import split_model
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.routing import Router
from hf_noloco.estimate.traffic import step_traffic
from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.tiny_models import make_batch, shard, tiny_config, tiny_model

ROWS, SEQ, MICRO, START, STEP, LAYERS = 4, 8, 2, 8, 3, 4

# name -> engine options; "wire" keeps today's wire_dtype path
CONFIGS = {
    "wire f32": dict(),
    "boundary f32": dict(boundary_dtype="float32", boundary_grad_dtype="float32"),
    "wire bf16": dict(wire_dtype=torch.bfloat16),
    "boundary bf16": dict(boundary_dtype="bfloat16", boundary_grad_dtype="bfloat16"),
    "int8": dict(boundary_dtype="int8", boundary_grad_dtype="int8"),
    "int4 blocks": dict(boundary_dtype="int4", boundary_grad_dtype="float8_e5m2", boundary_block_size=8),
}


def _run(pp, configs):
    """Per config: one train step of this rank's stage (sample routing), its loss, gradients, weights after an
    SGD step from the same start, and the bytes of every tensor it sent (counted where they are posted)."""
    mesh = PipelineMesh.build(pp)
    batch = shard(make_batch(ROWS * mesh.num_replicas, SEQ, seed=6), mesh.replica, mesh.num_replicas)
    sent = []
    real_post = pipeline.post

    def counting_post(sends, recvs, *args):
        sent.extend(bc.packet_bytes((t,)) for t, _ in sends)
        return real_post(sends, recvs, *args)

    pipeline.post = counting_post
    out = {}
    for name in configs:
        stage = split_model(tiny_model("llama", LAYERS, seed=5), mesh.stage, pp)
        engine = PipelineEngine(
            stage, mesh, Router(mesh.num_replicas, "sample", seed=11), MICRO, p2p_timeout=30, **CONFIGS[name]
        )
        engine.samples_seen, engine.step_index = START, STEP
        sent.clear()
        result = engine.train_step(batch)
        grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
        torch.optim.SGD(stage.parameters(), lr=0.5).step()
        out[name] = dict(
            loss=None if result.loss is None else result.loss.item(),
            grads=grads,
            weights={n: p.detach().clone() for n, p in stage.named_parameters()},
            sent=sum(sent),
        )
    return mesh.stage, mesh.replica, out


class _Boundary(torch.autograd.Function):
    """The simulation's boundary: the activation through ``fmt``'s packet forward, its gradient through
    ``grad_fmt``'s backward."""

    @staticmethod
    def forward(ctx, x, fmt, grad_fmt, block):
        ctx.grad_fmt, ctx.block = grad_fmt, block
        return bc.decode(bc.encode(x, fmt, block), fmt, x.shape, x.dtype)

    @staticmethod
    def backward(ctx, g):
        return (
            bc.decode(bc.encode(g, ctx.grad_fmt, ctx.block), ctx.grad_fmt, g.shape, g.dtype),
            None,
            None,
            None,
        )


def _simulated(num_replicas, options):
    """Single process, unsplit model: per shard, the loss and the gradients with the boundary (after the
    first stage's layers, layer 2 of 4) rounded as ``options`` say; returns the replicas' mean loss and
    mean gradients (what data parallel averages, whatever the routing)."""
    model = tiny_model("llama", LAYERS, seed=5)
    fmt, grad_fmt = options["boundary_dtype"], options["boundary_grad_dtype"]
    block = options.get("boundary_block_size")

    def hook(module, args, output):
        rounded = _Boundary.apply(output[0] if isinstance(output, tuple) else output, fmt, grad_fmt, block)
        return (rounded, *output[1:]) if isinstance(output, tuple) else rounded

    model.model.layers[LAYERS // 2 - 1].register_forward_hook(hook)
    full = make_batch(ROWS * num_replicas, SEQ, seed=6)
    losses, grads = [], {}
    for r in range(num_replicas):
        model.zero_grad()
        loss = model(**shard(full, r, num_replicas)).loss
        loss.backward()
        losses.append(loss.item())
        for n, p in model.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / num_replicas
    return sum(losses) / num_replicas, grads


def _by_stage(results, dp):
    by = {}
    for stage, replica, out in results:
        by.setdefault(stage, {})[replica] = out
    return by


@pytest.mark.parametrize("pp, dp", [(2, 1), (2, 2)], ids=["pp2", "pp2xdp2"])
def test_boundary_formats_against_todays_wire_a_simulation_and_the_traffic_model(pp, dp):
    results = run_distributed(_run, pp * dp, pp, list(CONFIGS), timeout_s=120)
    by = _by_stage(results, dp)
    # 1. The float formats are today's wire: float32 bit for bit, bfloat16 equal to the bf16 wire.
    for a, b in (("wire f32", "boundary f32"), ("wire bf16", "boundary bf16")):
        for stage, replicas in by.items():
            for r, out in replicas.items():
                assert out[a]["loss"] == out[b]["loss"]
                for n in out[a]["grads"]:
                    assert torch.equal(out[a]["grads"][n], out[b]["grads"][n]), (a, b, stage, r, n)
                    assert torch.equal(out[a]["weights"][n], out[b]["weights"][n]), (a, b, stage, r, n)
    # 2. A quantized boundary: what a single process computes with the same rounding at the boundary, and a
    #    small change against the unquantized run.
    last = by[pp - 1]
    exact_loss = sum(last[r]["wire f32"]["loss"] for r in range(dp)) / dp
    for name in ("int8", "int4 blocks"):
        want_loss, want_grads = _simulated(dp, CONFIGS[name])
        got_loss = sum(last[r][name]["loss"] for r in range(dp)) / dp
        assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
        assert 0 < abs(got_loss - exact_loss) < 0.01 * exact_loss  # rounded, not more
        for stage, replicas in by.items():
            for n in replicas[0][name]["grads"]:
                got = sum(replicas[r][name]["grads"][n] for r in range(dp)) / dp
                exact = sum(replicas[r]["wire f32"]["grads"][n] for r in range(dp)) / dp
                residual = (got - want_grads[n]).norm() / want_grads[n].norm()
                rounding = (got - exact).norm() / exact.norm()
                assert residual < 1e-4, (name, stage, n, residual)
                if (
                    stage == 0
                ):  # the gradient crossed the boundary: the rounding shows, far above the residual
                    assert rounding > 10 * residual, (name, n, rounding, residual)
    # 3. The bytes each rank sent equal the traffic model's for the samples it really routed.
    keys = [(STEP, k) for k in range(START, START + ROWS)]
    hidden = tiny_config("llama", LAYERS).hidden_size
    for name, options in CONFIGS.items():
        value_bytes = (options.get("wire_dtype") or torch.float32).itemsize
        model = step_traffic(
            {"model_type": "llama", "hidden_size": hidden},
            seq_len=SEQ,
            batch_size=ROWS,
            pipeline_stages=pp,
            num_replicas=dp,
            procs_per_node=1,
            routing="sample",
            activation_bytes=value_bytes,
            stage_params=[1] * pp,
            routing_seed=11,
            routing_keys=keys,
            boundary_dtype=options.get("boundary_dtype"),
            boundary_grad_dtype=options.get("boundary_grad_dtype"),
            boundary_block_size=options.get("boundary_block_size"),
        )
        for stage, replicas in by.items():
            for r, out in replicas.items():
                rank = model.ranks[r * pp + stage]
                predicted = rank.pipeline_cross + rank.pipeline_intra
                assert abs(out[name]["sent"] - predicted) <= 0.02 * predicted, (name, stage, r)
