"""Outer optimizers on real gloo processes against a plain single-process simulation of the paper's equations.

One launch per mesh (4 and 6 processes, pp = 1 and 2) runs every scenario; the tests below check parts of
its results. The reference never calls the code under test except ``gossip_groups`` (which replicas are
partners; its partition property is tested on its own in test_gossip.py).
"""

import functools
import io
import math

import pytest
import torch
import torch.distributed as dist

from hf_noloco.components.metrics import replica_divergence
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.launch.local_launch import run_distributed
from hf_noloco.outer.gossip import gossip_groups
from hf_noloco.outer.optimizer import OuterOptimizer, broadcast_replica_weights
from hf_noloco.outer.settings import OuterSettings

SHAPES = [(4, 3), (5,)]
NUMEL = sum(math.prod(s) for s in SHAPES)
H, STEPS, LR, MU, SEED = 2, 6, 0.1, 0.9, 5
CONFIGS = {  # name: (method, alpha, beta, gamma)
    "noloco_gamma_eq_beta": ("noloco", 0.5, 0.7, 0.7),
    "noloco_gamma_ne_beta": ("noloco", 0.5, 0.7, 0.2),
    "diloco": ("diloco", 0.3, 0.7, None),
}
MESHES = [(6, 1), (6, 2), (4, 1), (4, 2)]  # one 6-process launch runs all four


def _values(tag, stage, replica):
    """Deterministic per-(tag, stage, replica) tensors, one per SHAPES entry, identical in every process."""
    g = torch.Generator().manual_seed(1_000_003 * tag + 1009 * stage + replica)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


class _Stage(torch.nn.Module):
    def __init__(self, stage, replica):
        super().__init__()
        w, b = _values(0, stage, replica)
        self.weight = torch.nn.Parameter(w)
        self.bias = torch.nn.Parameter(b)
        self.register_buffer("running", torch.full((3,), float(replica)))


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1).float() for t in tensors]).clone()


def _set(params, values):
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)


# --- the distributed job ------------------------------------------------------------------------------------


def _math_run(mesh, model, name, outer_dtype="float32", steps=STEPS):
    method, alpha, beta, gamma = CONFIGS[name]
    params = list(model.parameters())
    _set(params, _values(0, mesh.stage, mesh.replica))
    inner = torch.optim.SGD(params, lr=LR, momentum=MU)
    settings = OuterSettings(
        method,
        H,
        outer_lr=beta,
        outer_momentum=alpha,
        outer_averaging=gamma,
        outer_dtype=outer_dtype,
        routing_seed=SEED,
    )
    opt = OuterOptimizer(
        inner, params, mesh, settings, bucket_mb=1e-5
    )  # tiny buckets: one parameter per bucket, to exercise bucketing
    # Start mid-training: phi and delta differ from theta (set through the state dict, as a resume would).
    sd = opt.state_dict()
    sd["outer"]["phi"] = _values(1, mesh.stage, mesh.replica)
    sd["outer"]["delta"] = _values(2, mesh.stage, mesh.replica)
    opt.load_state_dict(sd)
    record = {"groups": [], "estimates": [], "synced": []}
    for t in range(steps):
        for p, g in zip(params, _values(100 + t, mesh.stage, mesh.replica)):
            p.grad = g
        opt.step()
        record["synced"].append(opt.just_synced)
        if opt.just_synced and method == "noloco":
            record["groups"].append(opt.last_groups)
            record["estimates"].append(opt.last_divergence_estimate)
    record.update(
        theta=_flat(params),
        phi=_flat(opt.phi),
        delta=_flat(opt.delta),
        bytes_sent=opt.bytes_sent,
        bytes_received=opt.bytes_received,
        outer_steps=opt.outer_step_count,
    )
    return opt, record


def _submesh(world, pp):
    """A mesh over ranks 0..world-1 of a bigger launch, so one launch covers several meshes (spawning is the
    slow part). ``new_group`` is collective: every rank creates every group, in the same order."""
    if world == dist.get_world_size():
        return PipelineMesh.build(pp)
    rank, num_replicas = dist.get_rank(), world // pp
    replica_group = column_group = None
    for stage in range(pp):
        ranks = [r * pp + stage for r in range(num_replicas)]
        group = dist.new_group(ranks)
        replica_group = group if rank in ranks else replica_group
    for replica in range(num_replicas):
        ranks = [replica * pp + s for s in range(pp)]
        group = dist.new_group(ranks)
        column_group = group if rank in ranks else column_group
    if rank >= world:
        return None
    return PipelineMesh(rank, world, pp, num_replicas, replica_group, column_group, torch.device("cpu"))


def _outer_job():
    results = {}
    for world, pp in MESHES:
        mesh = _submesh(world, pp)
        results[(world, pp)] = _scenarios(mesh) if mesh is not None else None
        dist.barrier()
    return results


def _scenarios(mesh):
    out = {"stage": mesh.stage, "replica": mesh.replica}
    model = _Stage(mesh.stage, mesh.replica)
    params = list(model.parameters())

    # Start-up broadcast: every replica becomes replica 0 of its stage (params and buffers).
    broadcast_replica_weights(model, mesh)
    out["broadcast"] = [_flat(params), model.running.clone()]

    for name in CONFIGS:
        opt, out[name] = _math_run(mesh, model, name)
        if name == "noloco_gamma_ne_beta":
            # State-dict round trip through bytes, into a fresh optimizer (offloaded, to take that path too).
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            buffer.seek(0)
            fresh = OuterOptimizer(
                torch.optim.SGD(params, lr=LR, momentum=MU),
                params,
                mesh,
                OuterSettings("noloco", H, outer_averaging=0.2, offload_outer_state=True),
            )
            fresh.load_state_dict(torch.load(buffer, weights_only=False))
            out["roundtrip"] = {
                "phi": all(torch.equal(a, b) for a, b in zip(opt.phi, fresh.phi)),
                "delta": all(torch.equal(a, b) for a, b in zip(opt.delta, fresh.delta)),
                "momentum": all(
                    torch.equal(
                        opt.inner.state[p]["momentum_buffer"], fresh.inner.state[p]["momentum_buffer"]
                    )
                    for p in params
                ),
                "counters": [
                    (
                        o.inner_step_count,
                        o.outer_step_count,
                        o.bytes_sent,
                        o.bytes_received,
                        o.last_divergence_estimate,
                    )
                    for o in (opt, fresh)
                ],
                "phi_nonzero": float(_flat(fresh.phi).abs().sum()),
            }
    _, out["bf16"] = _math_run(mesh, model, "noloco_gamma_eq_beta", "bfloat16", steps=H)

    # ddp: different gradients on every replica, averaged before the step -> replicas stay bit-identical.
    _set(params, _values(0, mesh.stage, 0))
    opt = OuterOptimizer(torch.optim.AdamW(params, lr=0.01), params, mesh, OuterSettings("ddp"))
    grads_seen = []
    for t in range(3):
        for p, g in zip(params, _values(100 + t, mesh.stage, mesh.replica)):
            p.grad = g.clone()
        opt.reduce_gradients()
        grads_seen.append(_flat([p.grad for p in params]))
        opt.step()
        opt.zero_grad()
    out["ddp"] = {"theta": _flat(params), "grads": grads_seen, "bytes": opt.bytes_sent}

    # local: no communication at all.
    _set(params, _values(0, mesh.stage, mesh.replica))
    opt = OuterOptimizer(torch.optim.SGD(params, lr=LR), params, mesh, OuterSettings("local"))
    for t in range(3):
        for p, g in zip(params, _values(100 + t, mesh.stage, mesh.replica)):
            p.grad = g
        opt.reduce_gradients()
        opt.step()
    out["local"] = {"theta": _flat(params), "bytes": opt.bytes_sent + opt.bytes_received}

    # noloco with inner steps that change nothing: the divergence must shrink geometrically.
    _set(params, _values(0, mesh.stage, mesh.replica))
    opt = OuterOptimizer(
        torch.optim.SGD(params, lr=LR), params, mesh, OuterSettings("noloco", 1, routing_seed=SEED)
    )
    divergence = [replica_divergence(model, mesh)]
    for _ in range(20):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        divergence.append(replica_divergence(model, mesh))
    out["shrink"] = divergence

    # A replica with NaN weights: its partners refuse to average them (and it notices itself).
    _set(params, _values(0, mesh.stage, mesh.replica))
    opt = OuterOptimizer(
        torch.optim.SGD(params, lr=LR), params, mesh, OuterSettings("noloco", 1, routing_seed=SEED)
    )
    if mesh.replica == 0:
        with torch.no_grad():
            params[0][1, 1] = float("nan")
    try:
        opt.step()
        out["nan_error"] = None
    except FloatingPointError as exc:
        out["nan_error"] = str(exc)
    return out


@functools.cache
def _all_results():
    return run_distributed(_outer_job, max(w for w, _ in MESHES), timeout_s=120)


def _results(world, pp):
    return [per_rank[(world, pp)] for per_rank in _all_results()[:world]]


# --- the reference: the paper's equations, written out for N replicas in one process ------------------------


def _reference(name, num_replicas, stage, steps=STEPS):
    method, alpha, beta, gamma = CONFIGS[name]
    theta = [torch.cat([v.reshape(-1) for v in _values(0, stage, r)]).double() for r in range(num_replicas)]
    phi = [torch.cat([v.reshape(-1) for v in _values(1, stage, r)]).double() for r in range(num_replicas)]
    delta = [torch.cat([v.reshape(-1) for v in _values(2, stage, r)]).double() for r in range(num_replicas)]
    buf = [None] * num_replicas
    estimates, groups_seen = [], []
    outer_step = 0
    for t in range(steps):
        for r in range(num_replicas):  # SGD with momentum (dampening 0): buf = mu buf + g; theta -= lr buf
            g = torch.cat([v.reshape(-1) for v in _values(100 + t, stage, r)]).double()
            buf[r] = g.clone() if buf[r] is None else MU * buf[r] + g
            theta[r] = theta[r] - LR * buf[r]
        if (t + 1) % H:
            continue
        if method == "diloco":
            mean_pseudo = sum(theta[j] - phi[j] for j in range(num_replicas)) / num_replicas
            delta = [alpha * delta[i] + beta * mean_pseudo for i in range(num_replicas)]
        else:
            groups = gossip_groups(num_replicas, 2, SEED, outer_step)
            groups_seen.append(groups)
            new_delta, est = [None] * num_replicas, [None] * num_replicas
            for group in groups:
                for i in group:
                    mean_pseudo = sum(theta[j] - phi[j] for j in group) / len(group)
                    mean_phi = sum(phi[j] for j in group) / len(group)
                    new_delta[i] = alpha * delta[i] + beta * mean_pseudo + gamma * (mean_phi - phi[i])
                    # E||theta_i - theta_j||^2 = 2 N/(N-1) Var -> metric^2 = (N-1)/(2N) mean_j ||.||^2 / numel
                    partners = [j for j in group if j != i]
                    sq = sum(((theta[i] - theta[j]) ** 2).sum().item() for j in partners) / len(partners)
                    est[i] = math.sqrt(sq * (num_replicas - 1) / (2 * num_replicas) / NUMEL)
            delta = new_delta
            estimates.append(est)
        phi = [phi[i] + delta[i] for i in range(num_replicas)]
        theta = [p.clone() for p in phi]
        outer_step += 1
    return {"theta": theta, "phi": phi, "delta": delta, "estimates": estimates, "groups": groups_seen}


def _close(actual, expected, **tol):
    torch.testing.assert_close(actual.double(), expected.double(), **(tol or {"rtol": 1e-5, "atol": 2e-6}))


# --- tests --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world, pp", MESHES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_outer_step_matches_reference(world, pp, name):
    results = _results(world, pp)
    num_replicas = world // pp
    for out in results:
        ref = _reference(name, num_replicas, out["stage"])
        got, r = out[name], out["replica"]
        assert got["synced"] == [(t + 1) % H == 0 for t in range(STEPS)]
        assert got["outer_steps"] == STEPS // H
        _close(got["theta"], ref["theta"][r])
        _close(got["phi"], ref["phi"][r])
        _close(got["delta"], ref["delta"][r])
        if CONFIGS[name][0] == "noloco":
            assert got["groups"] == ref["groups"]
            for est_got, est_ref in zip(got["estimates"], ref["estimates"]):
                assert math.isclose(est_got, est_ref[r], rel_tol=1e-5)


@pytest.mark.parametrize("world, pp", MESHES)
def test_bytes_counter(world, pp):
    num_replicas = world // pp
    outer_steps = STEPS // H
    copy = NUMEL * 4  # one fp32 copy of the stage's parameters
    for out in _results(world, pp):
        groups = [gossip_groups(num_replicas, 2, SEED, k) for k in range(outer_steps)]
        partners = [len(next(g for g in gs if out["replica"] in g)) - 1 for gs in groups]
        got = out["noloco_gamma_eq_beta"]
        # gamma == beta: theta only, one copy to each partner and one from each (pairs: one copy each way).
        assert got["bytes_sent"] == got["bytes_received"] == copy * sum(partners)
        if num_replicas % 2 == 0:
            assert got["bytes_sent"] == copy * outer_steps
        # gamma != beta: theta and phi.
        assert out["noloco_gamma_ne_beta"]["bytes_sent"] == 2 * copy * sum(partners)
        # bf16 halves the bytes (one outer step).
        assert out["bf16"]["bytes_sent"] == copy // 2 * partners[0]
        # diloco: counted as a ring all-reduce, 2 (N-1)/N of a copy each way per outer step.
        assert out["diloco"]["bytes_sent"] == outer_steps * (2 * (num_replicas - 1) * copy // num_replicas)


@pytest.mark.parametrize("world, pp", MESHES)
def test_groups_identical_on_all_ranks_and_stages(world, pp):
    results = _results(world, pp)
    num_replicas = world // pp
    seen = [out["noloco_gamma_eq_beta"]["groups"] for out in results]
    assert all(s == seen[0] for s in seen)  # every rank, every stage: the same groups
    for groups in seen[0]:
        assert sorted(r for g in groups for r in g) == list(range(num_replicas))
    if num_replicas >= 4:
        assert len({str(g) for g in seen[0]}) > 1  # re-drawn across outer steps


@pytest.mark.parametrize("world, pp", MESHES)
def test_bf16_wire_is_close(world, pp):
    num_replicas = world // pp
    for out in _results(world, pp):
        ref = _reference("noloco_gamma_eq_beta", num_replicas, out["stage"], steps=H)
        _close(out["bf16"]["phi"], ref["phi"][out["replica"]], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("world, pp", MESHES)
def test_broadcast_ddp_local(world, pp):
    results = _results(world, pp)
    num_replicas = world // pp
    for out in results:
        stage, r = out["stage"], out["replica"]
        # broadcast: replica 0's parameters and buffers everywhere.
        _close(out["broadcast"][0], torch.cat([v.reshape(-1) for v in _values(0, stage, 0)]), rtol=0, atol=0)
        assert torch.equal(out["broadcast"][1], torch.zeros(3))
        # ddp: the averaged gradient is the plain mean of every replica's gradient ...
        for t, g in enumerate(out["ddp"]["grads"]):
            mean = sum(
                torch.cat([v.reshape(-1) for v in _values(100 + t, stage, q)]) for q in range(num_replicas)
            )
            _close(g, mean / num_replicas)
        # ... and the replicas of a stage stay bit-identical.
        same_stage = [o for o in results if o["stage"] == stage]
        assert all(torch.equal(o["ddp"]["theta"], out["ddp"]["theta"]) for o in same_stage)
        assert out["ddp"]["bytes"] == 3 * (2 * (num_replicas - 1) * NUMEL * 4 // num_replicas)
        # local: each replica is its own plain SGD run, nothing sent.
        theta = torch.cat([v.reshape(-1) for v in _values(0, stage, r)])
        for t in range(3):
            theta = theta - LR * torch.cat([v.reshape(-1) for v in _values(100 + t, stage, r)])
        _close(out["local"]["theta"], theta)
        assert out["local"]["bytes"] == 0
        assert not any(
            torch.equal(o["local"]["theta"], out["local"]["theta"]) for o in same_stage if o is not out
        )


@pytest.mark.parametrize("world, pp", MESHES)
def test_noloco_shrinks_divergence_geometrically(world, pp):
    results = _results(world, pp)
    num_replicas = world // pp
    curve = results[0]["shrink"]
    assert all(o["shrink"] == curve for o in results)  # the metric is the same dict on every rank
    for s in range(pp):
        d = [c[f"replica_divergence/stage_{s}"] for c in curve]
        assert d[0] > 0.5
        if num_replicas in (2, 3):
            # A single group holding every replica: with phi = theta and no inner change, the offset of each
            # replica from the mean, x, and its momentum, e, follow
            #   e' = alpha e - beta x,  x' = x + e'   (alpha 0.5, beta 0.7): spectral radius sqrt(alpha).
            x, e, alpha, beta = 1.0, 0.0, 0.5, 0.7
            for k in range(1, len(d)):
                e = alpha * e - beta * x
                x = x + e
                assert math.isclose(d[k], d[0] * abs(x), rel_tol=1e-4, abs_tol=1e-6), (k, d[k], d[0] * abs(x))
        # Geometric: a steady rate, not a stall (one group: sqrt(0.5) per step; random pairs of 4-6: ~0.85).
        assert max(d[-3:]) < 0.1 * d[0] and max(d[-3:]) < 0.4 * max(d[8:11]), d
    whole = [c["replica_divergence"] for c in curve]
    assert whole[-1] < 0.1 * whole[0]


@pytest.mark.parametrize("world, pp", MESHES)
def test_state_dict_roundtrip(world, pp):
    for out in _results(world, pp):
        rt = out["roundtrip"]
        assert rt["phi"] and rt["delta"] and rt["momentum"] and rt["phi_nonzero"] > 0
        assert rt["counters"][0] == rt["counters"][1]
        assert rt["counters"][0][1] == STEPS // H and rt["counters"][0][2] > 0


@pytest.mark.parametrize("world, pp", MESHES)
def test_non_finite_weights_fail_loudly(world, pp):
    num_replicas = world // pp
    first = next(g for g in gossip_groups(num_replicas, 2, SEED, 0) if 0 in g)
    for out in _results(world, pp):
        r, stage, msg = out["replica"], out["stage"], out["nan_error"]
        if r == 0:
            assert "own weights contain NaN or inf" in msg
        elif r in first:
            assert f"received from rank {stage} (stage {stage}, replica 0)" in msg and "NaN" in msg
        else:
            assert msg is None


# --- single process: the torch.optim surface ----------------------------------------------------------------


def _solo_mesh():
    return PipelineMesh(
        rank=0,
        world_size=1,
        num_stages=1,
        num_replicas=1,
        replica_group=None,
        column_group=None,
        device=torch.device("cpu"),
    )


def test_wrapper_works_with_lr_schedulers_and_accelerate():
    from accelerate import Accelerator

    model = torch.nn.Linear(3, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt = OuterOptimizer(inner, list(model.parameters()), _solo_mesh(), OuterSettings("diloco", 2))
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is inner.param_groups
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    wrapped = Accelerator(cpu=True).prepare_optimizer(opt)  # round-trips the state dict (device placement)
    for _ in range(4):
        model(torch.randn(5, 3)).sum().backward()
        wrapped.step()
        sched.step()
        wrapped.zero_grad()
    assert opt.inner_step_count == 4 and opt.outer_step_count == 2
    assert inner.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    # After load_state_dict the inner optimizer has new param_groups; the wrapper must follow them.
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups is inner.param_groups and opt.inner_step_count == 4


def test_constructor_errors():
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no partner"):
        OuterOptimizer(inner, list(model.parameters()), _solo_mesh(), OuterSettings("noloco"))
    with pytest.raises(ValueError, match="outer_optimizer must be one of"):
        OuterOptimizer(inner, list(model.parameters()), _solo_mesh(), OuterSettings("allreduce"))
    with pytest.raises(ValueError, match="outer_dtype"):
        OuterOptimizer(
            inner, list(model.parameters()), _solo_mesh(), OuterSettings("local", outer_dtype="fp16")
        )
    opt = OuterOptimizer(inner, list(model.parameters()), _solo_mesh(), OuterSettings("local"))
    with pytest.raises(ValueError, match="outer method 'diloco'"):
        opt.load_state_dict(
            OuterOptimizer(
                inner, list(model.parameters()), _solo_mesh(), OuterSettings("diloco")
            ).state_dict()
        )
