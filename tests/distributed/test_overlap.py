"""Overlapped outer sync (``overlap_steps`` = tau): real gloo processes against a single-process simulation of
the delayed update, bit-for-bit identity of tau = 0 with the blocking step, exchanges that really run in the
background, and exact resume from a checkpoint taken while an exchange is in flight.

The reference writes the equations out for N replicas in one process (double precision): at inner step kH
each replica records theta_k and the outer update is computed from the theta_k of its group; tau inner steps
later theta <- phi_new + (theta_now - theta_k). It never calls the code under test except ``gossip_groups``.
"""

import functools
import io
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.launch.local_launch import run_distributed
from hf_noloco.outer.gossip import gossip_groups
from hf_noloco.outer.optimizer import OuterOptimizer
from hf_noloco.outer.settings import OuterSettings

SHAPES = [(4, 3), (5,)]
H, STEPS, LR, MU, SEED = 3, 11, 0.1, 0.9, 5
CONFIGS = {  # name: (method, alpha, beta, gamma)
    "noloco": ("noloco", 0.5, 0.7, 0.7),
    "noloco_gamma_ne_beta": ("noloco", 0.5, 0.7, 0.2),
    "diloco": ("diloco", 0.3, 0.7, None),
}
TAUS = [0, 1, 2, H]
CURVATURE = 0.5
WORLD, PP = 4, 1
GIVE_UP = 3.0  # seconds the late partner waits for a flag that a blocking outer step never sets


def _values(tag, stage, replica):
    g = torch.Generator().manual_seed(1_000_003 * tag + 1009 * stage + replica)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1).float() for t in tensors]).clone()


def _params(mesh):
    return [torch.nn.Parameter(v) for v in _values(0, mesh.stage, mesh.replica)]


def _optimizer(mesh, params, name, tau, bucket_mb=1e-5):
    method, alpha, beta, gamma = CONFIGS[name]
    settings = OuterSettings(
        method,
        H,
        outer_lr=beta,
        outer_momentum=alpha,
        outer_averaging=gamma,
        routing_seed=SEED,
        outer_overlap_steps=tau,
    )
    # tiny buckets: one parameter per bucket, to exercise bucketing
    return OuterOptimizer(
        torch.optim.SGD(params, lr=LR, momentum=MU), params, mesh, settings, bucket_mb=bucket_mb
    )


def _grads(params, mesh, t):
    """The gradient of a quadratic: it depends on the weights, so applying an update later changes the path
    (with weight-independent gradients, a delayed update would land on the same weights)."""
    for p, g in zip(params, _values(100 + t, mesh.stage, mesh.replica)):
        p.grad = CURVATURE * p.detach() + g


def _run(mesh, name, tau, steps=STEPS):
    params = _params(mesh)
    opt = _optimizer(mesh, params, name, tau)
    synced, thetas = [], []
    for t in range(steps):
        _grads(params, mesh, t)
        opt.step()
        synced.append(opt.just_synced)
        thetas.append(_flat(params))
    opt.finish_outer_step()  # what the trainer does at the end of training
    return {
        "theta": _flat(params),
        "phi": _flat(opt.phi),
        "delta": _flat(opt.delta),
        "thetas": thetas,
        "synced": synced,
        "outer_steps": opt.outer_step_count,
        "bytes": (opt.bytes_sent, opt.bytes_received),
    }


def _deferred_now_vs_blocking(mesh, name):
    """The deferred path applied at once (start, then finish with no inner step between) against the blocking
    outer step, from identical states: the same arithmetic, so the same bits."""
    out = {}
    for mode in ("blocking", "deferred"):
        params = _params(mesh)
        opt = _optimizer(mesh, params, name, 0)
        for t in range(H - 1):
            _grads(params, mesh, t)
            opt.step()
        _grads(params, mesh, H - 1)
        opt.inner.step()
        opt.inner_step_count += 1
        if mode == "blocking":
            opt.outer_step()
        else:
            opt.start_outer_step()
            opt.finish_outer_step()
        out[mode] = (_flat(params), _flat(opt.phi), _flat(opt.delta))
    return out


def _late_replica():
    """Replica 0's partner at the first outer step."""
    return next(r for g in gossip_groups(WORLD // PP, 2, SEED, 0) if 0 in g for r in g if r != 0)


def _background(mesh):
    """Replica 0's partner reaches the outer step only once replica 0 has finished two steps (a store flag),
    or after giving up on the flag (GIVE_UP seconds). With tau = 2 replica 0's outer step() returns before its
    partner posts anything, so the flag comes; with tau = 0 it waits for the partner, so the flag cannot come.
    Events, not clocks: the verdict holds on a machine at any load. Returns, for the partner, whether the
    flag came, per tau."""
    store = dist.distributed_c10d._get_default_store()
    out = {}
    for tau in (0, 2):
        params = _params(mesh)
        opt = _optimizer(mesh, params, "noloco", tau, bucket_mb=16)
        dist.barrier()
        flag = f"replica-0-passed-the-outer-step-{tau}"
        for t in range(H + 1):
            _grads(params, mesh, t)
            if t == H - 1 and mesh.replica == _late_replica():
                try:
                    store.wait([flag], timedelta(seconds=GIVE_UP if tau == 0 else 120))
                    out[tau] = True
                except RuntimeError:  # the store's timeout
                    out[tau] = False
            opt.step()
            if t == H and mesh.replica == 0:  # the step after the outer one did not wait either
                store.set(flag, "1")
        opt.finish_outer_step()
    return out


def _resume_in_flight(mesh, name, tau):
    """A checkpoint (state dict through bytes) taken right after an overlapped outer step started, loaded into
    a fresh optimizer on fresh parameters, continues bit for bit like the uninterrupted run."""
    straight = _run(mesh, name, tau)
    params = _params(mesh)
    opt = _optimizer(mesh, params, name, tau)
    for t in range(H):
        _grads(params, mesh, t)
        opt.step()
    assert opt.outer_step_in_flight
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in params]}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    params = [torch.nn.Parameter(p) for p in saved["params"]]
    fresh = _optimizer(mesh, params, name, tau)
    fresh.load_state_dict(saved["opt"])
    for t in range(H, STEPS):
        _grads(params, mesh, t)
        fresh.step()
    fresh.finish_outer_step()
    resumed = (_flat(params), _flat(fresh.phi), _flat(fresh.delta))
    return all(
        torch.equal(a, b) for a, b in zip(resumed, (straight["theta"], straight["phi"], straight["delta"]))
    )


def _job():
    mesh = PipelineMesh.build(PP)
    results = {"replica": mesh.replica, "stage": mesh.stage}
    for name in CONFIGS:
        for tau in TAUS:
            results[(name, tau)] = _run(mesh, name, tau)
        results[("now", name)] = _deferred_now_vs_blocking(mesh, name)
    results["resume"] = {name: _resume_in_flight(mesh, name, 2) for name in ("noloco", "diloco")}
    results["background"] = _background(mesh)
    return results


@functools.cache
def _results():
    return run_distributed(_job, WORLD, timeout_s=120)


def _reference(name, num_replicas, stage, tau):
    method, alpha, beta, gamma = CONFIGS[name]
    vec = lambda tag, r: torch.cat([v.reshape(-1) for v in _values(tag, stage, r)]).double()
    theta = [vec(0, r) for r in range(num_replicas)]
    phi = [t.clone() for t in theta]
    delta = [torch.zeros_like(t) for t in theta]
    buf = [None] * num_replicas
    sent, apply_at, outer_step, thetas = None, None, 0, []

    def update(sent):
        if method == "diloco":
            mean_pseudo = sum(sent[j] - phi[j] for j in range(num_replicas)) / num_replicas
            new_delta = [alpha * delta[i] + beta * mean_pseudo for i in range(num_replicas)]
        else:
            new_delta = [None] * num_replicas
            for group in gossip_groups(num_replicas, 2, SEED, outer_step):
                for i in group:
                    mean_pseudo = sum(sent[j] - phi[j] for j in group) / len(group)
                    mean_phi = sum(phi[j] for j in group) / len(group)
                    new_delta[i] = alpha * delta[i] + beta * mean_pseudo + gamma * (mean_phi - phi[i])
        return new_delta, [phi[i] + new_delta[i] for i in range(num_replicas)]

    def apply():
        nonlocal theta, phi, delta, sent, outer_step
        delta, phi = update(sent)
        theta = [phi[i] + (theta[i] - sent[i]) for i in range(num_replicas)]
        sent = None
        outer_step += 1

    for t in range(STEPS):
        for r in range(num_replicas):  # SGD with momentum (dampening 0): buf = mu buf + g; theta -= lr buf
            g = CURVATURE * theta[r] + vec(100 + t, r)
            buf[r] = g.clone() if buf[r] is None else MU * buf[r] + g
            theta[r] = theta[r] - LR * buf[r]
        if sent is not None and t + 1 >= apply_at:
            apply()
        if (t + 1) % H == 0:
            sent, apply_at = [th.clone() for th in theta], t + 1 + tau
            if tau == 0:
                apply()
        thetas.append([th.clone() for th in theta])
    if sent is not None:
        apply()
    return {"theta": theta, "phi": phi, "delta": delta, "thetas": thetas}


def _close(actual, expected):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-5, atol=3e-6)


@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_overlapped_step_matches_delayed_reference(name, tau):
    for out in _results():
        ref = _reference(name, WORLD // PP, out["stage"], tau)
        got, r = out[(name, tau)], out["replica"]
        # applied tau steps after each multiple of H (tau = H: at the next multiple, before the next start)
        assert got["synced"] == [(t + 1 - tau) >= H and (t + 1 - tau) % H == 0 for t in range(STEPS)]
        assert got["outer_steps"] == STEPS // H
        for theta_got, theta_ref in zip(got["thetas"], ref["thetas"]):
            _close(theta_got, theta_ref[r])
        _close(got["theta"], ref["theta"][r])
        _close(got["phi"], ref["phi"][r])
        _close(got["delta"], ref["delta"][r])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tau_zero_is_the_blocking_step_bit_for_bit(name):
    for out in _results():
        blocking, deferred = out[("now", name)]["blocking"], out[("now", name)]["deferred"]
        for a, b in zip(blocking, deferred):
            assert torch.equal(a, b)
        # the same bytes cross the network whatever tau
        assert len({out[(name, tau)]["bytes"] for tau in TAUS}) == 1


def test_tau_changes_the_trajectory():
    """Overlap is not a no-op: with tau > 0 the weights differ from tau = 0's after the first outer step."""
    for out in _results():
        assert not torch.allclose(out[("noloco", 0)]["theta"], out[("noloco", 1)]["theta"])


def test_exchange_runs_in_the_background():
    [late] = [out for out in _results() if out["replica"] == _late_replica()]
    # tau = 2: replica 0 posted the exchange, returned, and trained its next step before its partner came
    assert late["background"][2] is True
    # tau = 0: replica 0's outer step waited for the partner, which had to give up on the flag
    assert late["background"][0] is False


def test_resume_with_an_exchange_in_flight_is_exact():
    for out in _results():
        assert out["resume"] == {"noloco": True, "diloco": True}


def test_overlap_settings_are_checked():
    assert OuterSettings("noloco", 10, outer_overlap_steps=10).outer_overlap_steps == 10
    with pytest.raises(ValueError, match=r"outer_overlap_steps \(tau\) must be in \[0, inner_steps=10\]"):
        OuterSettings("noloco", 10, outer_overlap_steps=11)
    with pytest.raises(ValueError, match=r"must be in \[0, inner_steps=100\]"):
        OuterSettings("diloco", outer_overlap_steps=-1)
    with pytest.raises(ValueError, match="needs an outer step to overlap"):
        OuterSettings("ddp", outer_overlap_steps=1)
    with pytest.raises(ValueError, match="must be an integer"):
        OuterSettings("noloco", outer_overlap_steps=True)


# --- through NoLoCoTrainer --------------------------------------------------------------------------------


def _trainer_overlap(out):
    import os

    from test_trainer import byte_config, byte_corpus, make_args

    from hf_noloco.components.metrics import replica_divergence
    from hf_noloco.trainer import NoLoCoTrainer

    data = byte_corpus(256)
    runs = []
    for resume in (None, os.path.join(out, "checkpoint-8")):
        args = make_args(
            out,
            max_steps=12,
            logging_steps=1,
            divergence_steps=1,
            eval_strategy="no",
            save_strategy="steps",
            save_steps=4,
            inner_steps=4,
            outer_overlap_steps=3,
            outer_optimizer="noloco",
        )
        trainer = NoLoCoTrainer(byte_config(), args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        history = trainer.state.log_history
        runs.append(
            dict(
                losses={h["step"]: h["loss"] for h in history if "loss" in h},
                divergence={h["step"]: h["replica_divergence"] for h in history if "replica_divergence" in h},
                final_divergence=replica_divergence(trainer.model, trainer.mesh)["replica_divergence"],
                weights={k: v.clone() for k, v in trainer.model.state_dict().items()},
            )
        )
    trainer.end()
    return runs


def test_trainer_overlaps_resumes_in_flight_and_applies_the_last_outer_step(tmp_path):
    for straight, resumed in run_distributed(_trainer_overlap, 4, str(tmp_path / "run"), timeout_s=240):
        # The checkpoint at step 8 was taken with the exchange of step 8's outer step in flight (applied at
        # step 11): the resumed run continues exactly.
        assert all(resumed["losses"][s] == straight["losses"][s] for s in range(1, 13))
        for name, value in straight["weights"].items():
            assert torch.equal(value, resumed["weights"][name]), name
        # Step 12 started an outer step that tau = 3 would apply at step 15: the replicas still differ in the
        # last log, and train() applies it at the end. A pair (dp = 2) then holds the same slow weights, up to
        # rounding.
        assert straight["divergence"][12] > 1e-4
        assert straight["divergence"][11] < straight["divergence"][10]  # applied at 11 (= 8 + 3)
        assert straight["final_divergence"] < 1e-6
