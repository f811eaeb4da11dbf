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
import json
import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from hf_noloco.engine.comm import LOST_PEER_ERRORS, ViewChange, interrupt_waits_on
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
    ):
        if watch.store is None:
            raise RuntimeError("on_replica_loss='continue' needs the rendezvous store, and none was found.")
        self.watch, self.store = watch, watch.store
        self.rank, self.num_stages = rank, num_stages
        self.replica = rank // num_stages
        self.silence, self.on_change, self.poll = silence, on_change, poll
        self.view = 0
        self.live = list(range(num_replicas))
        self._prefix = f"{watch.prefix}/live"
        self._fences = 0  # fences passed in the current view
        self.interrupted = threading.Event()  # a newer view exists: waits raise, the step goes on offline
        self._beats: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._due: dict | None = None  # a proposed join, taking effect at its "at_fence" (no interruption)
        self.num_replicas = num_replicas
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

    def _proposal(self, view: int) -> dict | None:
        key = self._key("view", view)
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

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
        """Live ranks (or ``ranks``) whose heartbeat counter has not moved for ``seconds``."""
        now = time.monotonic()
        silent = []
        others = [r for r in (self.live_ranks() if ranks is None else ranks) if r != self.rank]
        keys = [f"{self.watch.prefix}/beat/{rank}" for rank in others]
        if keys and self.store.check(keys):  # every counter exists: one request reads them all
            beats = [int(value) for value in self.store.multi_get(keys)]
        else:  # (get would wait for a missing one) add(0) reads a counter, creating it at 0
            beats = [self.store.add(key, 0) for key in keys]
        for rank, beat in zip(others, beats):
            last = self._beats.get(rank)
            if last is None or last[0] != beat:
                self._beats[rank] = (beat, now)
            elif now - last[1] >= (seconds if beat else max(seconds, STARTUP_GRACE)):
                silent.append(rank)
        return silent

    def propose(self, lost_ranks: list[int], reason: str) -> dict:
        """Proposes the next view without the columns of ``lost_ranks`` (the first proposal wins) and goes
        offline; returns the proposal that won."""
        live = live_after_loss(self.live, lost_ranks, self.num_stages)
        mine = json.dumps({"live": live, "by": self.rank, "lost": sorted(lost_ranks), "reason": reason[:500]})
        won = json.loads(self.store.compare_set(self._key("view", self.view + 1), "", mine))
        self.interrupted.set()
        return won

    # ---------------------------------------------------------------------------------------- joins

    def _request_key(self, column: int, stage: int) -> str:
        return self._key("ask", column, stage)

    def _admit_joiners(self) -> None:
        """On the leader, as a fence begins: proposes the next view with every column whose stages all asked
        to join, effective at the fence after this one."""
        others = [c for c in range(self.num_replicas) if c not in self.live]  # none while all are live
        has = lambda c, s: self.store.check([self._request_key(c, s)])
        asked = {c: {s for s in range(self.num_stages) if has(c, s)} for c in others}
        joined = complete_requests(asked, self.live, self.num_stages)
        if not joined:
            return
        proposal = {"live": sorted(self.live + joined), "by": self.rank, "lost": [], "joined": joined}
        proposal.update(reason=f"columns {joined} joined", at_fence=self._fences + 1)
        won = json.loads(self.store.compare_set(self._key("view", self.view + 1), "", json.dumps(proposal)))
        if won.get("joined"):
            self._due = won
        else:  # a loss was proposed first: it takes effect, the joiners are admitted after it
            self.interrupted.set()

    def _wait_for_admission(self, timeout: float) -> None:
        """A joining rank: asks, then waits for a view that admits its column; afterwards this rank's view
        is the one before it, and its ``at_fence`` is due now."""
        view = 0  # views before the request cannot admit it (an earlier join of this column did)
        while self.store.check([self._key("view", view + 1)]):
            view += 1
        self.store.set(self._request_key(self.replica, self.rank % self.num_stages), "1")
        started = last_check = time.monotonic()
        while True:
            proposal = self._proposal(view + 1)
            if proposal is not None and self.replica in proposal.get("joined", []):
                view += 1
                break
            if proposal is not None:  # another change came first
                view += 1
                continue
            if time.monotonic() - last_check >= self.watch.interval:  # is the run still live?
                last_check = time.monotonic()
                live = self._proposal(view)["live"] if view else self.live
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
        self.store.delete_key(self._request_key(self.replica, self.rank % self.num_stages))
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
        if self.store.add(key, 1) == len(self.live_ranks()):
            self.store.set(key + "/go", "1")
        if not self._wait_for(key + "/go"):
            return False
        self._fences += 1
        return True

    def _wait_for(self, key: str) -> bool:
        """Waits for ``key``; returns False when interrupted by a newer view (proposed meanwhile, by this
        rank's watch thread or another rank)."""
        pause = 0.0005
        while not self.store.check([key]):
            if self.interrupted.is_set() or self._join_due():
                return False
            time.sleep(pause)
            pause = min(pause * 1.5, 0.02)
        return True

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
            key = self._key("join", self.view)
            if self.store.add(key, 1) == len(self.live_ranks()):
                self.store.set(key + "/go", "1")
            if not self._wait_for(key + "/go"):
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
