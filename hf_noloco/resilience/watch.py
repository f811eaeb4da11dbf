"""Heartbeats in the rendezvous store: who is still alive, and the job's first failure.

Every rank stamps a counter in the store from a daemon thread. After a communication failure a rank watches
the counters to find the peers that stopped (killed, frozen, cut off), and the first failing rank stores its
diagnosis so that every rank's error names the root cause. Under ``on_replica_loss="continue"`` the same
heartbeats tell :mod:`hf_noloco.resilience.membership` which ranks are gone.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from hf_noloco.engine.comm import PeerError, is_lost_peer
from hf_noloco.resilience.authentication import authenticated, default_store_connection, read_counts


class PeerWatch:
    """Tells, after a communication failure, which peers are gone, and keeps the job's first failure.

    ``own_connection``: talk to the store (``store``, or the default group's) over a connection of its own. A
    store client runs one operation at a time, and making a process group, NCCL's lazy set-up of a
    communicator and the store-based barrier's ``store.wait`` hold it for seconds, which would silence the
    heartbeat meanwhile (and a watcher would take a rank that is only making a group for a lost one).

    A gloo/NCCL collective that fails says only that "a connection closed" or "timed out", not which rank was
    lost. So each rank stamps a counter in the rendezvous store every ``interval`` seconds from a daemon
    thread (the store is hosted by the launcher's agent under torchrun/accelerate, so it outlives any worker).
    A rank whose communication fails marks itself as failing, then watches the counters for ``3 * interval``:
    the peers whose counter did not move and that are not failing themselves are lost (killed, crashed, frozen
    or cut off). The first failing rank stores its diagnosis; ranks that fail after it (their peer is gone)
    just read it, so every rank's error names the lost peer. All of this is best effort: without a reachable
    store (e.g. it lived in a rank that died) the errors are the plain ones.

    On NCCL the training thread's waits do not block the host
    (:func:`hf_noloco.engine.comm.use_stream_waits`), so they cannot time out and name a peer:
    :meth:`watch_peers` then watches every peer's heartbeat from a thread, and a peer silent for ``silence``
    seconds is named by :meth:`raise_if_lost` at the training thread's next host sync (once per step), after
    ``on_lost`` has aborted the communicators that would hang on it.
    ``store``: the store to use (default: the default process group's). ``beating=False``: the heartbeat
    starts only with :meth:`start_beating` (a column joining a live run beats in its lost predecessor's name
    once admitted, not while the run may still be finding that predecessor silent).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        interval: float = 0.5,
        own_connection: bool = False,
        store: dist.Store | None = None,
        beating: bool = True,
    ):
        self.rank, self.world_size, self.interval = rank, world_size, interval
        self._prefix = "hf_noloco/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._stop = threading.Event()
        self.lost: list[int] = []  # peers the watcher found silent (see watch_peers)
        self.store = store
        try:
            if store is None:
                from torch.distributed.distributed_c10d import _get_default_store

                self.store = _get_default_store()
            if own_connection:
                self.store = _second_connection(self.store)
        except Exception:  # noqa: BLE001 - no store (e.g. a custom init): no diagnosis, plain errors
            self.store = None
            return
        self.store = authenticated(self.store)  # records sealed and checked (resilience/authentication.py)
        self._thread = threading.Thread(target=self._beat, name="hf_noloco-heartbeat", daemon=True)
        if beating:
            self._thread.start()

    @property
    def prefix(self) -> str:
        """The prefix of this attempt's store keys (the membership keeps its own keys under it)."""
        return self._prefix

    def start_beating(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def _beat(self) -> None:
        key = f"{self._prefix}/beat/{self.rank}"
        try:  # a sealed count (a counter cannot carry a MAC); a joiner goes on from its predecessor's
            count = read_counts(self.store, [key])[0] or 0
        except Exception:  # noqa: BLE001 - store gone: nothing left to tell
            return
        while not self._stop.is_set():
            count += 1
            try:
                self.store.set(key, str(count))
            except Exception:  # noqa: BLE001 - store gone: nothing left to tell
                return
            self._stop.wait(self.interval)

    def watch_peers(self, silence: float, on_lost: Callable[[list[int]], None]) -> None:
        """Starts watching every peer's heartbeat from a thread; a peer silent for ``silence`` seconds
        (killed, frozen, cut off) goes into :attr:`lost` and ``on_lost(lost)`` is called, once."""
        if self.store is None:
            return
        watcher = threading.Thread(
            target=self._watch, args=(silence, on_lost), name="hf_noloco-watch", daemon=True
        )
        watcher.start()

    def _watch(self, silence: float, on_lost: Callable[[list[int]], None]) -> None:
        keys = [f"{self._prefix}/beat/{r}" for r in range(self.world_size) if r != self.rank]
        peers = [r for r in range(self.world_size) if r != self.rank]
        seen: dict[int, tuple[int, float]] = {}
        while not self._stop.wait(self.interval):
            try:
                beats = read_counts(self.store, keys)
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to watch
                return
            now = time.monotonic()
            silent = []
            for rank, beat in zip(peers, beats):
                last = seen.get(rank)
                if last is None or (beat is not None and beat > last[0]):  # (a forged count never moves)
                    seen[rank] = (beat or 0, now)
                elif last[0] and now - last[1] >= silence:  # a peer that never beat is still starting
                    silent.append(rank)
            if silent:
                self.lost = silent
                on_lost(silent)
                return

    def raise_if_lost(self, describe: Callable[[int], str]) -> None:
        """Raises a :class:`~hf_noloco.engine.comm.PeerError` naming the peers the watcher found silent."""
        if self.lost:
            names = ", ".join(describe(r) for r in self.lost)
            raise PeerError(f"{describe(self.rank)}: Peers that stopped responding: {names}")

    def close(self) -> None:
        """Stops the heartbeat and waits for its thread: a thread left inside a store call while the
        interpreter exits can abort the process (SIGABRT) instead of letting it exit with its error."""
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread.ident is not None and thread is not threading.current_thread():
            thread.join(timeout=10 * self.interval)

    def diagnose(
        self, message: str, describe: Callable[[int], str], find_lost: bool = True, timeout: float = 5.0
    ) -> str | None:
        """Records ``message`` (this rank's failure) and returns the job's first failure: ``message`` (plus
        the lost peers, with ``find_lost``) when this rank is the first, another rank's record otherwise;
        ``None`` without a store."""
        if self.store is None:
            return None
        try:
            self.store.set_timeout(timedelta(seconds=timeout))  # we are failing: never wait long on the store
            self.store.set(f"{self._prefix}/failing/{self.rank}", "1")
            key = f"{self._prefix}/first_failure"
            if not self.store.check([key]):
                lost = self._lost_peers() if find_lost else []
                if lost:
                    message += "\nPeers that stopped responding: " + ", ".join(describe(r) for r in lost)
                return self.store.compare_set(key, "", message).decode(errors="replace")
            return self.store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store is gone too
            return None

    def with_root_cause(self, exc: Exception, mesh, timeout: float) -> Exception:
        """Records this rank's failure as the job's first unless another rank's came first. A communication
        error comes back as a PeerError that names the peers that stopped responding, or the job's first
        failure; any other error as it is."""
        mine = f"{mesh.describe()}: {type(exc).__name__}: {exc}"[:4000]
        lost = is_lost_peer(exc)
        first = self.diagnose(mine, mesh.describe_rank, find_lost=lost, timeout=timeout)
        if first is None or not lost or first == mine:
            return exc
        if first.startswith(mine):  # this rank was first: its message plus the peers it lost
            return PeerError(first)
        return PeerError(f"{mine}\nThe first failure in this job was on {first}")

    def hold_store_at_exit(self) -> None:
        """When this process hosts the store (rank 0 launched without an elastic agent), it waits at exit,
        after its error is out, until every other rank has recorded its own failure or stopped beating
        (killed, frozen, gone), at most ``20 * interval`` seconds: ranks that fail a moment later (a peer's
        diagnosis takes ``3 * interval``) still read the job's first failure from this store."""
        hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if self.store is not None and self.rank == 0 and not hosted_by_agent:
            atexit.register(self._hold_store, 20 * self.interval)

    def _hold_store(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            while time.monotonic() < deadline:
                before = dict(zip(others, self._beats(others)))
                time.sleep(3 * self.interval)
                now = dict(zip(others, self._beats(others)))
                others = [
                    r
                    for r in others
                    if self.store.read(f"{self._prefix}/failing/{r}") is None
                    and now[r] is not None
                    and now[r] > (before[r] or 0)
                ]
                if not others:
                    return
        except Exception:  # noqa: BLE001 - the store is failing too: nothing to hold
            return

    def _beats(self, ranks) -> list[int | None]:
        return read_counts(self.store, [f"{self._prefix}/beat/{r}" for r in ranks])

    def _lost_peers(self) -> list[int]:
        before = self._beats(range(self.world_size))
        time.sleep(3 * self.interval)
        after = self._beats(range(self.world_size))
        return [
            r
            for r in range(self.world_size)
            if r != self.rank
            and not (after[r] is not None and after[r] > (before[r] or 0))
            and self.store.read(f"{self._prefix}/failing/{r}") is None
        ]


def _second_connection(store: dist.Store) -> dist.Store:
    """A new client connection to the TCPStore behind ``store`` (keys without the process group's prefix),
    or ``store`` itself when it is not a TCPStore."""
    own = default_store_connection()  # the default group was made on an authenticated store
    if own is not None:
        return own
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if not isinstance(base, dist.TCPStore):
        return store
    return dist.TCPStore(base.host, base.port, is_master=False, timeout=base.timeout)
