"""Outer-step logic that needs no communication: gossip groups and the update equations.

Kept apart from ``outer.py`` so that the tests can check the math on plain tensors, without processes. The
settings, their paper defaults and their checks are :class:`hf_noloco.config.OuterSettings`.

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

from hf_noloco.engine.routing import seeded_permutation

# Separates the gossip draw from the router's draws (router keys are (seed, boundary, sample)).
_GOSSIP_STREAM = 0x6E6F6C6F636F  # "noloco"


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


def live_gossip_groups(live: list[int], group_size: int, seed: int, outer_step: int) -> list[list[int]]:
    """:func:`gossip_groups` among the ``live`` replicas only (``on_replica_loss="continue"`` dropped the
    others): drawn over their positions, then named by replica. All live: exactly ``gossip_groups``. A single
    live replica forms a group of its own (no partner); fewer than ``group_size`` form one group."""
    live = sorted(live)
    if len(live) < 2:
        return [live]
    groups = gossip_groups(len(live), min(group_size, len(live)), seed, outer_step)
    return [sorted(live[position] for position in group) for group in groups]


def group_of(groups: list[list[int]], replica: int) -> list[int]:
    """The group that contains ``replica``."""
    for group in groups:
        if replica in group:
            return group
    raise ValueError(f"replica {replica} is in no group of {groups}.")


@torch.no_grad()
def group_mean_(theta: torch.Tensor, diffs: list[torch.Tensor]) -> torch.Tensor:
    """A group's mean fast weights, in place in ``theta`` (this replica's own) and returned: ``theta + (1/n)
    sum_j (theta_j - theta)`` over its ``n - 1`` partners' differences ``diffs`` (``theta_j - theta``, in the
    group's order), ``n`` the group's size. Elementwise, so ``theta`` may be one replica's bucket or many
    replicas' stacked along a first dimension."""
    for diff in diffs:
        theta.add_(diff, alpha=1.0 / (len(diffs) + 1))
    return theta


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
def noloco_update_parts_(
    phi: torch.Tensor,
    delta: torch.Tensor,
    pseudo_mean: torch.Tensor,
    phi_mean: torch.Tensor,
    alpha: float,
    beta: float,
    gamma: float,
) -> None:
    """:func:`noloco_update_` from ``mean_G(theta - phi)`` itself (what a compressed exchange with gamma !=
    beta sends): ``delta <- alpha*delta + beta*pseudo_mean + gamma*(phi_mean - phi)``; ``phi += delta``.
    ``phi_mean`` is used as scratch space."""
    delta.mul_(alpha).add_(pseudo_mean, alpha=beta).add_(phi_mean.sub_(phi), alpha=gamma)
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
