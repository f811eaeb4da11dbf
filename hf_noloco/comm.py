"""Messages with a deadline, and the flat buffers they carry.

A peer that never answers is an error that names it, not a hang: every wait here is bounded. Tensors travel
in flat buffers, built from consecutive tensors (:func:`consecutive_buckets`, :func:`flatten`) and copied back
(:func:`unflatten_into`), one message per bucket instead of one per tensor.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


class PeerError(RuntimeError):
    """A peer did not answer within the deadline, or its connection broke."""


class ViewChange(PeerError):
    """A wait given up because the run's live replicas are changing (:mod:`hf_noloco.membership`)."""


# Under on_replica_loss="continue" every wait also watches this event (set when a newer view of the live
# replicas is proposed) and gives up when it is set: a peer that is itself recovering will never answer.
_interrupt: threading.Event | None = None
# Operations given up that way stay posted on their (old) process group: their Work objects, and the tensors
# those hold, are kept alive here so that gloo never writes into freed memory.
_abandoned: list = []


def interrupt_waits_on(event: threading.Event | None) -> None:
    """Makes every wait of this module give up with :class:`ViewChange` once ``event`` is set (``None``:
    waits are plain again)."""
    global _interrupt
    _interrupt = event


def strict_p2p() -> bool:
    """``HF_NOLOCO_STRICT_P2P=1``: wait for every posted batch, sends included, before posting the next.

    gloo's sends wait for their receiver whatever their size, so this executes batches the way NCCL's stream
    does: a plan that could deadlock on GPUs deadlocks (and fails with a timeout) in CPU tests too.
    """
    return os.environ.get("HF_NOLOCO_STRICT_P2P") == "1"


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    timeout: float,
    describe_peer: Callable[[int], str] = lambda rank: f"rank {rank}",
    context: str = "",
    group: dist.ProcessGroup | None = None,
    receives_first: bool = False,
) -> list[tuple[dist.Work, str]]:
    """Posts every send and receive as one batch (``batch_isend_irecv``) and waits for the receives.

    ``sends``/``recvs`` are ``(tensor, global peer rank)`` pairs; messages between two ranks arrive in the
    order they are posted. Returns the sends still in flight as ``(Work, what it is)`` pairs: the caller keeps
    the sent tensors alive until :func:`wait_sends` has waited for them. gloo returns one Work per operation;
    NCCL one for the whole batch, which then completes (or fails, naming every peer of the batch) as a whole.
    ``group``: the process group (None: the default one). ``receives_first`` posts the receives before the
    sends (see :func:`post`).
    """
    received, pending = post(sends, recvs, describe_peer, group, receives_first)
    try:
        wait_sends(received, timeout, context)
        if strict_p2p():
            wait_sends(pending, timeout, context)
            pending = []
    except PeerError:
        abandon(received + pending)
        raise
    return pending


def abandon(works: Sequence) -> None:
    """Keeps operations that will never be waited for (and their tensors) alive, under
    ``on_replica_loss="continue"``; items are ``(Work, ...)`` tuples."""
    if _interrupt is not None:
        _abandoned.extend(item[0] for item in works)


def post(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    describe_peer: Callable[[int], str] = lambda rank: f"rank {rank}",
    group: dist.ProcessGroup | None = None,
    receives_first: bool = False,
) -> tuple[list[tuple[dist.Work, str]], list[tuple[dist.Work, str]]]:
    """Posts one batch and returns ``(received, sent)``, ``(Work, what it is)`` pairs: wait for ``received``
    before reading a receive buffer, for ``sent`` before reusing a send buffer. A backend that returns one
    Work for the whole batch (NCCL) puts it under ``received`` when the batch receives anything.

    ``receives_first``: under gloo, two ranks that both post their send before their receive move the two
    directions one after the other (measured on a rate-limited link: half the rate each way, twice the time,
    for the outer sync's exchange of whole stages); receives posted first let both directions flow at once.
    Within one batch NCCL does not care about the order."""
    send_ops = [dist.P2POp(dist.isend, tensor, peer, group) for tensor, peer in sends]
    recv_ops = [dist.P2POp(dist.irecv, tensor, peer, group) for tensor, peer in recvs]
    ops = recv_ops + send_ops if receives_first else send_ops + recv_ops
    if not ops:
        return [], []
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as exc:  # gloo: a peer's connection is already closed (it died) when posting
        raise PeerError(f"posting {_batch_description(sends, recvs, describe_peer)} failed ({exc})") from exc
    if len(works) == len(ops):
        if receives_first:
            recv_works, send_works = works[: len(recvs)], works[len(recvs) :]
        else:
            send_works, recv_works = works[: len(sends)], works[len(sends) :]
        received = [(w, f"receiving from {describe_peer(peer)}") for w, (_, peer) in zip(recv_works, recvs)]
        sent = [(w, f"sending to {describe_peer(peer)}") for w, (_, peer) in zip(send_works, sends)]
        return received, sent
    batch = [(work, _batch_description(sends, recvs, describe_peer)) for work in works]
    return (batch, []) if recvs else ([], batch)


def _batch_description(sends, recvs, describe_peer) -> str:
    def peers(pairs):
        return ", ".join(describe_peer(peer) for peer in dict.fromkeys(peer for _, peer in pairs))

    parts = ([f"sends to {peers(sends)}"] if sends else []) + (
        [f"receives from {peers(recvs)}"] if recvs else []
    )
    return "completing a batch of " + " and ".join(parts)


def wait_sends(pending: Sequence[tuple[dist.Work, str]], timeout: float, context: str = "") -> None:
    """Waits for what :func:`exchange` returned as still in flight."""
    for work, action in pending:
        _wait(work, timeout, action, context)


def _wait(work: dist.Work, timeout: float, action: str, context: str) -> None:
    try:
        if _interrupt is not None:
            completed = _interruptible_wait(work, timeout, _interrupt, action, context)
        else:
            completed = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:
        if isinstance(exc, ViewChange):
            raise  # gloo: timeout or a closed connection (the peer died); NCCL: watchdog abort
        raise PeerError(
            f"{context}: failed {action} within p2p_timeout={timeout:g}s ({exc})".lstrip(": ")
        ) from exc
    if completed is False:
        raise PeerError(f"{context}: timed out {action} after p2p_timeout={timeout:g}s".lstrip(": "))


def _interruptible_wait(
    work: dist.Work, timeout: float, interrupt: threading.Event, action: str, context: str
) -> bool:
    """``work.wait(timeout)`` in a helper thread, given up when ``interrupt`` is set. gloo cannot be asked
    again after a timed-out wait (it closes the connection) nor polled (``is_completed`` stays False until
    waited for), so the wait itself runs aside and this thread watches both."""
    if interrupt.is_set():
        _abandoned.append(work)
        raise ViewChange(f"{context}: gave up {action}: the live replicas are changing".lstrip(": "))
    done, outcome = threading.Event(), []

    def run():
        try:
            outcome.append(work.wait(timeout=timedelta(seconds=timeout)))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(exc)
        done.set()

    threading.Thread(target=run, name="hf_noloco-wait", daemon=True).start()
    while not done.wait(0.05):
        if interrupt.is_set():
            _abandoned.append(work)
            raise ViewChange(f"{context}: gave up {action}: the live replicas are changing".lstrip(": "))
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def wait_collective(work: dist.Work, timeout: float, what: str) -> None:
    """Waits for an async collective (``async_op=True``) for at most ``timeout`` seconds; a lost member is a
    :class:`PeerError` that says which collective and which ranks were involved."""
    _wait(work, timeout, "to complete", what)


class PeerWatch:
    """Tells, after a communication failure, which peers are gone, and keeps the job's first failure.

    ``own_connection``: talk to the store over a connection of its own. A store client runs one operation at a
    time, and making a process group blocks it until every member has arrived, which would silence the
    heartbeat meanwhile (``on_replica_loss="continue"`` then mistakes a rank making a group for a lost one).

    A gloo/NCCL collective that fails says only that "a connection closed" or "timed out", not which rank was
    lost. So each rank stamps a counter in the rendezvous store every ``interval`` seconds from a daemon
    thread (the store is hosted by the launcher's agent under torchrun/accelerate, so it outlives any worker).
    A rank whose communication fails marks itself as failing, then watches the counters for ``3 * interval``:
    the peers whose counter did not move and that are not failing themselves are lost (killed, crashed, frozen
    or cut off). The first failing rank stores its diagnosis; ranks that fail after it (their peer is gone)
    just read it, so every rank's error names the lost peer. All of this is best effort: without a reachable
    store (e.g. it lived in a rank that died) the errors are the plain ones.
    """

    def __init__(self, rank: int, world_size: int, interval: float = 0.5, own_connection: bool = False):
        self.rank, self.world_size, self.interval = rank, world_size, interval
        self._prefix = "hf_noloco/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._stop = threading.Event()
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self.store = _get_default_store()
            if own_connection:
                self.store = _second_connection(self.store)
        except Exception:  # noqa: BLE001 - no store (e.g. a custom init): no diagnosis, plain errors
            self.store = None
            return
        self._thread = threading.Thread(target=self._beat, name="hf_noloco-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(f"{self._prefix}/beat/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - store gone: nothing left to tell
                return
            self._stop.wait(self.interval)

    def close(self) -> None:
        """Stops the heartbeat and waits for its thread: a thread left inside a store call while the
        interpreter exits can abort the process (SIGABRT) instead of letting it exit with its error."""
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
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
                before = {r: self.store.add(f"{self._prefix}/beat/{r}", 0) for r in others}
                time.sleep(3 * self.interval)
                others = [
                    r
                    for r in others
                    if not self.store.check([f"{self._prefix}/failing/{r}"])
                    and self.store.add(f"{self._prefix}/beat/{r}", 0) != before[r]
                ]
                if not others:
                    return
        except Exception:  # noqa: BLE001 - the store is failing too: nothing to hold
            return

    def _lost_peers(self) -> list[int]:
        beats = lambda: [self.store.add(f"{self._prefix}/beat/{r}", 0) for r in range(self.world_size)]
        before = beats()
        time.sleep(3 * self.interval)
        after = beats()
        return [
            r
            for r in range(self.world_size)
            if r != self.rank
            and after[r] == before[r]
            and not self.store.check([f"{self._prefix}/failing/{r}"])
        ]


def _second_connection(store: dist.Store) -> dist.Store:
    """A new client connection to the TCPStore behind ``store`` (keys without the process group's prefix),
    or ``store`` itself when it is not a TCPStore."""
    base = store._underlying_non_prefix_store if isinstance(store, dist.PrefixStore) else store
    if not isinstance(base, dist.TCPStore):
        return store
    return dist.TCPStore(base.host, base.port, is_master=False, timeout=base.timeout)


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One new 1-D buffer holding ``tensors`` one after the other (in ``dtype``, default their own)."""
    return torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])


def unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copies consecutive slices of ``flat`` back into ``tensors`` (the inverse of :func:`flatten`)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


# NCCL's watchdog acts on a group's timeout; our own waits give up after p2p_timeout and then name the lost
# peer through the store, which takes a few seconds: the watchdog must come later.
NCCL_WATCHDOG_MARGIN = 60.0


def group_timeout(backend: str, seconds: float) -> timedelta:
    """The timeout to give a process group whose collectives our waits bound by ``seconds``: the same for gloo
    (its timeout is what our wait sees), ``seconds + NCCL_WATCHDOG_MARGIN`` for NCCL, whose watchdog would
    otherwise abort the communicator before the lost-peer diagnosis runs."""
    margin = NCCL_WATCHDOG_MARGIN if backend == "nccl" else 0.0
    return timedelta(seconds=seconds + margin)


def consecutive_buckets(sizes: Sequence[int], limit: float) -> list[list[int]]:
    """Indices of consecutive items grouped so that each group's total size stays within ``limit`` (an item
    larger than ``limit`` gets a group of its own): one message per group instead of one per tensor."""
    buckets, current, total = [], [], 0
    for i, size in enumerate(sizes):
        if current and total + size > limit:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        buckets.append(current)
    return buckets


class PendingExchange:
    """Sends and receives posted now (:func:`post`, receives first), on ``group``, and waited for later: the
    outer sync's exchange, running in the background while inner steps go on (``outer_overlap_steps``) or
    waited for at once. Under gloo the transfers progress in gloo's own threads, under NCCL on the group's own
    stream; either way the caller keeps computing. The tensors must stay untouched until :meth:`wait`
    returns. ``sends``/``recvs`` are ``(tensor, global peer rank)`` pairs; messages to one peer arrive in the
    order listed."""

    def __init__(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        group: dist.ProcessGroup | None,
        describe_peer: Callable[[int], str] = lambda rank: f"rank {rank}",
    ):
        self._received, self._sent = post(sends, recvs, describe_peer, group, receives_first=True)

    def wait(self, timeout: float, context: str = "") -> None:
        """Waits for every message, each for at most ``timeout`` seconds (receives first: a peer that never
        sent is named as the one not answering)."""
        wait_sends(self._received, timeout, context)
        wait_sends(self._sent, timeout, context)
        self._received, self._sent = [], []
