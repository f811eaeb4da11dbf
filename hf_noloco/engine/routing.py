"""The permutation router: which replica of the next stage each sample goes to. Pure; no communication.

At boundary ``b`` (stage b -> b+1) a sample is routed by a permutation ``pi`` of the replicas: replica
``r`` of stage b sends it to replica ``pi[r]`` of stage b+1, and replica ``q`` of stage b+1 receives it
from ``pi_inverse[q]``. The permutation is a pure function of ``(seed, boundary, key)``, so every rank
derives the same one without messages. The key is the sample index (``sample`` granularity, as in the
official code), the optimizer step (``step``, as in the paper's text), or nothing (``fixed``: identity).

With ``group_size`` below the number of replicas (``routing_domain: node``), the replicas are cut into
consecutive groups of ``group_size`` (the replicas whose columns share a node, since ranks are
``replica * pp + stage``) and the permutation maps every group onto itself: one uniformly random permutation
per group, each drawn from ``(seed, boundary, key, group)``. A sample then never leaves its node, and every
rank still derives the same permutation without messages.

With ``live`` (replicas dropped by ``on_replica_loss="continue"``) the permutation is drawn over the live
replicas only, by their order, and maps each of them to a live one; while every replica is live it is the
same permutation as without.

Rows keep their position within a microbatch at every stage; only the replica that computes them changes.
The hash and shuffle are written out in plain integer arithmetic so that every platform and every torch
version draws the same permutations.
"""

from __future__ import annotations

from hf_noloco.rules import ROUTINGS, check_choice

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _keyed_state(keys: tuple[int, ...]) -> int:
    state = 0
    for key in keys:
        state = _splitmix64(state ^ (key & _MASK64))
    return state


def seeded_uniform(*keys: int) -> float:
    """A uniform draw from ``[0, 1)`` (a multiple of ``2**-53``) determined by the integer ``keys``, from the
    same key hashing as :func:`seeded_permutation`."""
    return (_splitmix64(_keyed_state(keys)) >> 11) / float(1 << 53)


def seeded_permutation(n: int, *keys: int) -> list[int]:
    """A uniformly random permutation of ``range(n)`` determined by the integer ``keys`` (Fisher-Yates)."""
    state = _keyed_state(keys)
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        state = _splitmix64(state)
        j = state % (i + 1)  # modulo bias is < i / 2**64: negligible
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def grouped_permutation(n: int, group_size: int, *keys: int) -> list[int]:
    """A uniformly random permutation of ``range(n)`` that maps each block of ``group_size`` consecutive
    integers onto itself (block ``g`` is shuffled by ``seeded_permutation(group_size, *keys, g)``).
    ``group_size == n`` is :func:`seeded_permutation` itself, so global routing draws what it always drew."""
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size must divide n={n}, got {group_size}.")
    if group_size == n:
        return seeded_permutation(n, *keys)
    perm: list[int] = []
    for group in range(n // group_size):
        offset = group * group_size
        perm += [offset + r for r in seeded_permutation(group_size, *keys, group)]
    return perm


class Router:
    """Draws the replica pairing between neighbouring stages.

    Args:
        num_replicas: replicas per stage (dp).
        granularity: ``"sample"``, ``"step"`` or ``"fixed"``.
        seed: shared by every rank of the run.
        group_size: replicas per routing group (consecutive replica indices; must divide ``num_replicas``).
            ``None`` or ``num_replicas``: one group, any replica may receive any sample (``routing_domain:
            global``); smaller: a sample stays within its group (``node``); 1 is the identity.
        live: the replicas still in the run (``None``: all); samples are routed among these only, which needs
            one routing group.
    """

    def __init__(
        self,
        num_replicas: int,
        granularity: str = "sample",
        seed: int = 0,
        group_size: int | None = None,
        live: list[int] | None = None,
    ):
        check_choice("routing", granularity, ROUTINGS)
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
        group_size = num_replicas if group_size is None else group_size
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"routing group_size must be a positive integer, got {group_size!r}.")
        if num_replicas % group_size:
            raise ValueError(
                f"routing group_size={group_size} does not divide the {num_replicas} replicas per stage."
            )
        live = list(range(num_replicas)) if live is None else sorted(live)
        if live != list(range(num_replicas)) and group_size != num_replicas:
            raise ValueError(
                "Routing among the live replicas needs one routing group (routing_domain='global')."
            )
        if not live or not set(live) <= set(range(num_replicas)):
            raise ValueError(f"live replicas {live} are not a non-empty subset of range({num_replicas}).")
        self.live = live
        self.num_replicas = num_replicas
        self.granularity = granularity
        self.seed = seed
        self.group_size = group_size
        self._identity = list(range(num_replicas))

    def group_of(self, replica: int) -> range:
        """The replicas that ``replica`` may exchange samples with (itself included)."""
        start = replica - replica % self.group_size
        return range(start, start + self.group_size)

    def permutation(self, boundary: int, step: int, sample: int) -> list[int]:
        """``perm[r]`` = the replica of stage ``boundary + 1`` that receives, from replica ``r`` of stage
        ``boundary``, the sample with per-replica index ``sample`` in optimizer step ``step``."""
        if self.granularity == "fixed" or self.group_size == 1:
            return self._identity
        key = sample if self.granularity == "sample" else step
        if len(self.live) == self.num_replicas:
            return grouped_permutation(self.num_replicas, self.group_size, self.seed, boundary, key)
        # Drawn over positions in the live list; the lost replicas map to themselves (no one sends to them).
        drawn = seeded_permutation(len(self.live), self.seed, boundary, key)
        perm = list(range(self.num_replicas))
        for position, replica in enumerate(self.live):
            perm[replica] = self.live[drawn[position]]
        return perm

    def destinations(self, boundary: int, step: int, samples: range | list[int], replica: int) -> list[int]:
        """For each sample, the replica of stage ``boundary + 1`` that ``replica`` sends it to."""
        return [self.permutation(boundary, step, s)[replica] for s in samples]

    def sources(self, boundary: int, step: int, samples: range | list[int], replica: int) -> list[int]:
        """For each sample, the replica of stage ``boundary`` that ``replica`` of stage ``boundary + 1``
        receives it from."""
        return [self.permutation(boundary, step, s).index(replica) for s in samples]


def group_rows_by_peer(peers: list[int]) -> dict[int, list[int]]:
    """``{peer: [row indices in ascending order]}``; both ends of a message list its rows in this order."""
    groups: dict[int, list[int]] = {}
    for row, peer in enumerate(peers):
        groups.setdefault(peer, []).append(row)
    return groups
