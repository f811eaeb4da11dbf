"""Capacity routing for mixed-speed replicas: how many of a step's samples each replica computes, and which.
Pure; no communication.

Each replica's speed (samples per second) is a robust smoothed estimate of its measured per-sample compute
time (:class:`SpeedEstimate`: an exponential moving average of the median of a short window of steps, so one
slow step barely moves it). A step's ``total`` samples are shared in proportion to the speeds, after a
minimum ``floor`` share that keeps a slow replica training (:func:`floored_shares`). The quota
``total * share`` of a replica is rarely an integer; :func:`draw_counts` rounds the quotas by systematic
randomized rounding: every count is the floor or the ceiling of its quota, the counts sum exactly to
``total``, and each replica's expected count is exactly its quota, so the expected share of the step's
samples, and with it the objective, is what the shares say. Equal speeds with ``total`` divisible by the
replicas give exactly equal counts, every step: today's behaviour.

:func:`assign` then places the step's samples on the replicas with those counts, uniformly over all
placements with the counts (a uniformly random permutation of the multiset of replica labels).

Every draw is a pure function of integer keys, hashed as the permutation router does
(:func:`~hf_noloco.engine.routing.seeded_uniform`, :func:`~hf_noloco.engine.routing.seeded_permutation`), so
every rank derives the same counts and placement without messages. Shares and quotas are computed in exact
rational arithmetic, so the sums are exact on every platform.
"""

from __future__ import annotations

import math
from collections import deque
from fractions import Fraction

from hf_noloco.engine.routing import seeded_permutation, seeded_uniform


class SpeedEstimate:
    """A replica's robust smoothed per-sample compute time.

    Each :meth:`update` records one step's per-sample time (``seconds / samples``); the estimate moves
    toward the median of the last ``window`` steps by ``rate`` (an exponential moving average of the
    window's median). One outlier step in the window leaves the median, and so the estimate, where the other
    steps put it; a sustained change moves it within a few windows.

    Args:
        window: steps whose median is taken (odd keeps the median a measured value).
        rate: weight of the newest median in the moving average, in ``(0, 1]``.
    """

    def __init__(self, window: int = 5, rate: float = 0.2):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}.")
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate!r}.")
        self.window = window
        self.rate = rate
        self._recent: deque[float] = deque(maxlen=window)
        self.per_sample_seconds: float | None = None

    def update(self, seconds: float, samples: int) -> float:
        """Records one step (``samples`` computed in ``seconds``); returns the new per-sample estimate."""
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples!r}.")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"seconds must be finite and > 0, got {seconds!r}.")
        self._recent.append(seconds / samples)
        ordered = sorted(self._recent)
        middle = len(ordered) // 2
        median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
        if self.per_sample_seconds is None:
            self.per_sample_seconds = median
        else:
            self.per_sample_seconds += self.rate * (median - self.per_sample_seconds)
        return self.per_sample_seconds

    @property
    def speed(self) -> float | None:
        """Samples per second (``None`` before the first step)."""
        return None if self.per_sample_seconds is None else 1.0 / self.per_sample_seconds


def _exact(x: float | Fraction) -> Fraction:
    """``x`` as an exact rational; a float as the decimal it prints as (``0.2`` is ``1/5``)."""
    return Fraction(x) if isinstance(x, (int, Fraction)) else Fraction(repr(float(x)))


def floored_shares(speeds: list[float], floor: float | Fraction = 0.0) -> list[Fraction]:
    """Each replica's exact share of a step's samples: proportional to its speed, except that no share is
    below ``floor``. The floored replicas get ``floor``; the others split the rest in proportion to their
    speeds (repeated until no share of the others is below ``floor``). The shares sum to exactly 1; a float
    counts as the decimal it prints as."""
    if not speeds:
        raise ValueError("speeds must name at least one replica.")
    if any(not (math.isfinite(s) and s > 0) for s in speeds):
        raise ValueError(f"speeds must be finite and > 0, got {speeds}.")
    low = _exact(floor)
    if low < 0 or low * len(speeds) > 1:
        raise ValueError(f"floor must be in [0, 1/{len(speeds)}], got {floor!r}.")
    exact = [_exact(s) for s in speeds]
    floored: set[int] = set()
    while True:
        free = [i for i in range(len(exact)) if i not in floored]
        rest = 1 - low * len(floored)
        mass = sum(exact[i] for i in free)
        shares = [low if i in floored else rest * exact[i] / mass for i in range(len(exact))]
        below = {i for i in free if shares[i] < low}
        if not below:
            return shares
        floored |= below


def round_quotas(quotas: list[Fraction], u: float) -> list[int]:
    """Systematic randomized rounding of ``quotas`` (summing to an integer) by the offset ``u`` in ``[0, 1)``.

    The fractional parts are laid end to end on a line; a replica rounds up when one of the points
    ``u, u + 1, u + 2, ...`` falls in its segment. Each count is the floor or ceiling of its quota, the counts
    sum to the quotas' sum, and for ``u`` uniform the expected count is exactly the quota."""
    base = [math.floor(q) for q in quotas]
    offset = Fraction(u)
    if not 0 <= offset < 1:
        raise ValueError(f"u must be in [0, 1), got {u!r}.")
    counts, start = [], Fraction(0)
    for q, whole in zip(quotas, base):
        end = start + (q - whole)
        # Points m + u in [start, end): ceil(start - u) .. ceil(end - u) - 1.
        counts.append(whole + math.ceil(end - offset) - math.ceil(start - offset))
        start = end
    if start.denominator != 1:
        raise ValueError(f"quotas must sum to an integer, got {sum(quotas)}.")
    return counts


def draw_counts(speeds: list[float], total: int, *keys: int, floor: float | Fraction = 0.0) -> list[int]:
    """Integer sample counts per replica for one step: they sum exactly to ``total``, each is the floor or
    ceiling of ``total * share`` (:func:`floored_shares`), and its expectation over the draw is exactly
    ``total * share``. The draw is a pure function of ``keys`` (e.g. ``seed, step``)."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be a non-negative integer, got {total!r}.")
    quotas = [total * share for share in floored_shares(speeds, floor)]
    return round_quotas(quotas, seeded_uniform(*keys))


def assign(counts: list[int], *keys: int) -> list[int]:
    """``replica[i]`` = the replica that computes sample ``i`` of the step: replica ``r`` gets exactly
    ``counts[r]`` samples, and every placement with these counts is equally likely (a uniformly random
    permutation, :func:`~hf_noloco.engine.routing.seeded_permutation` of ``keys``, of the multiset of
    labels)."""
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(f"counts must be non-negative integers, got {counts}.")
    labels = [replica for replica, count in enumerate(counts) for _ in range(count)]
    perm = seeded_permutation(len(labels), *keys)
    return [labels[perm[i]] for i in range(len(labels))]


# The capacity pairing's draws are keyed apart from the permutation router's: (seed, boundary, step, wave,
# group, tag) never collides with the router's (seed, boundary, sample[, group]).
_PAIRING_TAG = 0xCA9AC17


def wave_counts(
    speeds: list[float], micro: int, group_size: int, *keys: int, floor: float | Fraction = 0.0
) -> list[int]:
    """The rows each replica of a stage computes in one wave (microbatch index) of a step: each routing group
    of ``group_size`` consecutive replicas shares its ``group_size * micro`` rows in proportion to its
    replicas' speeds (:func:`draw_counts`, keyed by ``keys`` and the group), so a sample never has to leave
    its group. Equal speeds give ``micro`` rows each, every wave."""
    n = len(speeds)
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size must divide the {n} replicas, got {group_size}.")
    counts: list[int] = []
    for group in range(n // group_size):
        members = speeds[group * group_size : (group + 1) * group_size]
        counts += draw_counts(members, group_size * micro, *keys, group, floor=floor)
    return counts


def boundary_pairs(
    sender_counts: list[int],
    receiver_counts: list[int],
    group_size: int,
    *keys: int,
) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Which rows of one wave go where at one stage boundary when replicas compute unequal rows.

    Replica ``r`` of the sending stage holds ``sender_counts[r]`` rows (local indices ``0 ..``), replica
    ``q`` of the receiving stage ``receiver_counts[q]``. Within each routing group the senders' rows, laid
    end to end in replica order, are matched to the receivers' rows, laid the same way, by a uniformly random
    permutation drawn from ``keys`` and the group: every row goes to exactly one receiver row, every receiver
    gets exactly its count, and every placement with these counts is equally likely. Returns
    ``{(sender, receiver): [(sender row, receiver row), ...]}`` in ascending sender row, the order in which
    both ends list a message's rows (in the forward and in the backward)."""
    n = len(sender_counts)
    if len(receiver_counts) != n or group_size < 1 or n % group_size:
        raise ValueError(f"counts of {n} and {len(receiver_counts)} replicas in groups of {group_size}.")
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for group in range(n // group_size):
        members = range(group * group_size, (group + 1) * group_size)
        senders = [(r, i) for r in members for i in range(sender_counts[r])]
        receivers = [(q, j) for q in members for j in range(receiver_counts[q])]
        if len(senders) != len(receivers):
            raise ValueError(
                f"routing group {group} sends {len(senders)} rows but receives {len(receivers)}: "
                "a group's counts must sum to the same number at both stages."
            )
        perm = seeded_permutation(len(senders), *keys, group, _PAIRING_TAG)
        for k, (r, i) in enumerate(senders):
            q, j = receivers[perm[k]]
            pairs.setdefault((r, q), []).append((i, j))
    return pairs
