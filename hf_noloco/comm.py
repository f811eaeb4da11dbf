"""Messages with a deadline, and the flat buffers they carry.

A peer that never answers is an error that names it, not a hang: every wait here is bounded. Tensors travel
in flat buffers, built from consecutive tensors (:func:`consecutive_buckets`, :func:`flatten`) and copied back
(:func:`unflatten_into`), one message per bucket instead of one per tensor.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


class PeerError(RuntimeError):
    """A peer did not answer within the deadline, or its connection broke."""


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    timeout: float,
    describe_peer: Callable[[int], str] = lambda rank: f"rank {rank}",
    context: str = "",
) -> list[dist.Work]:
    """Posts every send and receive at once (``batch_isend_irecv``), waits for the receives and returns the
    pending sends, which the caller must keep (with their tensors) until it waits on them with
    :func:`wait_sends`. ``sends``/``recvs`` are ``(tensor, global peer rank)`` pairs; two messages to the same
    peer arrive in the order they are listed."""
    ops = [dist.P2POp(dist.isend, tensor, peer) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, tensor, peer) for tensor, peer in recvs]
    if not ops:
        return []
    works = dist.batch_isend_irecv(ops)
    send_works, recv_works = works[: len(sends)], works[len(sends) :]
    for work, (_, peer) in zip(recv_works, recvs):
        _wait(work, timeout, f"receiving from {describe_peer(peer)}", context)
    return list(zip(send_works, [peer for _, peer in sends]))


def wait_sends(
    pending, timeout: float, describe_peer: Callable[[int], str] = lambda r: f"rank {r}", context=""
):
    for work, peer in pending:
        _wait(work, timeout, f"sending to {describe_peer(peer)}", context)


def _wait(work: dist.Work, timeout: float, action: str, context: str) -> None:
    try:
        completed = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:  # gloo: timeout or a closed connection (the peer died)
        raise PeerError(
            f"{context}: failed {action} within p2p_timeout={timeout:g}s ({exc})".lstrip(": ")
        ) from exc
    if completed is False:
        raise PeerError(f"{context}: timed out {action} after p2p_timeout={timeout:g}s".lstrip(": "))


def wait_collective(work: dist.Work, timeout: float, what: str) -> None:
    """Waits for an async collective (``async_op=True``) for at most ``timeout`` seconds; a lost member is a
    :class:`PeerError` that says which collective and which ranks were involved."""
    _wait(work, timeout, "to complete", what)


class PeerWatch:
    """Tells, after a communication failure, which peers are gone, and keeps the job's first failure.

    A gloo/NCCL collective that fails says only that "a connection closed" or "timed out", not which rank was
    lost. So each rank stamps a counter in the rendezvous store every ``interval`` seconds from a daemon
    thread (the store is hosted by the launcher's agent under torchrun/accelerate, so it outlives any worker).
    A rank whose communication fails marks itself as failing, then watches the counters for ``3 * interval``:
    the peers whose counter did not move and that are not failing themselves are lost (killed, crashed, frozen
    or cut off). The first failing rank stores its diagnosis; ranks that fail after it (their peer is gone)
    just read it, so every rank's error names the lost peer. All of this is best effort: without a reachable
    store (e.g. it lived in a rank that died) the errors are the plain ones.
    """

    def __init__(self, rank: int, world_size: int, interval: float = 0.5):
        self.rank, self.world_size, self.interval = rank, world_size, interval
        self._prefix = "hf_noloco/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._stop = threading.Event()
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self.store = _get_default_store()
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
        self._stop.set()

    def diagnose(
        self, message: str, describe: Callable[[int], str], find_lost: bool = True, timeout: float = 5.0
    ) -> str | None:
        """Records ``message`` (this rank's failure) and returns the job's first failure: ``message`` (plus
        the lost peers, with ``find_lost``) when this rank is the first, another rank's record otherwise;
        ``None``
        without a store."""
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


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One new 1-D buffer holding ``tensors`` one after the other (in ``dtype``, default their own)."""
    return torch.cat([t.detach().reshape(-1).to(dtype or t.dtype) for t in tensors])


def unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copies consecutive slices of ``flat`` back into ``tensors`` (the inverse of :func:`flatten`)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


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
