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
  messages on the same links, for the time each replica is blocked.

What this is not (yet): checked against real runs, or extrapolated to a thousand replicas.
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

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        for link in self.links.values():
            if link.jitter and link.rng is None:
                link.rng = self.rng

    def link(self, src: int, dst: int) -> Link:
        if (src, dst) not in self.links:
            self.links[src, dst] = Link(self.bandwidth, self.latency, self.jitter, self.rng)
        return self.links[src, dst]

    def bytes_per_link(self) -> dict[tuple[int, int], float]:
        return {pair: link.bytes_sent for pair, link in sorted(self.links.items()) if link.messages}

    def reset(self) -> None:
        """Every link free at time 0, its counts zeroed."""
        for link in self.links.values():
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
