"""Which replica columns are still in the run (``on_replica_loss="continue"``), agreed through the store.

NoLoCo's training path has no collective over the replicas: samples travel point to point and outer steps are
pairwise. So a lost rank need not stop the others; its whole replica column (every stage of that replica) is
dropped, and the rest train on. What the survivors need is agreement on who is left, with no hang and no split
brain. The rendezvous store provides it, as long as it outlives every worker (``hf_noloco.column_launch``
keeps it out of them).

**Views.** View 0 is every column. View ``e + 1`` is proposed by the first rank that finds a lost peer: a
communication error, or a peer whose heartbeat (:class:`~hf_noloco.resilience.watch.PeerWatch`) has been
silent for ``silence`` seconds. Its proposal (the live columns minus those of the ranks whose heartbeat
stopped) is written with ``compare_set``, so the first writer wins and everyone adopts the stored value. A
rank of a dropped column, or a frozen rank that wakes up to find itself left out, raises
:class:`ReplicaDropped`.

**Fences.** Every training step starts with a fence: a barrier through the store among the live ranks of the
view. So at any moment all live ranks are in the same step, and a view change always takes effect at the next
fence, the same one for everyone. Between the proposal and that fence a rank is *offline*: every wait raises
at once (:func:`hf_noloco.engine.comm.interrupt_waits_on`), and the trainer finishes the step without
communication (the step's gradients dropped, no outer averaging, local logs, no checkpoint). At the fence the
members of the new view meet, make new process groups among themselves (the lost ranks take no part, and no
operation left half-done on an old group can ever match a new one), and step on.

**Joins.** A column started with ``column_launch --join`` (:mod:`hf_noloco.resilience.joining`) writes one
request per stage. The leader of the view (the first stage of its first live column) looks for complete
requests of columns that are not live as each fence begins, and proposes the next view with them live,
``"at_fence"`` the fence after the one it is about to meet. No rank can pass that fence before the leader
reaches it, so every rank adopts the view there: nobody goes offline, no step is skipped. The joiners wait
for their admission, meet the view's members, and are sent their state by ``on_change``.

The pure parts, :func:`live_after_loss` and :func:`complete_requests`, are tested in one process;
:class:`Membership` with a real store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from hf_noloco.engine.comm import LOST_PEER_ERRORS, ViewChange, interrupt_waits_on
from hf_noloco.resilience.authentication import authenticated, read_counts
from hf_noloco.resilience.watch import PeerWatch

logger = logging.getLogger(__name__)


# A heartbeat beats every 0.5 s from a thread of its own, whatever the process computes, on a store
# connection of its own: 10 s of silence means a process that is gone or frozen, not a slow one. A rank killed
# between two messages (e.g. while the others wait at a fence) is then dropped after 10 s, not after a long
# p2p_timeout.
SILENCE_LIMIT = 10.0
# A rank whose heartbeat has not started yet is still setting up (its trainer is built after the others'):
# silent only after this long.
STARTUP_GRACE = 60.0


def silence_limit(p2p_timeout: float) -> float:
    """Seconds of heartbeat silence after which a rank is lost: ``p2p_timeout``, at most
    :data:`SILENCE_LIMIT`."""
    return min(p2p_timeout, SILENCE_LIMIT)


class ReplicaDropped(RuntimeError):
    """This process's replica column is no longer part of the run: it must leave without communicating."""


class StoreLost(RuntimeError):
    """The store the live ranks agree through is gone: no view can be agreed any more, so the run ends.
    Not a lost peer (:func:`~hf_noloco.engine.comm.is_lost_peer`): no policy tolerates it."""


class StoreTampered(StoreLost):
    """Live ranks met having adopted different views: a record of the store was replaced between their
    reads (only an overwrite of a valid record can do that). No view can be trusted, so the run ends."""


class JoinRefused(ValueError):
    """The run refused this column's join: its recipe is not the run's. A user error: one line, exit 2."""


def _store_address(store) -> str:
    base = getattr(store, "_underlying_non_prefix_store", store)
    host, port = getattr(base, "host", None), getattr(base, "port", None)
    return f"{host}:{port}" if host is not None else "the rendezvous store"


@contextlib.contextmanager
def _through_store(store, rank: int):
    """Store failures become :class:`StoreLost`, naming the store (its host is a single point of failure:
    a column's launcher with ``--host-store``, or ``--store-only`` on a machine of its own)."""
    try:
        yield
    except dist.DistError as exc:
        raise StoreLost(
            f"rank {rank}: the run's store at {_store_address(store)} is unreachable "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). With on_replica_loss='continue' the "
            "live ranks agree through it, so every column stops here. Host the store on a machine of its own "
            "(`python -m hf_noloco.column_launch --store HOST:PORT --store-only ...`) and the run survives "
            "the loss of any column; resume from the newest checkpoint."
        ) from None


def live_after_loss(live: list[int], lost_ranks: list[int], num_stages: int) -> list[int]:
    """The live replica columns once ``lost_ranks`` are gone: a column goes with any one of its stages."""
    lost_columns = {rank // num_stages for rank in lost_ranks}
    return [replica for replica in live if replica not in lost_columns]


def proposal_problem(proposal, before: list[int], num_stages: int, num_replicas: int) -> str | None:
    """What makes ``proposal`` (the next view after one whose live columns are ``before``) invalid, or
    ``None``: its live columns must be drawn from ``before`` (a loss) or be ``before`` plus the columns it
    admits (a join, whose requests :meth:`Membership._requests_problem` checks), never empty, and it must be
    made by a rank of ``before`` (a join: by that view's leader)."""
    if not isinstance(proposal, dict):
        return "not a mapping"
    live, joined, by = proposal.get("live"), proposal.get("joined", []), proposal.get("by")
    ints = lambda v: isinstance(v, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in v)
    if not ints(live) or not ints(joined) or not isinstance(by, int) or isinstance(by, bool):
        return "malformed"
    if not live:
        return "an empty view (no live column)"
    if live != sorted(set(live)) or not all(0 <= c < num_replicas for c in live):
        return f"live columns {live} out of range or unsorted"
    if by < 0 or by // num_stages not in before:
        return f"proposed by rank {by}, which is not in a live column of the view before"
    if not joined:
        if not set(live) <= set(before):
            return f"live columns {live} add columns to {before} without a join"
        return None
    if set(joined) & set(before) or live != sorted(set(before) | set(joined)):
        return f"a join must keep the live columns {before} and add {joined}"
    if by != before[0] * num_stages:
        return f"a join proposed by rank {by}, not by the leader of the view before"
    if not isinstance(proposal.get("at_fence"), int) or proposal["at_fence"] < 0:
        return "a join without the fence it takes effect at"
    return None


def _digest(proposal: dict | None) -> str:
    """What members of a view tell each other they adopted: a digest of its proposal."""
    if proposal is None:
        return "view-0"
    return hashlib.sha256(json.dumps(proposal, sort_keys=True).encode()).hexdigest()[:32]


def complete_requests(asked: dict[int, set[int]], live: list[int], num_stages: int) -> list[int]:
    """The columns to admit: not live, and every one of their ``num_stages`` stages asked to join
    (``asked``: column -> the stages whose request is in the store)."""
    return sorted(c for c, stages in asked.items() if c not in live and len(stages) == num_stages)


class Membership:
    """The live replica columns of this run, as every live rank agrees on them.

    Args:
        watch: this rank's :class:`~hf_noloco.resilience.watch.PeerWatch` (its store and heartbeats).
        rank / num_stages / num_replicas: the mesh shape and this rank.
        silence: seconds without a heartbeat after which a rank counts as lost: the trainer passes
            :func:`silence_limit` of ``p2p_timeout``.
        on_change: called on every live rank with the new view's number, its live columns, the columns that
            joined in it and the columns live before, when a view takes effect (at a fence); it rebuilds the
            process groups and whatever draws over the replicas, and copies a joined column's state.
        joining: this rank's column joins the live run (:mod:`hf_noloco.resilience.joining`): the
            constructor asks, waits up to ``admission_timeout`` seconds to be admitted, and returns once the
            view that admits it is in effect.
        recipe: the digest of this run's recipe (:func:`~hf_noloco.resilience.authentication.recipe_digest`):
            a joiner's request carries its own, and the leader admits only a column whose every stage's
            request carries the run's.

    Every record goes through an :class:`~hf_noloco.resilience.authentication.AuthenticatedStore`: one without
    a valid MAC is ignored (and counted in the log), and so is a proposal that :func:`proposal_problem` or
    :meth:`_requests_problem` refuses. A view once read is kept: a later overwrite of its record cannot change
    it for this rank, and members who adopted different ones find it at their first meeting
    (:class:`StoreTampered`).
    """

    def __init__(
        self,
        watch: PeerWatch,
        rank: int,
        num_stages: int,
        num_replicas: int,
        silence: float,
        on_change: Callable[[int, list[int], list[int], list[int]], None],
        poll: float = 0.1,
        joining: bool = False,
        admission_timeout: float = 3600.0,
        recipe: str = "",
    ):
        if watch.store is None:
            raise RuntimeError("on_replica_loss='continue' needs the rendezvous store, and none was found.")
        self.watch, self.store = watch, authenticated(watch.store)
        self.rank, self.num_stages = rank, num_stages
        self.replica = rank // num_stages
        self.silence, self.on_change, self.poll = silence, on_change, poll
        self.recipe = recipe
        self.view = 0
        self.live = list(range(num_replicas))
        self._prefix = f"{watch.prefix}/live"
        self._fences = 0  # fences passed in the current view
        self.interrupted = threading.Event()  # a newer view exists: waits raise, the step goes on offline
        self._beats: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._due: dict | None = None  # a proposed join, taking effect at its "at_fence" (no interruption)
        self.num_replicas = num_replicas
        self._views: dict[int, dict] = {}  # every valid proposal read, by view: never read again
        self._refused: set[tuple] = set()  # join requests refused (logged once)
        interrupt_waits_on(self.interrupted)
        if joining:
            with _through_store(self.store, self.rank):
                self._wait_for_admission(admission_timeout)
        self._thread = threading.Thread(target=self._watch, name="hf_noloco-membership", daemon=True)
        self._thread.start()
        if joining:
            with _through_store(self.store, self.rank):
                self._adopt_next_view()

    # ----------------------------------------------------------------------------------------- state

    @property
    def offline(self) -> bool:
        """A view change is pending: communicate with no one until the next fence."""
        return self.interrupted.is_set()

    def live_ranks(self, live: list[int] | None = None) -> list[int]:
        live = self.live if live is None else live
        return [r * self.num_stages + s for r in live for s in range(self.num_stages)]

    def _key(self, *parts) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    def _live_of(self, view: int) -> list[int] | None:
        """The live columns of ``view`` (``None`` when that view is not known valid)."""
        if view == 0:
            return list(range(self.num_replicas))
        proposal = self._proposal(view)
        return None if proposal is None else proposal["live"]

    def _proposal(self, view: int) -> dict | None:
        """The valid proposal of ``view``, or ``None``: absent, without a valid MAC, or refused by
        :func:`proposal_problem` (both logged). The first valid one read is kept."""
        if view in self._views:
            return self._views[view]
        key = self._key("view", view)
        value = self.store.read(key)
        if value is None:
            return None
        before = self._live_of(view - 1)
        try:
            proposal = json.loads(value)
        except ValueError:
            proposal = None
        problem = (
            "no view before it"
            if before is None
            else proposal_problem(proposal, before, self.num_stages, self.num_replicas)
        )
        if problem is None and proposal.get("joined"):
            problem = self._requests_problem(proposal, view - 1)
        if problem is not None:
            self.store.auth.note_ignored(key, f"refused as a view ({problem})")
            return None
        self._views[view] = proposal
        return proposal

    def _store_proposal(self, view: int, proposal: dict) -> dict:
        """``compare_set`` of a proposal for ``view``: the first valid one stored wins (an invalid record
        there is replaced); returns the winner, which this rank keeps."""
        if view in self._views:  # read before: that one won
            return self._views[view]
        self.store.compare_set(self._key("view", view), "", json.dumps(proposal))
        kept = self._proposal(view)
        if kept is None:  # stored, yet not valid when read back: cannot happen unless tampered with
            raise StoreTampered(f"rank {self.rank}: the store did not keep a valid proposal of view {view}")
        return kept

    # ------------------------------------------------------------------------------------ detection

    def _watch(self) -> None:
        """Raises the interruption as soon as a newer view is proposed, and proposes one when a live rank's
        heartbeat stops for ``silence`` seconds (a rank killed, frozen or cut off between messages)."""
        last_check = 0.0
        while not self._stop.wait(self.poll):
            try:
                if not self.interrupted.is_set() and self._due is None:
                    proposal = self._proposal(self.view + 1)
                    if proposal is not None and proposal.get("joined"):
                        self._due = proposal  # taken at its fence: nothing is interrupted
                    elif proposal is not None:
                        self.interrupted.set()
                # Heartbeats move every interval: reading them more often would only load the store.
                if not self.interrupted.is_set() and time.monotonic() - last_check >= self.watch.interval:
                    last_check = time.monotonic()
                    silent = self.silent_ranks(self.silence)
                    if silent:
                        self.propose(silent, f"no heartbeat for {self.silence:g}s")
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to agree through
                return

    def silent_ranks(self, seconds: float, ranks: list[int] | None = None) -> list[int]:
        """Live ranks (or ``ranks``) whose heartbeat count has not risen for ``seconds`` (a record without a
        valid MAC, or one replayed, never counts as a beat)."""
        now = time.monotonic()
        silent = []
        others = [r for r in (self.live_ranks() if ranks is None else ranks) if r != self.rank]
        beats = read_counts(self.store, [f"{self.watch.prefix}/beat/{rank}" for rank in others])
        for rank, beat in zip(others, beats):
            last = self._beats.get(rank)
            if last is None or (beat is not None and beat > last[0]):
                self._beats[rank] = (beat or 0, now)
            elif now - last[1] >= (seconds if last[0] else max(seconds, STARTUP_GRACE)):
                silent.append(rank)
        return silent

    def propose(self, lost_ranks: list[int], reason: str) -> dict:
        """Proposes the next view without the columns of ``lost_ranks`` (the first proposal wins) and goes
        offline; returns the proposal that won."""
        live = live_after_loss(self.live, lost_ranks, self.num_stages)
        if not live:
            raise ReplicaDropped(f"rank {self.rank}: every live column is lost ({sorted(lost_ranks)})")
        mine = {"live": live, "by": self.rank, "lost": sorted(lost_ranks), "reason": reason[:500]}
        won = self._store_proposal(self.view + 1, mine)
        self.interrupted.set()
        return won

    # ---------------------------------------------------------------------------------------- joins

    def _request_key(self, column: int, stage: int) -> str:
        return self._key("ask", column, stage)

    def _sealed_request(self, column: int, stage: int) -> bytes | None:
        """The record of a join request as it is in the store (sealed), or ``None``."""
        key = self._request_key(column, stage)
        return self.store.base.get(key) if self.store.base.check([key]) else None

    def _request(self, column: int, stage: int, sealed: bytes | None) -> dict | None:
        """A join request from its sealed record, if valid."""
        value = self.store.auth.open(self._request_key(column, stage), sealed) if sealed else None
        try:
            request = json.loads(value) if value is not None else None
        except ValueError:
            request = None
        ok = isinstance(request, dict) and isinstance(request.get("after_view"), int)
        return request if ok and isinstance(request.get("recipe"), str) else None

    def _requests_problem(self, proposal: dict, view_before: int) -> str | None:
        """A join proposal carries each joined stage's request as its record was: every one must be valid,
        ask after ``view_before`` and carry this run's recipe."""
        carried = proposal.get("requests")
        if not isinstance(carried, dict):
            return "a join without its requests"
        for column in proposal["joined"]:
            records = carried.get(str(column))
            if not isinstance(records, list) or len(records) != self.num_stages:
                return f"column {column}'s requests are not all there"
            for stage, record in enumerate(records):
                request = self._request(column, stage, record.encode() if isinstance(record, str) else None)
                valid = request is not None and request["after_view"] == view_before
                if not valid or request["recipe"] != self.recipe:
                    return f"column {column} stage {stage}'s request is not a valid one of this run"
        return None

    def _admit_joiners(self) -> None:
        """On the leader, as a fence begins: proposes the next view with every column whose stages all asked
        to join (authentic requests of this run's recipe, made after the current view), effective at the
        fence after this one; a request of another recipe is refused."""
        others = [c for c in range(self.num_replicas) if c not in self.live]  # none while all are live
        keys = [self._request_key(c, s) for c in others for s in range(self.num_stages)]
        if not keys or not any(self.store.check([k]) for k in keys):
            return
        asked, carried = {}, {}
        for column in others:
            for stage in range(self.num_stages):
                sealed = self._sealed_request(column, stage)
                request = self._request(column, stage, sealed)
                if request is None or request["after_view"] != self.view:
                    continue
                if request["recipe"] != self.recipe:
                    self._refuse(column, stage, request["recipe"])
                    continue
                asked.setdefault(column, set()).add(stage)
                carried.setdefault(str(column), [None] * self.num_stages)[stage] = sealed.decode()
        joined = complete_requests(asked, self.live, self.num_stages)
        if not joined:
            return
        proposal = {"live": sorted(self.live + joined), "by": self.rank, "lost": [], "joined": joined}
        proposal.update(reason=f"columns {joined} joined", at_fence=self._fences + 1)
        proposal["requests"] = {str(c): carried[str(c)] for c in joined}
        won = self._store_proposal(self.view + 1, proposal)
        if won.get("joined"):
            self._due = won
        else:  # a loss was proposed first: it takes effect, the joiners are admitted after it
            self.interrupted.set()

    def _refuse(self, column: int, stage: int, recipe: str) -> None:
        """Tells a joiner of another recipe that it is refused (before any state is sent to it)."""
        key = self._key("refused", column, stage)
        self.store.set(key, json.dumps({"recipe": recipe}))
        if (column, stage, recipe) not in self._refused:
            self._refused.add((column, stage, recipe))
            logger.warning(
                "rank %d: refused the join of column %d stage %d: its recipe (model, split, outer settings, "
                "data) is not this run's (digest %s, the run's %s).",
                self.rank,
                column,
                stage,
                recipe[:12],
                self.recipe[:12],
            )

    def _wait_for_admission(self, timeout: float) -> None:
        """A joining rank: asks, then waits for a view that admits its column; afterwards this rank's view
        is the one before it, and its ``at_fence`` is due now."""
        view = 0  # views before the request cannot admit it (an earlier join of this column did)
        while self._proposal(view + 1) is not None:
            view += 1
        stage = self.rank % self.num_stages
        ask = lambda: self.store.set(
            self._request_key(self.replica, stage), json.dumps({"recipe": self.recipe, "after_view": view})
        )
        ask()
        started = last_check = asked = time.monotonic()
        while True:
            proposal = self._proposal(view + 1)
            if proposal is not None and self.replica in proposal.get("joined", []):
                view += 1
                break
            if proposal is not None:  # another change came first: ask again, after it
                view += 1
                ask()
                continue
            refusal = self.store.read(self._key("refused", self.replica, stage))
            if refusal is not None and json.loads(refusal).get("recipe") == self.recipe:
                raise JoinRefused(
                    f"rank {self.rank}: the run refused this column's join: its recipe (model, stage split, "
                    "outer optimizer settings or data) differs from the run's. Join with the run's own "
                    "arguments."
                )
            if time.monotonic() - asked > 1.0:  # a request deleted or overwritten: asked again
                ask()
                asked = time.monotonic()
            if time.monotonic() - last_check >= self.watch.interval:  # is the run still live?
                last_check = time.monotonic()
                live = self._live_of(view) or self.live
                ranks = [r for r in self.live_ranks(live) if r != self.rank]
                if len(self.silent_ranks(self.silence, ranks)) == len(ranks):
                    raise RuntimeError(
                        f"rank {self.rank}: asked to join the run as replica {self.replica}, but no rank of "
                        f"the run has beaten its heartbeat for {self.silence:g}s: the run is over (or gone)."
                    )
            if time.monotonic() - started > timeout:
                raise TimeoutError(
                    f"rank {self.rank}: asked to join the run as replica {self.replica} and was not admitted "
                    f"within {timeout:g}s: is the run live, and is replica {self.replica} not among its live "
                    "columns (a column is admitted once the run has dropped it)?"
                )
            time.sleep(self.poll)
        self.store.delete_key(self._request_key(self.replica, stage))
        self.view, self._fences, self._due = view - 1, proposal["at_fence"], proposal
        self.live = [c for c in proposal["live"] if c not in proposal["joined"]]
        self._beats.clear()
        self.watch.start_beating()  # in the lost predecessor's name: from now on this rank is the run's

    def failed(self, exc: BaseException, step: int) -> None:
        """Called by a live rank whose communication failed during ``step``: unless a newer view is already
        proposed, finds the ranks whose heartbeat stopped (a killed rank's stops at once: watch a few beats)
        and proposes a view without their columns. The rank is offline afterwards."""
        with _through_store(self.store, self.rank):
            self._failed(exc, step)

    def _failed(self, exc: BaseException, step: int) -> None:
        if isinstance(exc, ViewChange) or self._proposal(self.view + 1) is not None:
            self.interrupted.set()
            return
        window = 3 * self.watch.interval
        self.silent_ranks(window)
        time.sleep(window)
        lost = self.silent_ranks(window)
        won = self.propose(lost, f"{type(exc).__name__}: {exc}")
        logger.warning(
            "rank %d: communication failed in step %d (%s); next view: live replicas %s (lost ranks %s).",
            self.rank,
            step,
            str(exc).splitlines()[0][:300],
            won["live"],
            won["lost"] or "none",
        )

    # --------------------------------------------------------------------------------------- fences

    def fence(self) -> None:
        """A barrier among the live ranks through the store; a pending view takes effect here. Raises
        :class:`ReplicaDropped` on a rank whose column is no longer live, :class:`StoreLost` when the store
        is gone."""
        with _through_store(self.store, self.rank):
            if self.rank == self.live[0] * self.num_stages and self._due is None:
                self._admit_joiners()
            while True:
                if self.interrupted.is_set() or self._join_due():
                    self._adopt_next_view()
                if self._meet():
                    return

    def _join_due(self) -> bool:
        return self._due is not None and self._due["at_fence"] <= self._fences

    def barrier(self) -> None:
        """A barrier among the live ranks that does not adopt a pending view but raises
        :class:`~hf_noloco.engine.comm.ViewChange`: what was begun under one view (a checkpoint) cannot be
        finished under the next."""
        with _through_store(self.store, self.rank):
            if self.interrupted.is_set() or not self._meet():
                raise ViewChange(f"rank {self.rank}: the live replicas are changing")

    def _meet(self) -> bool:
        """The next barrier of this view; False when a newer view interrupts it."""
        key = self._key("fence", self.view, self._fences)
        if not self._gather(key):
            return False
        # Everyone arrived here, so everyone left the barrier before: its record of this rank is done with.
        before = (
            self._key("fence", self.view, self._fences - 1) if self._fences else self._key("join", self.view)
        )
        self.store.delete_key(f"{before}/{self.rank}")
        self._fences += 1
        return True

    def _gather(self, key: str) -> bool:
        """Records this rank's arrival at ``key`` (with the digest of the view it is in) and waits until every
        live rank's is there; False when interrupted by a newer view (proposed meanwhile, by this rank's watch
        thread or another rank). An arrival without a valid MAC does not count; one under another view's
        digest is a tampered store (:class:`StoreTampered`)."""
        digest = _digest(self._views.get(self.view))
        mine = f"{key}/{self.rank}"
        self.store.set(mine, digest)
        keys = [f"{key}/{rank}" for rank in self.live_ranks()]
        pause, written = 0.0005, time.monotonic()
        while True:
            if self.store.check(keys):
                values = self.store.read_many(keys)
                if all(v is not None for v in values):
                    other = [k for k, v in zip(keys, values) if v.decode() != digest]
                    if other:
                        raise StoreTampered(
                            f"rank {self.rank}: the live ranks adopted different views at {other[0]}: a "
                            "record of the run's store was replaced. No view can be trusted; the run stops."
                        )
                    return True
            if self.interrupted.is_set() or self._join_due():
                return False
            time.sleep(pause)
            pause = min(pause * 1.5, 0.02)
            if time.monotonic() - written > 1.0:  # an arrival deleted or overwritten: written again
                self.store.set(mine, digest)
                written = time.monotonic()

    def _adopt_next_view(self) -> None:
        """Takes the newest proposed view: meets its members, then ``on_change`` makes the new groups."""
        while True:
            proposal = self._proposal(self.view + 1)
            if proposal is None:  # interrupted without a proposal: cannot happen, but never spin
                self.interrupted.clear()
                return
            live, before = proposal["live"], self.live
            if self.replica not in live:
                raise ReplicaDropped(
                    f"rank {self.rank}: replica {self.replica} was dropped from the run in view "
                    f"{self.view + 1} "
                    f"(lost ranks {proposal['lost']}: {proposal['reason']})"
                )
            self.view += 1
            self.live = list(live)
            self._fences = 0
            self._beats.clear()
            self._due = None
            self.interrupted.clear()
            if not self._gather(self._key("join", self.view)):
                continue  # a member of this view was lost too: the next view is proposed already
            try:
                self.on_change(self.view, self.live, proposal.get("joined", []), before)
            except LOST_PEER_ERRORS as exc:  # a member lost while the groups were made or a state sent
                self.failed(exc, -1)
                continue
            logger.warning(
                "rank %d: view %d in effect: live replicas %s (%d of the run's columns)%s.",
                self.rank,
                self.view,
                self.live,
                len(self.live),
                f"; replicas {proposal['joined']} joined" if proposal.get("joined") else "",
            )
            return

    def close(self) -> None:
        self._stop.set()
        interrupt_waits_on(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll)
