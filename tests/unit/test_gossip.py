"""Pure outer-step logic: settings and their defaults, gossip groups, update equations, the divergence
estimate."""

import itertools
import math

import pytest
import torch

from hf_noloco.outer.gossip import diloco_update_, divergence_from_partners, gossip_groups, noloco_update_
from hf_noloco.outer.settings import OuterSettings
from hf_noloco.rules import OUTER_METHODS


def _hyper(s: OuterSettings) -> dict:
    return {k: getattr(s, k) for k in ("inner_steps", "outer_lr", "outer_momentum", "outer_averaging")}


def test_paper_defaults():
    assert OUTER_METHODS == ("noloco", "diloco", "ddp", "local")
    assert _hyper(OuterSettings("noloco")) == {
        "inner_steps": 50,
        "outer_lr": 0.7,
        "outer_momentum": 0.5,
        "outer_averaging": 0.7,
    }
    assert _hyper(OuterSettings("diloco")) == {
        "inner_steps": 100,
        "outer_lr": 0.7,
        "outer_momentum": 0.3,
        "outer_averaging": None,
    }
    # gamma follows an explicitly set beta; explicit values win over defaults.
    assert OuterSettings("noloco", outer_lr=0.5).outer_averaging == 0.5
    assert _hyper(OuterSettings("noloco", inner_steps=7, outer_averaging=0.1)) == {
        "inner_steps": 7,
        "outer_lr": 0.7,
        "outer_momentum": 0.5,
        "outer_averaging": 0.1,
    }
    assert (
        not OuterSettings("noloco").sends_slow_weights
        and OuterSettings("noloco", outer_averaging=0.1).sends_slow_weights
    )
    OuterSettings("noloco").check_replicas(2)
    for method in ("local", "ddp", "diloco"):
        OuterSettings(method).check_replicas(1)
    assert _hyper(OuterSettings("ddp")) == dict.fromkeys(
        ("inner_steps", "outer_lr", "outer_momentum", "outer_averaging")
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"outer_optimizer": "fsdp"},
            "outer_optimizer must be one of noloco, diloco, ddp, local, got 'fsdp'",
        ),
        (
            {"outer_dtype": "fp16"},
            "outer_dtype must be one of float32, bfloat16, int8, float8_e4m3, int4, got 'fp16'",
        ),
        ({"num_replicas": 1}, "no partner.*--outer_optimizer local"),
        ({"gossip_group_size": 1}, "gossip_group_size must be an integer >= 2"),
        ({"gossip_group_size": 5}, "gossip_group_size=5 is larger than the 4 replicas"),
        ({"inner_steps": 0}, "inner_steps .* positive integer"),
        ({"inner_steps": -3}, "inner_steps .* positive integer"),
        ({"outer_lr": 0.0}, r"outer_lr \(beta\) must be in \(0, 2\]"),
        ({"outer_lr": 2.5}, r"outer_lr \(beta\) must be in \(0, 2\]"),
        ({"outer_lr": float("nan")}, r"outer_lr \(beta\)"),
        ({"outer_momentum": 1.0}, r"outer_momentum \(alpha\) must be in \[0, 1\)"),
        ({"outer_momentum": -0.1}, r"outer_momentum \(alpha\)"),
        ({"outer_averaging": 3.0}, r"outer_averaging \(gamma\) must be in \[0, 2\]"),
        ({"outer_optimizer": "diloco", "inner_steps": 0}, "inner_steps"),
        ({"outer_optimizer": "diloco", "outer_momentum": 1.5}, "outer_momentum"),
        ({"outer_optimizer": "diloco", "outer_averaging": 0.3}, "only applies to outer_optimizer='noloco'"),
    ],
)
def test_bad_settings_get_clear_errors(kwargs, match):
    num_replicas = kwargs.pop("num_replicas", 4)
    with pytest.raises(ValueError, match=match):
        OuterSettings(**kwargs).check_replicas(num_replicas)


@pytest.mark.parametrize("n, size", [(2, 2), (3, 2), (4, 2), (5, 2), (6, 2), (7, 3), (8, 3), (16, 4), (5, 5)])
def test_groups_partition_the_replicas(n, size):
    draws = [gossip_groups(n, size, seed=11, outer_step=k) for k in range(20)]
    for groups in draws:
        members = sorted(r for g in groups for r in g)
        assert members == list(range(n)), groups  # a partition: every replica exactly once
        assert len(groups) == n // size
        assert all(size <= len(g) <= size + math.ceil((n % size) / (n // size)) for g in groups)
        assert all(g == sorted(g) for g in groups)
    if n == 3 and size == 2:
        assert all(sorted(len(g) for g in groups) == [3] for groups in draws)  # odd count: one group of three
    if n == 5 and size == 2:
        assert all(sorted(len(g) for g in groups) == [2, 3] for groups in draws)
    # Deterministic in (seed, step); different across steps and seeds (when there is more than one partition).
    assert draws == [gossip_groups(n, size, seed=11, outer_step=k) for k in range(20)]
    canon = {tuple(map(tuple, sorted(g))) for g in draws}
    if n >= 4 and size < n:
        assert len(canon) > 1
        assert [gossip_groups(n, size, 12, k) for k in range(20)] != draws


def test_every_pair_is_drawn_about_equally():
    counts = {}
    for k in range(3000):
        for g in gossip_groups(4, 2, seed=0, outer_step=k):
            counts[tuple(g)] = counts.get(tuple(g), 0) + 1
    assert len(counts) == 6  # all C(4,2) pairs occur, each in ~1/3 of the steps
    assert all(abs(c / 3000 - 1 / 3) < 0.04 for c in counts.values()), counts


def test_update_equations_against_paper():
    torch.manual_seed(0)
    theta, phi, delta = torch.randn(3, 10), torch.randn(3, 10), torch.randn(3, 10)
    alpha, beta, gamma = 0.5, 0.7, 0.2
    group = [0, 2]
    for i in group:
        # delta_i <- a delta_i + b mean_G(theta - phi) + g (mean_G phi - phi_i); phi_i += delta_i.
        mean_diff = sum(theta[j] - phi[j] for j in group) / len(group)
        mean_phi = sum(phi[j] for j in group) / len(group)
        want_delta = alpha * delta[i] + beta * mean_diff + gamma * (mean_phi - phi[i])
        want_phi = phi[i] + want_delta
        p, d = phi[i].clone(), delta[i].clone()
        noloco_update_(p, d, theta[group].mean(0), alpha, beta, gamma, phi_mean=phi[group].mean(0))
        torch.testing.assert_close(d, want_delta)
        torch.testing.assert_close(p, want_phi)
        # gamma == beta: the phi terms cancel, no phi_mean needed.
        want_delta = alpha * delta[i] + beta * mean_diff + beta * (mean_phi - phi[i])
        p, d = phi[i].clone(), delta[i].clone()
        noloco_update_(p, d, theta[group].mean(0), alpha, beta, beta)
        torch.testing.assert_close(d, want_delta)
        torch.testing.assert_close(p, phi[i] + want_delta)
    with pytest.raises(ValueError, match="phi_mean is needed"):
        noloco_update_(phi[0].clone(), delta[0].clone(), theta[0], alpha, beta, gamma)
    p, d = phi[0].clone(), delta[0].clone()
    diloco_update_(p, d, (theta - phi).mean(0), 0.3, 0.7)
    torch.testing.assert_close(d, 0.3 * delta[0] + 0.7 * (theta - phi).mean(0))
    torch.testing.assert_close(p, phi[0] + d)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_divergence_estimate_is_unbiased(n):
    """Averaged over all pairs (what random pairing samples), the squared estimate is the squared metric."""
    torch.manual_seed(n)
    theta = torch.randn(n, 50, dtype=torch.float64) * torch.arange(1, n + 1, dtype=torch.float64)[:, None]
    metric = math.sqrt(((theta - theta.mean(0)) ** 2).sum() / (50 * n))
    pairs = list(itertools.permutations(range(n), 2))
    est_sq = [
        divergence_from_partners(((theta[i] - theta[j]) ** 2).sum().item(), 1, 50, n) ** 2 for i, j in pairs
    ]
    assert math.isclose(sum(est_sq) / len(pairs), metric**2, rel_tol=1e-12)
    if n == 2:  # with two replicas the estimate is exact
        assert math.isclose(math.sqrt(est_sq[0]), metric, rel_tol=1e-12)
