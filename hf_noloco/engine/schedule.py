"""The plan of one pipeline step, and a check that no plan can deadlock under NCCL. Pure: no communication.

A stage replica's step is a list of :class:`Compute` (the forward or backward of one microbatch) and
:class:`Post` (one ``batch_isend_irecv``: some sends and receives posted together). :func:`step_plan` builds
it; the engine (:mod:`hf_noloco.engine.pipeline`) runs exactly that list, and :func:`find_deadlock` checks
the lists of all ranks together.

Why the batching matters: NCCL runs a rank's point-to-point operations in posting order on one stream, and a
send of a large message waits until its receiver has posted the matching receive (so does gloo, whatever the
size). If every send and every receive were posted on its own, 1F1B would deadlock: with two stages, stage 0
posts [send x0][send x1][recv g0] while stage 1 posts [recv x0][send g0][recv x1], and ``send x1`` waits for
``recv x1``, behind ``send g0``, which waits for ``recv g0``, behind ``send x1``. So, as
``torch.distributed.pipelining`` does, every communication between two computes goes into ONE batch: the sends
of the compute just done with the receives of the next one (a forward send with the next backward receive, a
backward send with the next forward receive). :func:`find_deadlock` proves it over every schedule, mesh and
routing the tests try.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hf_noloco.engine.capacity import boundary_pairs
from hf_noloco.engine.routing import Router, group_rows_by_peer
from hf_noloco.engine.shape import rank_of
from hf_noloco.rules import PIPELINE_SCHEDULES, check_choice

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"


def pipeline_order(schedule: str, num_micro: int, num_stages: int, stage: int) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs the forward ("F"), backward ("B") and weight gradient ("W") of each
    microbatch.

    ``gpipe``: every forward, then every backward. ``1f1b``: ``num_stages - stage - 1`` warm-up forwards, then
    one forward and one backward in turn, then the remaining backwards; a stage then holds the activations of
    at most ``num_stages - stage`` microbatches instead of all of them. ``zb-h1``: 1F1B's forwards and
    backwards in 1F1B's order, where a backward is the input gradient alone and each microbatch's weight
    gradient is a "W" of its own, placed by :func:`_zero_bubble_orders` (the first stage has no input gradient
    to send: its "B" is the whole backward and it has no "W"). ``forward``: the forwards alone (evaluation).
    """
    if schedule == "forward":
        return [(FORWARD, m) for m in range(num_micro)]
    check_choice("pipeline_schedule", schedule, PIPELINE_SCHEDULES)
    if schedule == "gpipe":
        return [(FORWARD, m) for m in range(num_micro)] + [(BACKWARD, m) for m in range(num_micro)]
    if schedule == "zb-h1":
        return list(_zero_bubble_orders(num_micro, num_stages)[stage])
    return _one_f_one_b(num_micro, num_stages, stage)


def _one_f_one_b(num_micro: int, num_stages: int, stage: int) -> list[tuple[str, int]]:
    warmup = min(num_stages - stage - 1, num_micro)
    order = [(FORWARD, m) for m in range(warmup)]
    for m in range(warmup, num_micro):
        order += [(FORWARD, m), (BACKWARD, m - warmup)]
    order += [(BACKWARD, m) for m in range(num_micro - warmup, num_micro)]
    return order


def held_limit(schedule: str, num_micro: int, num_stages: int, stage: int) -> int:
    """The most microbatches whose activations ``stage`` holds at once (forward done, weight gradient not):
    ``num_stages - stage`` under 1F1B; under ZB-H1 1F1B's first stage's ``num_stages`` on every stage, so the
    pipeline's peak (the first stage's) is 1F1B's; all of them under GPipe."""
    if schedule == "1f1b":
        return min(num_stages - stage, num_micro)
    if schedule == "zb-h1":
        return min(num_stages, num_micro)
    return num_micro


@functools.lru_cache(maxsize=256)
def _zero_bubble_orders(num_micro: int, num_stages: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Every stage's ZB-H1 order: where each deferred "W" goes, by simulating the step with every F, B and W
    taking one unit of time (the first stage's whole backward two), messages none.

    A stage runs its next F or B (1F1B's sequence) as soon as its input has arrived; while it waits, a
    deferred W fills the gap (oldest first: gradients then accumulate in microbatch order, as 1F1B's do), and
    the rest run at the end. A deferred W keeps its microbatch's activations, so before a forward the
    microbatches held (forward done, W not) are brought under :func:`held_limit` by running Ws: stage ``s``
    defers at most ``s`` Ws beyond 1F1B's ``num_stages - s`` held, so no stage holds more than 1F1B's first
    stage does, and the first stage, which defers none, holds what it holds under 1F1B: the pipeline's peak is
    1F1B's (ZB-H1's bound; a stage after the first holds more than under 1F1B). Bounding each stage by its own
    1F1B count instead would defer nothing in this model: each W would run right behind its B, which only
    hands gradients upstream a W sooner (a bubble of 2 units instead of 1 at 2 stages and 2 microbatches,
    against 1F1B's 3). Every rank derives the same orders from the same two numbers.
    """
    cost = {FORWARD: 1, BACKWARD: 1, WEIGHT: 1}
    sequences = [_one_f_one_b(num_micro, num_stages, s) for s in range(num_stages)]
    position = [0] * num_stages
    deferred: list[list[int]] = [[] for _ in range(num_stages)]
    held = [0] * num_stages
    free_at = [0] * num_stages
    done_at: dict[tuple[int, str, int], int] = {}
    orders: list[list[tuple[str, int]]] = [[] for _ in range(num_stages)]

    def ready(s: int, phase: str, m: int, now: int) -> bool:
        if phase == FORWARD:
            return s == 0 or done_at.get((s - 1, FORWARD, m), now + 1) <= now
        return s == num_stages - 1 or done_at.get((s + 1, BACKWARD, m), now + 1) <= now

    now = 0
    while any(position[s] < len(sequences[s]) or deferred[s] for s in range(num_stages)):
        for s in range(num_stages):
            if free_at[s] > now:
                continue
            nxt = sequences[s][position[s]] if position[s] < len(sequences[s]) else None
            limit = held_limit("zb-h1", num_micro, num_stages, s)
            must_free = nxt is not None and nxt[0] == FORWARD and held[s] >= limit
            if nxt is not None and not must_free and ready(s, *nxt, now):
                phase, m = nxt
                position[s] += 1
                took = cost[phase] * (2 if phase == BACKWARD and s == 0 else 1)
                if phase == FORWARD:
                    held[s] += 1
                elif s == 0:
                    held[s] -= 1
                else:
                    deferred[s].append(m)
            elif deferred[s] and (nxt is None or must_free or not ready(s, *nxt, now)):
                phase, m = WEIGHT, deferred[s].pop(0)
                held[s] -= 1
                took = cost[WEIGHT]
            else:
                continue
            orders[s].append((phase, m))
            free_at[s] = now + took
            done_at[s, phase, m] = now + took
        now += 1
    return tuple(tuple(order) for order in orders)


@dataclass(frozen=True)
class Message:
    """Rows ``rows`` of microbatch ``microbatch`` going from global rank ``src`` to ``dst``: activations (and
    their per-row record) for ``FORWARD``, their gradients for ``BACKWARD``. ``rows`` are the sender's row
    indices; ``into`` the receiver's, in the same order (``None``: the same indices, as whenever every replica
    computes the same rows per microbatch)."""

    phase: str
    microbatch: int
    src: int
    dst: int
    rows: tuple[int, ...]
    into: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PeerRows:
    """The rows one rank exchanges with one peer in a microbatch when the two hold different row indices
    (capacity routing): ``mine[k]`` here is ``theirs[k]`` there."""

    mine: tuple[int, ...]
    theirs: tuple[int, ...]


@dataclass(frozen=True)
class Post:
    """One batch of point-to-point operations, posted together."""

    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


@dataclass(frozen=True)
class Compute:
    phase: str
    microbatch: int


# For microbatch m: ({rank of the previous stage: rows}, {rank of the next stage: rows}), the rows as indices
# both ends share or as PeerRows. A row goes to the same rank in the backward as it came from in the forward,
# so one function serves both phases.
Links = Callable[[int], tuple[Mapping[int, Sequence[int]], Mapping[int, Sequence[int]]]]


def routed_links(
    router: Router, num_stages: int, stage: int, replica: int, step: int, first_sample: int, micro: int
) -> Links:
    """The peers of ``replica`` of ``stage`` for each microbatch of a step, as ``router`` pairs the replicas
    at the stage's two boundaries. ``first_sample`` is the replica's sample counter at the start of the
    step."""

    def by_rank(replicas: list[int], peer_stage: int) -> dict[int, list[int]]:
        return {rank_of(r, peer_stage, num_stages): rows for r, rows in group_rows_by_peer(replicas).items()}

    def links(m: int):
        samples = range(first_sample + m * micro, first_sample + (m + 1) * micro)
        previous = following = {}
        if stage > 0:
            previous = by_rank(router.sources(stage - 1, step, samples, replica), stage - 1)
        if stage < num_stages - 1:
            following = by_rank(router.destinations(stage, step, samples, replica), stage + 1)
        return previous, following

    return links


# rows[stage][m][replica]: the rows each replica of each stage computes in microbatch m (capacity routing).
RowCounts = Sequence[Sequence[Sequence[int]]]


def capacity_links(
    router: Router,
    rows: RowCounts,
    num_stages: int,
    stage: int,
    replica: int,
    step: int,
    first_sample: int,
    micro: int,
) -> Links:
    """:func:`routed_links` when replicas compute unequal rows (capacity routing): ``rows[s][m][r]`` rows for
    replica ``r`` of stage ``s`` in microbatch ``m``. At a boundary where both stages hold ``micro`` rows on
    every replica the peers are exactly :func:`routed_links`'s (today's routing, bit for bit); elsewhere the
    rows are matched by :func:`~hf_noloco.engine.capacity.boundary_pairs`, within the router's groups, drawn
    from ``(seed, boundary, step, m)`` (``sample`` granularity) or ``(seed, boundary, step)`` (``step``),
    and each peer's rows come as :class:`PeerRows`."""
    if router.granularity == "fixed":
        raise ValueError("Capacity routing needs random routing (routing='sample' or 'step'), not 'fixed'.")
    routed = routed_links(router, num_stages, stage, replica, step, first_sample, micro)

    def equal(boundary: int, m: int) -> bool:
        return all(c == micro for s in (boundary, boundary + 1) for c in rows[s][m])

    @functools.cache
    def pairs(boundary: int, m: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
        wave = m if router.granularity == "sample" else -1
        return boundary_pairs(
            list(rows[boundary][m]), list(rows[boundary + 1][m]), router.group_size, router.seed, boundary,
            step, wave,
        )  # fmt: skip

    def links(m: int):
        # today's peers, drawn only where a boundary's rows are equal on both sides
        upstream_equal = stage == 0 or equal(stage - 1, m)
        downstream_equal = stage == num_stages - 1 or equal(stage, m)
        previous, following = routed(m) if upstream_equal or downstream_equal else ({}, {})
        if not upstream_equal:
            previous = {
                rank_of(src, stage - 1, num_stages): PeerRows(tuple(j for _, j in p), tuple(i for i, _ in p))
                for (src, dst), p in sorted(pairs(stage - 1, m).items())
                if dst == replica
            }
        if not downstream_equal:
            following = {
                rank_of(dst, stage + 1, num_stages): PeerRows(tuple(i for i, _ in p), tuple(j for _, j in p))
                for (src, dst), p in sorted(pairs(stage, m).items())
                if src == replica
            }
        return previous, following

    return links


def mesh_plans(
    schedule: str,
    num_stages: int,
    router: Router,
    num_micro: int,
    micro: int,
    step: int = 0,
    first_sample: int = 0,
    rows: RowCounts | None = None,
) -> dict[int, list]:
    """The plan of one step of every rank of a ``router.num_replicas`` x ``num_stages`` mesh (what
    :func:`find_deadlock` checks); with ``rows``, under capacity routing (:func:`capacity_links`)."""
    plans = {}
    for replica in range(router.num_replicas):
        for stage in range(num_stages):
            if rows is None:
                links = routed_links(router, num_stages, stage, replica, step, first_sample, micro)
            else:
                links = capacity_links(router, rows, num_stages, stage, replica, step, first_sample, micro)
            rank = rank_of(replica, stage, num_stages)
            plans[rank] = step_plan(schedule, num_micro, num_stages, stage, rank, links)
    return plans


def step_plan(schedule: str, num_micro: int, num_stages: int, stage: int, rank: int, links: Links) -> list:
    """The plan of one step of global rank ``rank`` (of ``stage``): its computes in
    :func:`pipeline_order`, and between two computes the sends of the first and the receives of the second.

    They go into ONE batch when the neighbour they are exchanged with does the mirror image: a forward's sends
    with the next backward's receives when the next stage runs that backward right before that forward (and
    the reverse); the steady state of 1F1B, which could not complete otherwise (see the module's docstring).
    Everywhere else (warm-up and cool-down, GPipe, evaluation) the sends are posted first, then the receives,
    in two batches: a batch that held operations matched by two different batches of one neighbour could only
    complete if both ran at once, which a stream never does (:func:`find_deadlock`'s atomic reading).

    A "W" (zb-h1) exchanges nothing and is invisible to the pairing: the batches are those of the order
    without its Ws, and each is posted right after the compute whose sends it carries, before the Ws that
    follow, so a gradient leaves before the weight gradients that nobody waits for (the engine waits for a
    batch's receives only when the compute that needs them comes)."""
    order = pipeline_order(schedule, num_micro, num_stages, stage)
    neighbours = {
        side: _successors(_exchanging(pipeline_order(schedule, num_micro, num_stages, stage + side)))
        for side in (-1, 1)
        if 0 <= stage + side < num_stages
    }
    is_first, is_last = stage == 0, stage == num_stages - 1
    plan, sends, weights = [], [], []
    links = functools.lru_cache(maxsize=None)(links)  # each microbatch's peers, drawn once for F and B

    def messages(peers: Mapping, phase: str, m: int, outgoing: bool) -> list[Message]:
        found = []
        for peer, rows in peers.items():
            if isinstance(rows, PeerRows):  # the sender's indices travel as `rows`, the receiver's as `into`
                sent, into = (rows.mine, rows.theirs) if outgoing else (rows.theirs, rows.mine)
            else:
                sent, into = tuple(rows), None
            src, dst = (rank, peer) if outgoing else (peer, rank)
            found.append(Message(phase, m, src, dst, sent, into))
        return found

    done = None  # the compute just done, whose sends are pending
    for phase, m in order:
        if phase == WEIGHT:
            weights.append(Compute(WEIGHT, m))
            continue
        previous, following = links(m)
        recvs = []
        if phase == FORWARD and not is_first:
            recvs = messages(previous, FORWARD, m, outgoing=False)
        if phase == BACKWARD and not is_last:
            recvs = messages(following, BACKWARD, m, outgoing=False)
        if sends and recvs and _mirrored(done, (phase, m), neighbours):
            plan.append(Post(tuple(sends), tuple(recvs)))
        else:
            plan += [Post(tuple(sends), ())] if sends else []
            plan += [Post((), tuple(recvs))] if recvs else []
        plan += weights
        plan.append(Compute(phase, m))
        done, sends, weights = (phase, m), [], []
        if phase == FORWARD and not is_last:
            sends = messages(following, FORWARD, m, outgoing=True)
        if phase == BACKWARD and not is_first:
            sends = messages(previous, BACKWARD, m, outgoing=True)
    if sends:
        plan.append(Post(tuple(sends), ()))
    return plan + weights


def _exchanging(order: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """The computes of an order that exchange messages (all but the Ws)."""
    return [item for item in order if item[0] != WEIGHT]


def _successors(order: Sequence[tuple[str, int]]) -> dict[tuple[str, int], tuple[str, int]]:
    """``{compute: the compute right after it}`` of one stage's order."""
    return dict(zip(order, order[1:]))


def _mirrored(done, following, neighbours) -> bool:
    """Whether the sends of ``done`` and the receives of ``following`` are exchanged with one neighbour that
    runs the two matching computes back to back, the other way round."""
    if done is None:
        return False
    (phase_a, a), (phase_b, b) = done, following
    if phase_a == FORWARD and phase_b == BACKWARD:  # both with the next stage: its B_b, then its F_a
        return neighbours.get(1, {}).get((BACKWARD, b)) == (FORWARD, a)
    if phase_a == BACKWARD and phase_b == FORWARD:  # both with the previous stage: its F_b, then its B_a
        return neighbours.get(-1, {}).get((FORWARD, b)) == (BACKWARD, a)
    return False


def find_deadlock(plans: Mapping[int, Sequence], atomic: bool = True) -> str | None:
    """Runs the plans of all ranks under NCCL's rules; ``None`` when they all finish, else what is stuck.

    The rules, for one process group: each rank executes its :class:`Post` batches in order, one at a time
    (the stream); an operation completes only when the matching operation of its peer is in the batch the peer
    is executing; a batch ends when all its operations have completed. Computes never wait on other ranks
    (their inputs arrive through the posts before them). Messages between two ranks match in posting order, so
    the order in which ``src`` sends to ``dst`` must be the order in which ``dst`` receives from ``src``.

    ``atomic`` (the default) is the strictest reading of a grouped batch: it completes only together with
    every batch that holds a partner of one of its operations, and those with theirs, all at the heads of
    their streams at once. Whether NCCL lets some operations of a group finish before the group's others
    depends on how it schedules point-to-point work inside a group; a plan safe under this reading is safe
    whatever it does. ``atomic=False``: operations complete one by one, as soon as both ends are running.
    """
    sent: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    streams = {rank: [item for item in plan if isinstance(item, Post)] for rank, plan in plans.items()}
    for rank, posts in streams.items():
        for post in posts:
            for msg in post.sends:
                if msg.src != rank:
                    return f"rank {rank} posts a send of a message from rank {msg.src}: {msg}"
                sent.setdefault((msg.src, msg.dst), []).append(msg)
            for msg in post.recvs:
                if msg.dst != rank:
                    return f"rank {rank} posts a receive of a message for rank {msg.dst}: {msg}"
                received.setdefault((msg.src, msg.dst), []).append(msg)
    for pair in sent.keys() | received.keys():
        if sent.get(pair, []) != received.get(pair, []):
            return (
                f"rank {pair[0]} sends {_names(sent.get(pair, []))} to rank {pair[1]}, which receives "
                f"{_names(received.get(pair, []))}: unmatched or out of order"
            )

    if atomic:
        return _atomic_deadlock(streams)
    head = dict.fromkeys(streams, 0)
    done: set[tuple[str, Message]] = set()  # ("send" or "recv", message)
    progress = True
    while progress:
        progress = False
        running = {rank: posts[head[rank]] for rank, posts in streams.items() if head[rank] < len(posts)}
        for post in running.values():
            for msg in post.sends:
                peer = running.get(msg.dst)
                if ("send", msg) not in done and peer is not None and msg in peer.recvs:
                    done.update({("send", msg), ("recv", msg)})
                    progress = True
        for rank, post in running.items():
            if all(("send", m) in done for m in post.sends) and all(("recv", m) in done for m in post.recvs):
                head[rank] += 1
                progress = True
    stuck = {rank: posts[head[rank]] for rank, posts in streams.items() if head[rank] < len(posts)}
    if not stuck:
        return None
    lines = []
    for rank, post in sorted(stuck.items()):
        waiting = [f"send {_name(m)} to rank {m.dst}" for m in post.sends if ("send", m) not in done]
        waiting += [f"recv {_name(m)} from rank {m.src}" for m in post.recvs if ("recv", m) not in done]
        lines.append(f"rank {rank} waits to {', '.join(waiting)}")
    return "deadlock: " + "; ".join(lines)


def _atomic_deadlock(streams: Mapping[int, list[Post]]) -> str | None:
    """:func:`find_deadlock` under the atomic reading: a batch completes only with the closure of the batches
    holding its operations' partners, all at the heads of their streams."""
    head = dict.fromkeys(streams, 0)
    where = {}  # (kind, message) -> (rank, index of the batch that holds it)
    for rank, posts in streams.items():
        for i, post in enumerate(posts):
            where.update({("send", m): (rank, i) for m in post.sends})
            where.update({("recv", m): (rank, i) for m in post.recvs})

    def closure(rank: int) -> set[int] | None:
        """The ranks whose head batches must complete with ``rank``'s, or None if one of them is not at its
        head."""
        group, todo = set(), [rank]
        while todo:
            r = todo.pop()
            if r in group:
                continue
            group.add(r)
            post = streams[r][head[r]]
            partners = [where[("recv", m)] for m in post.sends] + [where[("send", m)] for m in post.recvs]
            for peer, index in partners:
                if head[peer] != index:
                    return None
                todo.append(peer)
        return group

    progress = True
    while progress:
        progress = False
        for rank in streams:
            if head[rank] < len(streams[rank]):
                group = closure(rank)
                if group is not None:
                    for r in group:
                        head[r] += 1
                    progress = True
    stuck = {rank: posts[head[rank]] for rank, posts in streams.items() if head[rank] < len(posts)}
    if not stuck:
        return None
    lines = []
    for rank, post in sorted(stuck.items()):
        ops = [f"send {_name(m)} to rank {m.dst}" for m in post.sends]
        ops += [f"recv {_name(m)} from rank {m.src}" for m in post.recvs]
        lines.append(f"rank {rank} waits in a batch of [{', '.join(ops)}]")
    return "deadlock (atomic batches): " + "; ".join(lines)


def _name(msg: Message) -> str:
    return f"{'x' if msg.phase == FORWARD else 'g'}{msg.microbatch}"


def _names(messages: Sequence[Message]) -> str:
    return "[" + ", ".join(_name(m) for m in messages) + "]"
