"""A test double for the host syncs of a GPU run, on CPU: which calls of the hot path would block the host.

No GPU here, so nothing can be measured; what can be counted are the calls that block the host on a GPU:

- reading a tensor's value on the host (``item``, ``tolist``, ``bool``/``int``/``float`` of a tensor,
  ``numpy``, ``cpu``), and ops whose output shape depends on values (``nonzero``, ``masked_select``,
  ``unique``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``);
- a copy between the host and the device that is not ``non_blocking`` (``to`` with a device, ``cuda``), and
  a tensor made from host data straight on a device (``torch.tensor(..., device=...)``): from pageable memory
  both wait for the copy;
- a host wait for a communication (``Work.wait(timeout=...)``; NCCL's plain ``wait()`` is a stream wait).

:class:`HostSyncs` counts the first two kinds per call site (a ``TorchFunctionMode``), :func:`nccl_like`
makes the process groups look like NCCL to :mod:`hf_noloco.engine.comm`: one Work per
``batch_isend_irecv`` (the real gloo operations inside it) and per async collective, whose stream waits are
not counted and whose host waits are. The pipeline's steady state is covered now; an outer step is covered the
same way (its collectives and exchanges go through the same patched calls).

On CPU host and device are one, so the double tells them apart by where a tensor came from: the tensors
given to :meth:`HostSyncs.on_host` (a loader's batch), those made inside it by a factory without a device
(``torch.tensor(rows)``, ``torch.arange(n)``) and everything computed from them are host tensors, until a
``to(device)`` moves them; every other tensor (weights, buffers, what a factory made with a device, what
arrived in a message) is a device tensor. Reading a host tensor costs nothing, moving one to the device
without ``non_blocking`` is a sync, reading a device tensor is one. Not seen: a copy from the device to the
host by ``to(cpu)``, which on CPU reads as a move to the device (the offloaded outer state's copies): the GPU
probe (``benchmarks/gpu_probe.sh``) counts those with ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections import Counter

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from hf_noloco.engine import comm

_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
_SHAPE_FROM_VALUES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)


def _call_site() -> str:
    """The first frame outside torch and this file: ``package/module.py:line``."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and os.path.abspath(name) != _HERE and "contextlib" not in name:
            parts = name.replace(os.sep, "/").split("/")
            return f"{'/'.join(parts[-3:])}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _names_device(value) -> bool:
    return isinstance(value, (torch.device, str, torch.Tensor))


_FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "empty", "full", "linspace", "eye", "randn"}
_FACTORIES |= {"rand", "randint", "randperm", "from_numpy"}


def _tensors(values) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += _tensors(value)
    return found


def _moves(name: str, args, kwargs) -> bool:
    """Whether the call copies its tensor to a device (``to(device)``, ``to(tensor)``, ``cuda()``)."""
    given = kwargs.get("device") is not None or any(_names_device(a) for a in args[1:])
    return name == "cuda" or (name == "to" and given)


class HostSyncs(TorchFunctionMode):
    """Counts the host syncs of the calls made inside it, by ``(kind, call site)`` (see the module)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self._host: dict[int, weakref.ref] = {}  # by id: a WeakSet would compare tensors by value

    def on_host(self, tensors) -> None:
        """Marks ``tensors`` (a loader's batch) as host memory."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._mark(t, True)

    def is_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _mark(self, tensor: torch.Tensor, host: bool) -> None:
        if host:
            self._host[id(tensor)] = weakref.ref(tensor)
        elif self.is_host(tensor):
            del self._host[id(tensor)]

    def kind(self, func, args, kwargs) -> str | None:
        """What kind of host sync ``func(*args, **kwargs)`` is on a GPU, or ``None``."""
        name = getattr(func, "__name__", "")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_device = first is not None and not self.is_host(first)
        blocking = not kwargs.get("non_blocking", False)
        if name in _READS:
            return "device read" if on_device else None
        if name in _SHAPE_FROM_VALUES or (name == "repeat_interleave" and "output_size" not in kwargs):
            return "shape from values" if on_device else None
        if name in ("__getitem__", "__setitem__") and len(args) > 1 and on_device:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                return "shape from values"
        if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            return "host data made on the device"
        if _moves(name, args, kwargs) and first is not None and self.is_host(first) and blocking:
            return "blocking copy"
        source = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if name == "copy_" and source is not None and self.is_host(source) and on_device and blocking:
            return "blocking copy"
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self.kind(func, args, kwargs)
        if kind is not None:
            self.counts[kind, _call_site()] += 1
        out = func(*args, **kwargs)
        self._track(getattr(func, "__name__", ""), args, kwargs, out)
        return out

    def _track(self, name: str, args, kwargs, out) -> None:
        """Where ``out`` lives: moved to the device, made on the host, or where its inputs are."""
        results = _tensors([out])
        if not results:
            return
        inputs = _tensors(list(args) + list(kwargs.values()))
        if _moves(name, args, kwargs):
            host = False
        elif name in _FACTORIES or name.endswith("_like") or name.startswith("new_"):
            host = kwargs.get("device") is None and (not inputs or any(self.is_host(t) for t in inputs))
        elif name == "pin_memory":
            host = True
        else:
            host = any(self.is_host(t) for t in inputs)
        for t in results:
            self._mark(t, host)

    def host_wait(self) -> None:
        self.counts["host wait", _call_site()] += 1

    def total(self) -> int:
        return sum(self.counts.values())

    def by_site(self) -> dict[str, int]:
        return {f"{kind} at {site}": n for (kind, site), n in sorted(self.counts.items())}


class NcclLikeWork:
    """One Work for a batch of operations or a collective, as NCCL returns it: ``wait()`` is a stream wait
    (not counted), ``wait(timeout=...)`` blocks the host (counted). Either way the real gloo works are waited
    for, so the data is there."""

    def __init__(self, works, syncs: HostSyncs, counts: Counter):
        self.works, self.syncs, self.counts = list(works), syncs, counts

    def wait(self, timeout=None):
        if timeout is not None:
            self.syncs.host_wait()
        else:
            self.counts["stream waits"] += 1
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


_COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")


@contextlib.contextmanager
def nccl_like(syncs: HostSyncs):
    """Inside: the process groups look like NCCL to :mod:`hf_noloco.engine.comm` (stream waits), with one
    :class:`NcclLikeWork` per batch of point-to-point operations and per async collective. Yields a counter
    of the stream waits made (so that a test can see the NCCL path was taken)."""
    counts: Counter = Counter()
    saved = {name: getattr(dist, name) for name in ("batch_isend_irecv", *_COLLECTIVES)}
    saved_backend, saved_default = getattr(comm, "_backend_name", None), comm._stream_waits

    def batch_isend_irecv(ops):
        return [NcclLikeWork(saved["batch_isend_irecv"](ops), syncs, counts)]

    def collective(name):
        def call(*args, async_op=False, **kwargs):
            work = saved[name](*args, async_op=async_op, **kwargs)
            return NcclLikeWork([work], syncs, counts) if async_op else work

        return call

    dist.batch_isend_irecv = batch_isend_irecv
    for name in _COLLECTIVES:
        setattr(dist, name, collective(name))
    comm._backend_name = lambda group, device: "nccl"
    comm.use_stream_waits(True)
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        if saved_backend is not None:
            comm._backend_name = saved_backend
        comm.use_stream_waits(saved_default)
