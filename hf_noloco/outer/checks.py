"""The outer optimizer's checks (pure): a saved outer state against its optimizer; finite values."""

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
            raise FloatingPointError(
                f"{context}: {what} contain NaN or inf; stopping rather than averaging them into a partner."
            )
