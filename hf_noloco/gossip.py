"""Outer-step logic that needs no communication: settings, paper defaults, gossip groups, update equations.

Kept apart from ``outer.py`` so that the config can validate settings before any process group exists,
and so that the tests can check the math on plain tensors.

Notation (arXiv 2506.10911, eq. 1-3, signs as in the official code): replica ``i`` holds slow weights
``phi_i``, fast weights ``theta_i`` (``phi_i`` after H inner steps) and an outer momentum ``delta_i``;
``G`` is its gossip group (itself included). An outer step is

    delta_i <- alpha * delta_i + beta * mean_G(theta - phi) + gamma * (mean_G(phi) - phi_i)
    phi_i   <- phi_i + delta_i ;  theta_i <- phi_i

With ``gamma == beta`` the phi terms cancel to ``beta * (mean_G(theta) - phi_i)``: only fast weights have
to cross the network.
"""

from __future__ import annotations

import math

import torch

from hf_noloco.routing import seeded_permutation

OUTER_METHODS = ("noloco", "diloco", "ddp", "local")

# Methods that run an outer step every ``inner_steps`` (the others have no outer hyperparameters).
OUTER_STEP_METHODS = ("noloco", "diloco")

# Paper defaults (Section 4). gamma (outer_averaging) is not stated in the paper; the official code uses
# gamma = beta, written here as None and resolved to outer_lr.
PAPER_DEFAULTS: dict[str, dict[str, float | int | None]] = {
    "noloco": {"inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.5, "outer_averaging": None},
    "diloco": {"inner_steps": 100, "outer_lr": 0.7, "outer_momentum": 0.3, "outer_averaging": None},
    "ddp": {"inner_steps": None, "outer_lr": None, "outer_momentum": None, "outer_averaging": None},
    "local": {"inner_steps": None, "outer_lr": None, "outer_momentum": None, "outer_averaging": None},
}

# Separates the gossip draw from the router's draws (router keys are (seed, boundary, sample)).
_GOSSIP_STREAM = 0x6E6F6C6F636F  # "noloco"


def _check_method(method: str) -> None:
    if method not in OUTER_METHODS:
        raise ValueError(f"Unknown outer method {method!r}: choose one of {', '.join(OUTER_METHODS)}.")


def resolve_outer_defaults(
    method: str,
    inner_steps: int | None = None,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    outer_averaging: float | None = None,
) -> dict:
    """Fills every ``None`` with the paper's default for ``method``.

    Returns ``{"inner_steps", "outer_lr", "outer_momentum", "outer_averaging"}``. For ``noloco`` an unset
    ``outer_averaging`` (gamma) becomes ``outer_lr`` (beta), the official code's choice. ``ddp`` and ``local``
    have no outer step; their values stay ``None`` unless given (and are then ignored).
    """
    _check_method(method)
    defaults = PAPER_DEFAULTS[method]
    resolved = {
        "inner_steps": defaults["inner_steps"] if inner_steps is None else inner_steps,
        "outer_lr": defaults["outer_lr"] if outer_lr is None else outer_lr,
        "outer_momentum": defaults["outer_momentum"] if outer_momentum is None else outer_momentum,
        "outer_averaging": outer_averaging,
    }
    if method == "noloco" and outer_averaging is None:
        resolved["outer_averaging"] = resolved["outer_lr"]
    return resolved


def validate_outer_settings(
    method: str,
    num_replicas: int,
    gossip_group_size: int = 2,
    inner_steps: int | None = None,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    outer_averaging: float | None = None,
) -> None:
    """Raises ``ValueError`` with a clear message for settings that cannot train. ``None`` = paper default.

    Ranges: ``inner_steps`` >= 1; ``0 < outer_lr <= 2`` and ``0 <= outer_averaging <= 2`` (above 2 a pull
    towards the group mean overshoots by more than the distance it closes, so replicas drift apart);
    ``0 <= outer_momentum < 1`` (heavy-ball momentum of 1 or more never forgets).
    """
    _check_method(method)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
    if method in ("ddp", "local"):
        return  # no outer step: the outer hyperparameters are unused
    s = resolve_outer_defaults(method, inner_steps, outer_lr, outer_momentum, outer_averaging)
    if isinstance(s["inner_steps"], bool) or not isinstance(s["inner_steps"], int) or s["inner_steps"] < 1:
        raise ValueError(
            f"inner_steps (H, inner steps per outer step) must be a positive integer, got "
            f"{s['inner_steps']!r}."
        )
    if not (math.isfinite(s["outer_lr"]) and 0 < s["outer_lr"] <= 2):
        raise ValueError(f"outer_lr (beta) must be in (0, 2], got {s['outer_lr']!r} (the paper uses 0.7).")
    if not (math.isfinite(s["outer_momentum"]) and 0 <= s["outer_momentum"] < 1):
        raise ValueError(
            f"outer_momentum (alpha) must be in [0, 1), got {s['outer_momentum']!r} "
            f"(the paper uses {PAPER_DEFAULTS[method]['outer_momentum']})."
        )
    if method == "noloco":
        gamma = s["outer_averaging"]
        if not (math.isfinite(gamma) and 0 <= gamma <= 2):
            raise ValueError(
                f"outer_averaging (gamma) must be in [0, 2], got {gamma!r} "
                "(the official code uses gamma = outer_lr)."
            )
        if num_replicas < 2:
            raise ValueError(
                "outer method 'noloco' needs at least 2 replicas per stage: with a single replica "
                "there is no partner to average with. Use outer_optimizer='local' (no sync) instead, "
                "or launch more processes."
            )
        if (
            isinstance(gossip_group_size, bool)
            or not isinstance(gossip_group_size, int)
            or gossip_group_size < 2
        ):
            raise ValueError(
                f"gossip_group_size must be an integer >= 2 (a replica and at least one partner), "
                f"got {gossip_group_size!r}."
            )
        if gossip_group_size > num_replicas:
            raise ValueError(
                f"gossip_group_size={gossip_group_size} is larger than the {num_replicas} replicas "
                f"per stage: use at most {num_replicas}."
            )
    elif outer_averaging is not None:
        raise ValueError("outer_averaging (gamma) only applies to outer_optimizer='noloco'.")


def gossip_groups(num_replicas: int, group_size: int, seed: int, outer_step: int) -> list[list[int]]:
    """The gossip groups of outer step ``outer_step``: a partition of ``range(num_replicas)``.

    A shared-seed permutation is cut into ``num_replicas // group_size`` groups of ``group_size``; the
    ``num_replicas % group_size`` left-over replicas join the groups one each, round-robin (with pairs and an
    odd count: one group of three). The result depends only on its arguments (not on the stage), so every
    stage draws the same groups and no messages are needed to agree. Each group is sorted.
    """
    if group_size < 2 or group_size > num_replicas:
        raise ValueError(f"group_size must be in [2, {num_replicas}], got {group_size}.")
    perm = seeded_permutation(num_replicas, seed, _GOSSIP_STREAM, outer_step)
    num_groups = num_replicas // group_size
    groups = [perm[g * group_size : (g + 1) * group_size] for g in range(num_groups)]
    for k, replica in enumerate(perm[num_groups * group_size :]):
        groups[k % num_groups].append(replica)
    return [sorted(g) for g in groups]


def group_of(groups: list[list[int]], replica: int) -> list[int]:
    """The group that contains ``replica``."""
    for group in groups:
        if replica in group:
            return group
    raise ValueError(f"replica {replica} is in no group of {groups}.")


@torch.no_grad()
def noloco_update_(
    phi: torch.Tensor,
    delta: torch.Tensor,
    theta_mean: torch.Tensor,
    alpha: float,
    beta: float,
    gamma: float,
    phi_mean: torch.Tensor | None = None,
) -> None:
    """NoLoCo outer update of one replica, in place on ``phi`` and ``delta``.

    ``theta_mean``/``phi_mean`` are the group means of the fast/slow weights; they are used as scratch space
    and overwritten (an outer step touches every weight of the stage, so each saved pass counts). ``phi_mean``
    may be omitted only when ``gamma == beta`` (then ``delta <- alpha*delta + beta*(theta_mean - phi)``). The
    caller sets ``theta <- phi`` afterwards.
    """
    if phi_mean is None:
        if gamma != beta:
            raise ValueError("phi_mean is needed when outer_averaging (gamma) != outer_lr (beta).")
        delta.mul_(alpha).add_(theta_mean.sub_(phi), alpha=beta)
    else:
        # mean_G(theta - phi) = theta_mean - phi_mean
        delta.mul_(alpha).add_(theta_mean.sub_(phi_mean), alpha=beta).add_(phi_mean.sub_(phi), alpha=gamma)
    phi.add_(delta)


@torch.no_grad()
def diloco_update_(
    phi: torch.Tensor, delta: torch.Tensor, pseudo_grad_mean: torch.Tensor, alpha: float, beta: float
) -> None:
    """DiLoCo outer update, in place: ``delta <- alpha*delta + beta*mean(theta - phi)``; ``phi += delta``."""
    delta.mul_(alpha).add_(pseudo_grad_mean, alpha=beta)
    phi.add_(delta)


def divergence_from_partners(sq_dist_sum: float, num_partners: int, numel: int, num_replicas: int) -> float:
    """Free estimate of the replica-divergence metric from the distances to one's gossip partners.

    For two replicas drawn at random, E||theta_i - theta_j||^2 = 2 N/(N-1) * sum_params Var_r(theta) with the
    population variance ``Var_r`` the metric uses; so ``metric^2 = (N-1)/(2N) * E||theta_i - theta_j||^2 /
    numel``. ``sq_dist_sum`` is the sum over partners of ``||theta_i - theta_j||^2``.
    """
    if num_partners < 1 or numel < 1:
        return float("nan")
    mean_sq = sq_dist_sum / num_partners
    return math.sqrt(max(mean_sq, 0.0) * (num_replicas - 1) / (2 * num_replicas) / numel)
