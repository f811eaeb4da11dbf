"""Messages and collectives with a deadline, and the one error a lost peer raises.

A peer that never answers is an error that names it, not a hang: every wait here is bounded. Every
torch.distributed call of the training loop goes through this module (:func:`exchange`, :func:`post`,
:func:`collective`, :func:`peer_call`), which turns what the call itself raises into :class:`PeerError`. So a
lost peer is told apart from a bug by where the error came from, never by its text: gloo reports a closed
connection as a plain ``RuntimeError``, and code of ours that raises one is not a communication failure.

Once peers are known to be lost (:func:`peers_lost`: the heartbeat watcher found them silent and the
communicators were aborted), every call of this module raises :class:`PeerError` naming them, whatever torch
would raise (``ValueError``, ``DistBackendError``, ``RuntimeError``), before touching an aborted communicator.

Each wait is chosen by the operation it waits for (:class:`Posted`): an NCCL operation is a *stream* wait (the
current CUDA stream waits, the host does not), any other (gloo: the CPU flag group of an NCCL run too) a host
wait bounded by the deadline.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


class PeerError(RuntimeError):
    """A peer did not answer within the deadline, or its connection broke."""


class ViewChange(PeerError):
    """A wait given up because the run's live replicas are changing
    (:mod:`hf_noloco.resilience.membership`)."""


# What a failed communication call raises once it went through this module: ours, and NCCL's own type.
LOST_PEER_ERRORS: tuple[type[BaseException], ...] = (PeerError, dist.DistError)


def is_lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication failure (a lost or stuck peer), by its type alone."""
    return isinstance(exc, LOST_PEER_ERRORS)


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


# On NCCL a wait makes the current CUDA stream wait for the operation and returns at once: the host never
# blocks per message, and a lost peer is found by the heartbeat watcher instead
# (hf_noloco.resilience.watch.PeerWatch.watch_peers) and by NCCL's watchdog. Which kind of wait an operation
# gets is decided by its process group's backend when it is posted here (Posted); this switch is the kind for
# Work objects posted elsewhere, whose group this module never saw (the mesh sets it to its backend's).
_stream_waits = False

# Set once peers are lost and the communicators aborted (peers_lost): what every call here then raises.
_lost: str | None = None


def use_stream_waits(enabled: bool) -> None:
    """Work objects posted outside this module are waited for as stream waits (NCCL: ``enabled``), or with
    bounded host waits (gloo, the default). Operations posted here get the kind of wait of their group's
    backend, whatever this says."""
    global _stream_waits
    _stream_waits = enabled


def peers_lost(message: str | None) -> None:
    """From now on every communication call of this module raises :class:`PeerError` with ``message`` (which
    names the lost peers), without touching a communicator; ``None``: calls are made again (new process groups
    over the live ranks). Called before the communicators are aborted
    (:meth:`hf_noloco.engine.mesh.PipelineMesh.abort`), so that a wait the abort unblocks names the peers too.
    """
    global _lost
    _lost = message


def lost_peers() -> str | None:
    """What :func:`peers_lost` recorded (``None``: no peer is known to be lost)."""
    return _lost


def _raise_if_lost(what: str) -> None:
    if _lost is not None:
        raise PeerError(f"{what}: {_lost}".lstrip(": "))


class Posted:
    """A posted operation's ``Work`` and how to wait for it: ``stream`` (an NCCL operation: the current CUDA
    stream waits, the host does not) or a host wait bounded by the caller's deadline. Other attributes are the
    ``Work``'s."""

    __slots__ = ("work", "stream")

    def __init__(self, work, stream: bool):
        self.work, self.stream = work, stream

    def wait(self, timeout: timedelta | None = None):
        return self.work.wait() if timeout is None else self.work.wait(timeout=timeout)

    def __getattr__(self, name):
        return getattr(self.work, name)


def _backend_name(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """The backend that moves ``device`` tensors in ``group`` (None: the default group), as ``"nccl"`` or
    ``"gloo"``; ``None`` when there is no such process group (tests' stand-ins)."""
    try:
        pg = group if group is not None else dist.group.WORLD
        backend = pg._get_backend(device)
    except Exception:  # noqa: BLE001 - no process group, or none for this device
        return None
    return type(backend).__name__.removeprefix("ProcessGroup").lower()


def stream_waits_for(group: dist.ProcessGroup | None, device: torch.device | str = "cuda") -> bool:
    """Whether an operation on ``group`` moving ``device`` tensors is waited for as a stream wait (its
    backend is NCCL); without a known backend, :func:`use_stream_waits`' setting."""
    name = _backend_name(group, torch.device(device))
    return _stream_waits if name is None else name == "nccl"


def free_port() -> int:
    """A free TCP port on loopback (for a one-process group, or local launches)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    Within one batch NCCL does not care about the order.

    The operations are built and posted inside the guarded region: after an abort, or with a peer's
    connection already closed (gloo: it died), what torch raises is a :class:`PeerError`."""
    if not sends and not recvs:
        return [], []
    device = (sends or recvs)[0][0].device
    with peer_call(f"posting {_batch_description(sends, recvs, describe_peer)}"):
        send_ops = [dist.P2POp(dist.isend, tensor, peer, group) for tensor, peer in sends]
        recv_ops = [dist.P2POp(dist.irecv, tensor, peer, group) for tensor, peer in recvs]
        ops = recv_ops + send_ops if receives_first else send_ops + recv_ops
        works = dist.batch_isend_irecv(ops)
    stream = stream_waits_for(group, device)
    works = [Posted(work, stream) for work in works]
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
    _raise_if_lost(f"{context}: {action}".lstrip(": "))
    stream = work.stream if isinstance(work, Posted) else _stream_waits
    try:
        if stream:
            work.wait()  # NCCL: the stream waits, not the host
            return
        if _interrupt is not None:
            completed = _interruptible_wait(work, timeout, _interrupt, action, context)
        else:
            completed = work.wait(timeout=timedelta(seconds=timeout))
    except ViewChange:
        raise
    except Exception as exc:  # gloo: timeout or a closed connection (the peer died); NCCL: an aborted one
        if not isinstance(exc, RuntimeError) and _lost is None:
            raise
        lost = f": {_lost}" if _lost is not None else ""
        raise PeerError(
            f"{context}: failed {action} within p2p_timeout={timeout:g}s ({exc}){lost}".lstrip(": ")
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
    :class:`PeerError` that says which collective and which ranks were involved. A :class:`Posted` (from
    :func:`post_collective`) is waited for as its backend needs; a bare ``Work`` as :func:`use_stream_waits`
    says."""
    _wait(work, timeout, "to complete", what)


def post_collective(call: Callable, /, *args, what: str, **kwargs) -> Posted:
    """Posts the torch.distributed collective ``call(*args, async_op=True, **kwargs)`` (``group=`` among the
    keywords, default the default group) and returns it, to be waited for by :func:`wait_collective`: a
    stream wait on an NCCL group, a bounded host wait on a gloo one (the CPU flag group of an NCCL run). A
    failure while posting is a :class:`PeerError` naming ``what``."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
        t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)
    ]
    device = tensors[0].device if tensors else torch.device("cpu")
    with peer_call(what):
        work = call(*args, async_op=True, **kwargs)
    return Posted(work, stream_waits_for(kwargs.get("group"), device))


def collective(call: Callable, /, *args, timeout: float, what: str, **kwargs) -> None:
    """Posts the torch.distributed collective ``call(*args, async_op=True, **kwargs)`` and waits for it at
    most ``timeout`` seconds: a failure while posting or waiting is a :class:`PeerError` naming ``what``."""
    wait_collective(post_collective(call, *args, what=what, **kwargs), timeout, what)


@contextlib.contextmanager
def peer_call(what: str):
    """Wraps one torch.distributed call that has no bounded form (object collectives, blocking sends): a
    ``RuntimeError`` it raises (``DistBackendError`` included) is a :class:`PeerError` naming ``what``; once
    peers are known lost (:func:`peers_lost`), the call is not made and any error is one naming them. Wrap
    the call alone, never code of ours, so that a bug is never mistaken for a lost peer."""
    _raise_if_lost(what)
    try:
        yield
    except PeerError:
        raise
    except Exception as exc:
        if not isinstance(exc, RuntimeError) and _lost is None:
            raise  # before any loss a ValueError or TypeError is ours (a bug), not a lost peer
        lost = f": {_lost}" if _lost is not None else ""
        raise PeerError(f"{what} failed ({exc}){lost}") from exc


# NCCL's watchdog acts on a group's timeout; our own waits give up after p2p_timeout and then name the lost
# peer through the store, which takes a few seconds: the watchdog must come later.
NCCL_WATCHDOG_MARGIN = 60.0


def group_timeout(backend: str, seconds: float) -> timedelta:
    """The timeout to give a process group whose collectives our waits bound by ``seconds``: the same for gloo
    (its timeout is what our wait sees), ``seconds + NCCL_WATCHDOG_MARGIN`` for NCCL, whose watchdog would
    otherwise abort the communicator before the lost-peer diagnosis runs."""
    margin = NCCL_WATCHDOG_MARGIN if backend == "nccl" else 0.0
    return timedelta(seconds=seconds + margin)


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
