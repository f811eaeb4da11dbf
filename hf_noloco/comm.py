"""Point-to-point messages with a deadline: a peer that never answers is an error that names it, not a hang."""

from __future__ import annotations

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
    send_works, recv_works = works[: len(sends)], works[len(sends):]
    for work, (_, peer) in zip(recv_works, recvs):
        _wait(work, timeout, f"receiving from {describe_peer(peer)}", context)
    return list(zip(send_works, [peer for _, peer in sends]))


def wait_sends(pending, timeout: float, describe_peer: Callable[[int], str] = lambda r: f"rank {r}", context=""):
    for work, peer in pending:
        _wait(work, timeout, f"sending to {describe_peer(peer)}", context)


def _wait(work: dist.Work, timeout: float, action: str, context: str) -> None:
    try:
        completed = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:  # gloo: timeout or a closed connection (the peer died)
        raise PeerError(f"{context}: failed {action} within p2p_timeout={timeout:g}s ({exc})".lstrip(": ")) from exc
    if completed is False:
        raise PeerError(f"{context}: timed out {action} after p2p_timeout={timeout:g}s".lstrip(": "))
