"""The outer optimizer's checks (pure): a saved outer state against its optimizer; finite values, checked as
they come (:func:`check_finite`: a host sync each) or folded into one device flag read once per outer step
(:class:`DeviceChecks`), so that a GPU's buckets pipeline."""

from __future__ import annotations

import torch


def check_saved_outer(
    outer: dict | None,
    method: str,
    phi: list[torch.Tensor],
    delta: list[torch.Tensor],
    errors: list[torch.Tensor],
    num_params: int,
) -> None:
    """Raises ``ValueError`` unless ``outer`` (the ``"outer"`` entry of
    :meth:`~hf_noloco.outer.optimizer.OuterOptimizer.state_dict`) fits an optimizer of outer method
    ``method`` whose per-parameter phi, delta and error-feedback views are given. Error-feedback buffers
    may be missing on either side: saved with a float ``outer_dtype`` (nothing is owed), or loaded into one
    (what was owed, at most half a quantum per value, is dropped)."""
    if outer is None:
        raise ValueError(
            "This optimizer state dict has no 'outer' entry: it was not saved by OuterOptimizer."
        )
    if outer["method"] != method:
        raise ValueError(
            f"The state dict was saved with outer method {outer['method']!r}, but this optimizer "
            f"uses {method!r}."
        )
    if len(outer["phi"]) != len(phi) or len(outer["delta"]) != len(delta):
        raise ValueError(
            f"The state dict holds outer state for {len(outer['phi'])} parameters, this optimizer "
            f"has {len(phi)}."
        )
    pairs = [(s, m, "phi") for s, m in zip(outer["phi"], phi)]
    pairs += [(s, m, "delta") for s, m in zip(outer["delta"], delta)]
    for saved, mine, name in pairs:
        if saved.shape != mine.shape:
            raise ValueError(
                f"Outer state {name} has shape {tuple(saved.shape)}, expected {tuple(mine.shape)}."
            )
    saved_errors = outer.get("error_feedback") or []
    if saved_errors and errors and [t.shape for t in saved_errors] != [t.shape for t in errors]:
        raise ValueError(
            "The saved error-feedback buffers do not fit this optimizer's parameters and outer_dtype: "
            f"{len(saved_errors)} tensors saved, {len(errors)} expected (or their shapes differ)."
        )
    flight = outer.get("in_flight")
    if flight is not None and len(flight["theta"]) != num_params:
        raise ValueError(
            f"The in-flight outer step holds {len(flight['theta'])} tensors, this optimizer has "
            f"{num_params} parameters."
        )


def check_finite(reductions: list[torch.Tensor], what: str, context: str) -> None:
    """Raises ``FloatingPointError`` if a reduction (a sum, a squared distance) of ``what`` is not finite."""
    for t in reductions:
        if not bool(torch.isfinite(t)):
            raise FloatingPointError(_not_finite(what, context))


def _not_finite(what: str, context: str) -> str:
    return f"{context}: {what} contain NaN or inf; stopping rather than averaging them into a partner."


class DeviceChecks:
    """An outer step's finite checks and sums, kept on the device until :meth:`read`, which reads them all at
    once (one host sync per outer step instead of a few per bucket; on a GPU the buckets' exchanges and
    arithmetic then queue behind each other without the host waiting in between).

    :meth:`check` records whether reductions of one item are finite, :meth:`add` a value to a running sum
    (the squared distances to the partners, for the divergence estimate); :meth:`read` raises
    ``FloatingPointError`` naming the first item that was not finite, as :func:`check_finite` would have,
    and returns the sums. What it checks must not have reached the weights before :meth:`read`: write the
    update back only after it (the check comes later than with :func:`check_finite`, which raises before the
    bucket's update)."""

    def __init__(self):
        self._finite: list[torch.Tensor] = []
        self._what: list[str] = []  # the error of each check
        self._on_device: dict[str, torch.Tensor] = {}
        self._on_host: dict[str, float] = {}

    def check(
        self, reductions: list[torch.Tensor], what: str, context: str, message: str | None = None
    ) -> None:
        """Records whether every reduction (a sum, a squared distance) of ``what`` is finite; ``message``: the
        error to raise if not (default: :func:`check_finite`'s)."""
        if reductions:
            self._finite.append(torch.stack([torch.isfinite(t.detach()).all() for t in reductions]).all())
            self._what.append(message or _not_finite(what, context))

    def add(self, name: str, value: torch.Tensor | float) -> None:
        """Adds ``value`` (a 0-d tensor on the device, or a number) to the sum ``name``."""
        self._on_host.setdefault(name, 0.0)
        if torch.is_tensor(value):
            value = value.detach().double()
            before = self._on_device.get(name)
            self._on_device[name] = value if before is None else before + value
        else:
            self._on_host[name] += value

    def read(self) -> dict[str, float]:
        """Reads every check and sum in one transfer; raises ``FloatingPointError`` for the first item that
        was not finite; returns the sums as floats. The checks are cleared."""
        names = list(self._on_device)
        pieces = [f.double().reshape(1) for f in self._finite] + [
            self._on_device[n].reshape(1) for n in names
        ]
        values = torch.cat(pieces).tolist() if pieces else []  # the outer step's one host sync
        what, sums = self._what, dict(self._on_host)
        self._finite, self._what, self._on_device, self._on_host = [], [], {}, {}
        for fine, message in zip(values, what):
            if not fine:
                raise FloatingPointError(message)
        for name, value in zip(names, values[len(what) :]):
            sums[name] += value
        return sums
