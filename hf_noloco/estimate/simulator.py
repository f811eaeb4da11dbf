"""A discrete-event simulator of a step's messages and an outer step's exchange. Pure: plain Python.

The model:

* A :class:`Link` is one direction between two ranks: a bandwidth (bytes/s) and a latency (s). Its messages
  go one at a time, first in first out, in the order their sender produced them: a message starts when the
  link is free and its sender has produced it, holds the link for ``bytes / bandwidth`` (serialization), and
  arrives ``latency`` after that. The latency is the wire's (a message in flight does not hold the link), so
  two messages of ``b`` bytes produced together at 0 arrive at ``latency + b / bw`` and
  ``latency + 2 * b / bw``. An optional log-normal jitter multiplies each message's latency by a draw of mean
  1 (``jitter`` the log's standard deviation) from a seeded :class:`random.Random`.
* :func:`simulate_step` replays the engine's own plan of a step (:func:`hf_noloco.engine.schedule.mesh_plans`,
  the list of computes and posts each rank runs): a compute starts when its rank is free and every message
  its posts before it receive has arrived; it takes its stage's time for its phase; the sends of a post leave
  when the rank reaches the post (when the compute whose output they carry is done). Posts are asynchronous,
  as the engine's are (it waits for a batch's receives only when the compute that needs them comes); a send
  never waits for its receiver here.
* :func:`pair_exchange` (NoLoCo) and :func:`ring_all_reduce` (DiLoCo) are an outer step's exchanges as
  messages on the same links, for the time each replica is blocked; :func:`group_exchange`,
  :func:`ring_collective` (all-reduce or all-gather, several rings in lockstep) and :func:`tree_all_reduce`
  (a pipelined binary tree) take each rank's own start time and return when each rank has what it waits for.
* Nodes: with ``procs_per_node`` set, ranks ``[k * procs_per_node, (k + 1) * procs_per_node)`` are node ``k``
  (as torchrun numbers them) and every message to another node goes through its sender node's one *uplink*
  (a :class:`Link` of the network's bandwidth, latency and jitter, shared by all of the node's ranks, FIFO),
  as on a machine whose NIC egress is the bottleneck (or a ``tc tbf`` on it); messages inside a node take
  per-pair links of ``intra_bandwidth`` / ``intra_latency``. Ingress is not modelled (a receiver takes
  what arrives at once).
* :func:`simulate_outer_periods` chains whole outer periods: per replica column, ``H`` inner steps of given
  times (from :func:`simulate_step`, times optional log-normal straggler factors), then the outer step's
  exchange over the stage's replicas (NoLoCo: :func:`hf_noloco.outer.gossip.gossip_groups`' partners;
  DiLoCo: a ring or tree all-reduce, or the ring all-gather of compressed packets), blocking or overlapped
  with the next ``tau`` inner steps, and the outer update's own compute time;
  dropped replicas (``live``) train alone.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hf_noloco.engine.routing import Router
from hf_noloco.engine.schedule import BACKWARD, FORWARD, WEIGHT, Compute, Message, Post, mesh_plans
from hf_noloco.engine.shape import rank_of


@dataclass
class Link:
    """One direction between two ranks; FIFO: its messages go one after another (see the module)."""

    bandwidth: float  # bytes/s
    latency: float = 0.0  # s
    jitter: float = 0.0  # sigma of the log-normal factor on each message's latency (0: none)
    rng: random.Random | None = None
    free_at: float = 0.0
    last_arrival: float = 0.0
    bytes_sent: float = 0.0
    messages: int = 0

    def __post_init__(self):
        if self.bandwidth <= 0 or self.latency < 0 or self.jitter < 0:
            raise ValueError(f"a link needs bandwidth > 0, latency >= 0, jitter >= 0: {self}")

    def transfer(self, nbytes: float, ready: float) -> float:
        """Sends ``nbytes`` produced at ``ready`` behind the link's earlier messages; returns its arrival."""
        start = max(self.free_at, ready)
        self.free_at = start + nbytes / self.bandwidth
        latency = self.latency
        if self.jitter:
            rng = self.rng if self.rng is not None else random.Random(0)
            self.rng = rng
            latency *= rng.lognormvariate(-(self.jitter**2) / 2, self.jitter)  # mean 1
        self.bytes_sent += nbytes
        self.messages += 1
        self.last_arrival = max(self.free_at + latency, self.last_arrival)  # jitter never reorders a link
        return self.last_arrival


@dataclass
class Network:
    """Every directed link between ranks: those given in ``links``, the others made from the defaults on
    first use (their jitter drawn from one ``random.Random(seed)``)."""

    bandwidth: float = math.inf
    latency: float = 0.0
    jitter: float = 0.0
    seed: int = 0
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    procs_per_node: int | None = None  # set: messages between nodes share their sender node's uplink
    intra_bandwidth: float = math.inf  # inside a node (procs_per_node set)
    intra_latency: float = 0.0
    uplinks: dict[int, Link] = field(default_factory=dict)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        for link in [*self.links.values(), *self.uplinks.values()]:
            if link.jitter and link.rng is None:
                link.rng = self.rng

    def node(self, rank: int) -> int:
        return rank if self.procs_per_node is None else rank // self.procs_per_node

    def link(self, src: int, dst: int) -> Link:
        if self.procs_per_node is not None and self.node(src) != self.node(dst):
            node = self.node(src)
            if node not in self.uplinks:
                self.uplinks[node] = Link(self.bandwidth, self.latency, self.jitter, self.rng)
            return self.uplinks[node]
        if (src, dst) not in self.links:
            if self.procs_per_node is None:
                self.links[src, dst] = Link(self.bandwidth, self.latency, self.jitter, self.rng)
            else:
                self.links[src, dst] = Link(self.intra_bandwidth, self.intra_latency)
        return self.links[src, dst]

    def bytes_per_link(self) -> dict[tuple[int, int], float]:
        """Bytes per directed rank-to-rank link (inside nodes, when ``procs_per_node`` is set)."""
        return {pair: link.bytes_sent for pair, link in sorted(self.links.items()) if link.messages}

    def bytes_per_uplink(self) -> dict[int, float]:
        """Bytes each node sent to other nodes (``procs_per_node`` set)."""
        return {node: link.bytes_sent for node, link in sorted(self.uplinks.items()) if link.messages}

    def reset(self) -> None:
        """Every link free at time 0, its counts zeroed."""
        for link in [*self.links.values(), *self.uplinks.values()]:
            link.free_at, link.last_arrival, link.bytes_sent, link.messages = 0.0, 0.0, 0.0, 0


@dataclass(frozen=True)
class StepResult:
    step_time: float
    busy: dict[int, float]  # rank -> seconds computing
    idle_share: dict[int, float]  # rank -> 1 - busy / step_time
    stage_idle_share: list[float]  # per stage, the mean over its replicas
    bytes_per_link: dict[tuple[int, int], float]
    compute_times: dict[int, list[tuple[str, int, float, float]]]  # rank -> (phase, microbatch, start, end)


def simulate_step(
    schedule: str,
    num_stages: int,
    num_micro: int,
    forward: Sequence[float],
    backward: Sequence[float],
    network: Network,
    row_bytes: float | Mapping[str, float] = 0.0,
    weight: Sequence[float] | None = None,
    micro: int = 1,
    router: Router | None = None,
    step: int = 0,
) -> StepResult:
    """One step of the engine's plan (:func:`~hf_noloco.engine.schedule.mesh_plans`) on ``network``.

    ``forward[s]``, ``backward[s]`` (and, for ``zb-h1``, ``weight[s]``): stage ``s``'s time per microbatch.
    ``row_bytes``: the bytes of one row's message (activations forward, gradients backward; a mapping by
    phase for different sizes); a message holds the rows of a microbatch routed to one peer. ``router``: the
    replicas' pairing (default: one replica column)."""
    router = Router(1, "fixed", 0) if router is None else router
    sizes = row_bytes if isinstance(row_bytes, Mapping) else {FORWARD: row_bytes, BACKWARD: row_bytes}
    weight = [0.0] * num_stages if weight is None else weight
    cost = {FORWARD: forward, BACKWARD: backward, WEIGHT: weight}
    for name, times in cost.items():
        if len(times) != num_stages:
            raise ValueError(f"{name} times: one per stage ({num_stages}), got {len(times)}")
    plans = mesh_plans(schedule, num_stages, router, num_micro, micro, step)
    arrival: dict[Message, float] = {}
    clock = dict.fromkeys(plans, 0.0)
    position = dict.fromkeys(plans, 0)
    waiting: dict[int, list[Message]] = {rank: [] for rank in plans}  # received before the next compute
    busy = dict.fromkeys(plans, 0.0)
    computes: dict[int, list[tuple[str, int, float, float]]] = {rank: [] for rank in plans}
    progress = True
    while progress:
        progress = False
        for rank, plan in plans.items():
            stage = rank % num_stages
            while position[rank] < len(plan):
                item = plan[position[rank]]
                if isinstance(item, Post):
                    for msg in item.sends:
                        nbytes = sizes[msg.phase] * len(msg.rows)
                        arrival[msg] = network.link(msg.src, msg.dst).transfer(nbytes, clock[rank])
                    waiting[rank] += item.recvs
                elif isinstance(item, Compute):
                    needed = [
                        m for m in waiting[rank] if (m.phase, m.microbatch) == (item.phase, item.microbatch)
                    ]
                    if any(m not in arrival for m in needed):
                        break  # its input is not sent yet
                    start = max([clock[rank]] + [arrival[m] for m in needed])
                    took = cost[item.phase][stage]
                    clock[rank] = start + took
                    busy[rank] += took
                    computes[rank].append((item.phase, item.microbatch, start, start + took))
                    waiting[rank] = [m for m in waiting[rank] if m not in needed]
                position[rank] += 1
                progress = True
    stuck = [rank for rank, plan in plans.items() if position[rank] < len(plan)]
    if stuck:
        raise RuntimeError(f"the plan never completes: ranks {stuck} wait for inputs never sent")
    step_time = max([*clock.values(), *arrival.values()], default=0.0)
    idle = {rank: (1 - busy[rank] / step_time) if step_time else 0.0 for rank in plans}
    per_stage = [
        sum(idle[rank_of(r, s, num_stages)] for r in range(router.num_replicas)) / router.num_replicas
        for s in range(num_stages)
    ]
    return StepResult(step_time, busy, idle, per_stage, network.bytes_per_link(), computes)


def one_f_one_b_time(num_stages: int, num_micro: int, forward: float, backward: float) -> float:
    """1F1B's step with every stage's forward ``forward`` and backward ``backward``, messages free:
    ``(m + p - 1) * (t_f + t_b)``."""
    return (num_micro + num_stages - 1) * (forward + backward)


@dataclass(frozen=True)
class ExchangeResult:
    blocked: dict[int, float]  # rank -> seconds from the exchange's start until it has all it waits for
    time: float  # the slowest rank's
    bytes_sent: dict[int, float]  # rank -> bytes it sent


def pair_exchange(
    network: Network, pairs: Sequence[tuple[int, int]], nbytes: float, start: float = 0.0
) -> ExchangeResult:
    """NoLoCo's outer exchange: in each pair, each rank sends its ``nbytes`` to its partner and receives
    theirs, both directions at once (one link each); a rank is blocked until its partner's bytes arrive."""
    blocked, sent = {}, {}
    for a, b in pairs:
        into_b = network.link(a, b).transfer(nbytes, start)
        into_a = network.link(b, a).transfer(nbytes, start)
        blocked[a], blocked[b] = into_a - start, into_b - start
        sent[a] = sent.get(a, 0.0) + nbytes
        sent[b] = sent.get(b, 0.0) + nbytes
    return ExchangeResult(blocked, max(blocked.values(), default=0.0), sent)


def ring_all_reduce(
    network: Network, ranks: Sequence[int], nbytes: float, start: float = 0.0
) -> ExchangeResult:
    """DiLoCo's all-reduce of ``nbytes`` per rank as a ring: ``2 (n - 1)`` steps (reduce-scatter, then
    all-gather), in each of which every rank sends one chunk of ``nbytes / n`` to the next; a rank sends its
    step ``k`` chunk once it has received its step ``k - 1`` chunk (and has reduced it: free here). Each rank
    sends ``2 (n - 1) / n * nbytes``; on equal links the time is ``2 (n - 1) (latency + nbytes / (n bw))``."""
    n = len(ranks)
    if n < 2:
        return ExchangeResult(dict.fromkeys(ranks, 0.0), 0.0, dict.fromkeys(ranks, 0.0))
    chunk = nbytes / n
    ready = dict.fromkeys(ranks, start)  # when each rank may send its next chunk
    for _ in range(2 * (n - 1)):
        received = {}
        for i, rank in enumerate(ranks):
            nxt = ranks[(i + 1) % n]
            received[nxt] = network.link(rank, nxt).transfer(chunk, ready[rank])
        ready = received
    blocked = {rank: ready[rank] - start for rank in ranks}
    sent = dict.fromkeys(ranks, 2 * (n - 1) * chunk)
    return ExchangeResult(blocked, max(blocked.values()), sent)


def ring_all_reduce_time(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """The closed form: ``2 (n - 1) * (latency + nbytes / (n * bandwidth))``."""
    return 2 * (n - 1) * (latency + nbytes / (n * bandwidth)) if n > 1 else 0.0


# ------------------------------------------------------------------------ exchanges with per-rank starts


def _send_in_time_order(network: Network, sends: list[tuple[float, int, int, float]]) -> list[float]:
    """``sends``: ``(ready, src, dst, nbytes)``; transferred in order of ``ready`` (then as listed), so that
    a link shared by several senders (a node's uplink) queues them in the order they were produced.
    Returns each send's arrival, in the order given."""
    arrivals = [0.0] * len(sends)
    for i in sorted(range(len(sends)), key=lambda i: sends[i][0]):
        ready, src, dst, nbytes = sends[i]
        arrivals[i] = network.link(src, dst).transfer(nbytes, ready)
    return arrivals


def group_exchange(
    network: Network,
    groups: Sequence[Sequence[int]],
    nbytes: float | Mapping[int, float],
    ready: Mapping[int, float],
    messages: int = 1,
) -> dict[int, float]:
    """NoLoCo's exchange in gossip groups: at ``ready[rank]`` each rank sends ``messages`` messages of
    ``nbytes`` (or ``nbytes[rank]``) to every other member of its group; returns when each rank has received
    all of its partners' (its own ``ready`` if it has none)."""
    size = nbytes if isinstance(nbytes, Mapping) else None
    sends, receiver = [], []
    for group in groups:
        for src in group:
            for dst in group:
                if src != dst:
                    for _ in range(messages):
                        sends.append((ready[src], src, dst, size[src] if size else nbytes))
                        receiver.append(dst)
    done = {rank: ready[rank] for group in groups for rank in group}
    for dst, arrival in zip(receiver, _send_in_time_order(network, sends)):
        done[dst] = max(done[dst], arrival)
    return done


def ring_collective(
    network: Network,
    rings: Sequence[Sequence[int]],
    nbytes: float | Sequence[float],
    ready: Mapping[int, float],
    kind: str = "all_reduce",
) -> dict[int, float]:
    """Ring collectives over several rings at once (a stage's replicas each; their steps in lockstep, so
    that rings sharing uplinks interleave). ``all_reduce``: ``2 (n - 1)`` steps of a chunk of ``nbytes / n``
    (reduce-scatter, then all-gather); ``all_gather``: ``n - 1`` steps of ``nbytes`` (each rank's packet goes
    round). A rank sends its step ``k`` chunk at its ``ready`` (step 0) or once its step ``k - 1`` chunk has
    arrived; returns when each rank has its last chunk. Equal links, equal starts: the all-reduce takes
    ``2 (n - 1) (latency + nbytes / (n bw))`` (:func:`ring_all_reduce_time`)."""
    if kind not in ("all_reduce", "all_gather"):
        raise ValueError(f"kind must be all_reduce or all_gather, got {kind!r}")
    sizes = list(nbytes) if isinstance(nbytes, Sequence) else [nbytes] * len(rings)
    at = {rank: ready[rank] for ring in rings for rank in ring}
    steps = [(2 * (len(r) - 1) if kind == "all_reduce" else len(r) - 1) for r in rings]
    chunks = [(b / len(r) if kind == "all_reduce" else b) for r, b in zip(rings, sizes)]
    for step in range(max(steps, default=0)):
        sends = []
        for ring, n_steps, chunk in zip(rings, steps, chunks):
            if step < n_steps:
                n = len(ring)
                sends += [(at[ring[i]], ring[i], ring[(i + 1) % n], chunk) for i in range(n)]
        for (_, _, dst, _), arrival in zip(sends, _send_in_time_order(network, sends)):
            at[dst] = max(at[dst], arrival)
    return at


def tree_all_reduce(
    network: Network,
    ranks: Sequence[int],
    nbytes: float,
    ready: Mapping[int, float],
    segments: int = 8,
) -> dict[int, float]:
    """An all-reduce over a binary tree (position ``i``'s parent is ``(i - 1) // 2``), pipelined in
    ``segments`` segments: a rank sends segment ``k`` up once it has its own (at ``ready``) and its
    children's; the root sends the reduced segment down, each rank passes it on to its children. Every
    rank sends ``nbytes`` up and ``nbytes`` to each child (an inner rank: 3 ``nbytes``, all on its uplink
    when ranks are nodes); on per-pair links the time is :func:`tree_all_reduce_time`. Returns when each rank
    has the whole reduced buffer. One tree, not NCCL's two complementary ones."""
    n = len(ranks)
    if n < 2:
        return {rank: ready[rank] for rank in ranks}
    seg = nbytes / segments
    children = {i: [c for c in (2 * i + 1, 2 * i + 2) if c < n] for i in range(n)}
    # Up, every segment (each rank's sends up are one stream on its link), then down: on a shared uplink
    # a rank's sends down queue behind its sends up (FIFO), as many bytes as if they interleaved.
    up_free = [ready[rank] for rank in ranks]  # when position i may send its next segment up
    reduced = []  # per segment: when the root has it
    for _ in range(segments):
        have = list(up_free)  # this segment reduced at position i (its own and its subtree's)
        for i in range(n - 1, 0, -1):  # children before parents
            parent = (i - 1) // 2
            arrival = network.link(ranks[i], ranks[parent]).transfer(seg, have[i])
            have[parent] = max(have[parent], arrival)
        up_free = have
        reduced.append(have[0])
    done = [ready[rank] for rank in ranks]
    for root_has in reduced:
        down = [0.0] * n
        down[0] = root_has
        for i in range(n):
            for c in children[i]:
                down[c] = max(down[c], network.link(ranks[i], ranks[c]).transfer(seg, down[i]))
        done = [max(d, x) for d, x in zip(done, down)]
    return {rank: done[i] for i, rank in enumerate(ranks)}


def tree_all_reduce_time(n: int, nbytes: float, bandwidth: float, latency: float, segments: int = 8) -> float:
    """:func:`tree_all_reduce`'s time on equal, jitter-free per-pair links (no shared uplinks) and equal
    starts: the last segment reaches the root after ``depth`` latencies and ``segments + depth - 1``
    serializations, and the deepest rank ``depth`` hops later: ``2 depth latency + (2 depth + segments - 1)
    nbytes / (segments bw)``, ``depth = floor(log2 n)``."""
    if n < 2:
        return 0.0
    depth = int(math.floor(math.log2(n)))
    return 2 * depth * latency + (2 * depth + segments - 1) * nbytes / segments / bandwidth


# ------------------------------------------------------------------------------------- outer periods


@dataclass(frozen=True)
class PeriodResult:
    time: float  # until every replica has applied the last outer step
    period_time: float  # ``time / periods``
    step_time: float  # ``time / (periods * inner_steps)``
    blocked: list[float]  # per outer step: mean over replicas of the time it waited for the exchange
    blocked_max: list[float]  # per outer step: the most any replica waited
    exchange: list[float]  # per outer step: from the first replica's start to the last replica's done
    bytes_per_uplink: dict[int, float]
    bytes_per_link: dict[tuple[int, int], float]
    clocks: list[float]  # per replica, its final time


def _gossip_groups(live: list[int], group_size: int, seed: int, outer_step: int) -> list[list[int]]:
    from hf_noloco.outer.gossip import live_gossip_groups

    return [g for g in live_gossip_groups(live, group_size, seed, outer_step) if len(g) > 1]


def simulate_outer_periods(
    method: str,
    num_replicas: int,
    num_stages: int,
    step_time: float | Sequence[float],
    stage_bytes: Sequence[float],
    network: Network,
    inner_steps: int,
    overlap_steps: int = 0,
    periods: int = 1,
    outer_compute: float = 0.0,
    gossip_group_size: int = 2,
    seed: int = 0,
    messages: int = 1,
    collective: str = "ring",
    straggler: float = 0.0,
    slow: Mapping[int, float] | None = None,
    coupled: bool = False,
    first_outer_step: int = 0,
    tree_segments: int = 8,
    phase: int = 0,
    live: Sequence[int] | None = None,
) -> PeriodResult:
    """``periods`` outer periods of ``num_replicas`` replica columns (rank ``replica * num_stages + stage``).

    Each column runs inner steps of ``step_time`` (one value, or one per inner step of a period), times
    ``slow[replica]`` and, with ``straggler`` > 0, a seeded log-normal factor of mean 1 per replica and step;
    with ``coupled`` (routing across replicas) every step ends when the slowest column's does. After inner
    step ``p * H`` (``H = inner_steps``) the outer step ``p`` starts on every stage of the column at once:

    * ``noloco``: each rank sends ``messages`` copies of ``stage_bytes[stage]`` to its gossip partners
      (:func:`hf_noloco.outer.gossip.gossip_groups` of outer step ``first_outer_step + p - 1``, ``seed``);
    * ``diloco``: the stage's replicas all-reduce ``stage_bytes[stage]`` (``collective`` ``"ring"`` or
      ``"tree"``), or all-gather packets of that size (``"gather"``: the compressed wires);
    * ``local``: nothing.

    It is applied ``overlap_steps`` (tau) inner steps later (0: at once, the exchange blocks): the column
    waits until every one of its stages has what it needs, then spends ``outer_compute``. A last outer step
    whose tau steps would fall beyond the run is applied at its end (as ``finish_outer_step`` does). The
    column's stages move together (their pipeline couples them); pipeline messages are inside
    ``step_time``, so exchanges have the links to themselves (each column on its own node). ``phase``:
    outer step ``p`` starts after inner step ``p * H - phase`` (a measured window that begins right after an
    outer step was applied and ends when the next one is: ``phase = tau``, ``periods = 1``). ``live``: the
    replicas that take part in outer steps (default all); the others were dropped (``on_replica_loss:
    continue``) and train alone: NoLoCo draws its groups among the live ones
    (:func:`hf_noloco.outer.gossip.live_gossip_groups`), DiLoCo's ring or tree spans them."""
    if method not in ("noloco", "diloco", "local"):
        raise ValueError(f"method must be noloco, diloco or local, got {method!r}")
    if collective not in ("ring", "tree", "gather"):
        raise ValueError(f"collective must be ring, tree or gather, got {collective!r}")
    if (
        not 0 <= overlap_steps <= inner_steps
        or len(stage_bytes) != num_stages
        or not 0 <= phase < inner_steps
    ):
        raise ValueError("need 0 <= overlap_steps <= inner_steps, 0 <= phase < H, one stage_bytes per stage")
    times = [step_time] * inner_steps if isinstance(step_time, (int, float)) else list(step_time)
    if len(times) != inner_steps:
        raise ValueError(f"step_time: one value or one per inner step ({inner_steps}), got {len(times)}")
    rng = random.Random(seed * 7919 + 17)
    slow = slow or {}
    n, pp = num_replicas, num_stages
    clock = [0.0] * n
    pending: dict[int, tuple[int, list[float], list[float]]] = {}  # apply step -> (p, done, started)
    blocked, blocked_max, spans = [], [], []

    def start(p: int) -> None:
        ready = {r * pp + s: clock[r] for r in range(n) for s in range(pp)}
        done = {}
        members = list(range(n)) if live is None else sorted(live)
        if method == "noloco" and len(members) > 1:
            groups = _gossip_groups(members, gossip_group_size, seed, first_outer_step + p - 1)
            for s in range(pp):
                stage_groups = [[r * pp + s for r in g] for g in groups]
                done.update(group_exchange(network, stage_groups, stage_bytes[s], ready, messages))
        elif method == "diloco" and len(members) > 1:
            rings = [[r * pp + s for r in members] for s in range(pp)]
            if collective == "tree":
                for s in range(pp):
                    done.update(tree_all_reduce(network, rings[s], stage_bytes[s], ready, tree_segments))
            else:
                kind = "all_gather" if collective == "gather" else "all_reduce"
                done.update(ring_collective(network, rings, list(stage_bytes), ready, kind))
        done = {rank: done.get(rank, ready[rank]) for rank in ready}  # a dropped replica waits for nobody
        column = [max(done[r * pp + s] for s in range(pp)) for r in range(n)]
        spans.append(max(column) - min(clock))
        apply_at = p * inner_steps - phase + overlap_steps
        pending[min(apply_at, periods * inner_steps)] = (p, column, list(clock))

    def apply(step: int) -> None:
        if step not in pending:
            return
        _, column, _ = pending.pop(step)
        waits = [max(0.0, column[r] - clock[r]) for r in range(n)]
        for r in range(n):
            clock[r] = max(clock[r], column[r]) + outer_compute
        blocked.append(sum(waits) / n)
        blocked_max.append(max(waits))

    total = periods * inner_steps
    for k in range(1, total + 1):
        base = times[(k - 1) % inner_steps]
        for r in range(n):
            factor = slow.get(r, 1.0)
            if straggler:
                factor *= rng.lognormvariate(-(straggler**2) / 2, straggler)
            clock[r] += base * factor
        if coupled:
            clock = [max(clock)] * n
        if method != "local":
            apply(k)  # the previous outer step, tau = H: applied before the next one starts
            if (k + phase) % inner_steps == 0:
                start((k + phase) // inner_steps)
                apply(k)  # tau = 0: at once (and the last one, at the run's end)
    end = max(clock)
    return PeriodResult(
        end,
        end / periods,
        end / total,
        blocked,
        blocked_max,
        spans,
        network.bytes_per_uplink(),
        network.bytes_per_link(),
        clock,
    )
