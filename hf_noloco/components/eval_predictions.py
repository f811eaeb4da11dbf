"""What a user's ``compute_metrics`` sees: an evaluation's predictions and labels, from every live replica's
last stage, as ``Trainer.evaluate`` hands them (one ``EvalPrediction`` of numpy arrays), and its result on
every rank.

Only the last stage of a column holds a batch's logits, and each live replica evaluates its own shard, so the
predictions are gathered over the last stages (one padded all-gather, as Accelerate's ``gather_for_metrics``
gathers them onto every process), ``compute_metrics`` runs once, on the first live replica's last stage, and
its metrics go to every rank as JSON. A ``compute_metrics`` that raises is raised on every rank (never a
rank left waiting for the others).
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from transformers import EvalPrediction

from hf_noloco.engine.comm import collective
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.structured import (
    all_gather_json,
    broadcast_json,
    checked_dtype,
    checked_shape,
    comm_device,
    dtype_name,
    encode,
)

PAD = -100  # what shorter rows are padded with, as the Trainer pads predictions and labels


class PredictionCollector:
    """Keeps, on the last stage, each evaluated microbatch's predictions (its logits, or what
    ``preprocess_logits_for_metrics(logits, labels)`` makes of them) and labels, on the CPU."""

    def __init__(self, preprocess_logits_for_metrics: Callable | None = None):
        self.preprocess = preprocess_logits_for_metrics
        self.predictions: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        predictions = logits if self.preprocess is None else self.preprocess(logits, labels)
        if not isinstance(predictions, torch.Tensor):
            raise TypeError(
                "preprocess_logits_for_metrics must return one tensor with a row per sample, got "
                f"{type(predictions).__name__}."
            )
        self.predictions.append(predictions.detach().cpu())
        self.labels.append(labels.detach().cpu())


def padded_concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` concatenated along the rows, each padded with :data:`PAD` along its second dimension to the
    longest (the Trainer's ``nested_concat``)."""
    if len({p.shape[1:] for p in parts}) <= 1:
        return torch.cat(parts)
    if len({p.dim() for p in parts}) != 1 or parts[0].dim() < 2:
        raise ValueError("predictions of different shapes cannot be concatenated (one tensor per row)")
    longest = max(p.shape[1] for p in parts)
    out = parts[0].new_full((sum(p.shape[0] for p in parts), longest, *parts[0].shape[2:]), PAD)
    row = 0
    for p in parts:
        out[row : row + p.shape[0], : p.shape[1]] = p
        row += p.shape[0]
    return out


def _gathered(tensor: torch.Tensor | None, mesh: PipelineMesh, what: str) -> torch.Tensor:
    """Every live replica's ``tensor`` (``None``: a replica that evaluated no row), gathered over this
    stage's replica group and padded-concatenated in replica order, on every member."""
    if mesh.num_live_replicas == 1:
        parts = [tensor]
    else:
        group = mesh.replica_group
        mine = None if tensor is None else [list(tensor.shape), dtype_name(tensor.dtype)]
        described = all_gather_json(mine, group=group, what=what)
        shapes = [None if d is None else checked_shape(d[0], what) for d in described]
        dtypes = {checked_dtype(d[1], what) for d in described if d is not None}
        if len(dtypes) > 1:
            raise ValueError(
                f"{what}: the replicas' predictions have different dtypes {sorted(map(str, dtypes))}"
            )
        longest = max([math.prod(s) for s in shapes if s is not None], default=0)
        if not dtypes or not longest:
            parts = [None]
        else:
            device = comm_device(group)
            flat = torch.zeros(longest, dtype=dtypes.pop(), device=device)
            if tensor is not None:
                flat[: tensor.numel()] = tensor.flatten().to(device)
            received = [torch.empty_like(flat) for _ in shapes]
            collective(dist.all_gather, received, flat, group=group, timeout=mesh.timeout, what=what)
            parts = [r[: math.prod(s)].view(s).cpu() for r, s in zip(received, shapes) if s is not None]
    parts = [p for p in parts if p is not None]
    if not parts:
        raise ValueError("compute_metrics: the evaluation scored no row on any replica")
    return padded_concat(parts)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    # numpy has no bfloat16: the Trainer hands such predictions over as float32, and so does this.
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _plain(value):
    """A metric as JSON carries it: numpy and torch values as Python numbers or lists, a non-finite number
    as its name (JSON has none; :func:`_number` reads it back)."""
    if isinstance(value, np.generic | np.ndarray | torch.Tensor):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _number(value):
    return float(value) if value in ("nan", "inf", "-inf") else value


def user_metrics(
    collector: PredictionCollector | None,
    compute_metrics: Callable[[EvalPrediction], dict],
    mesh: PipelineMesh,
    prefix: str,
) -> dict:
    """``compute_metrics``' result for the whole evaluation, its keys prefixed with ``prefix`` as the
    Trainer prefixes them, on every live rank (collective: the last stages gather, every rank receives).
    ``collector`` is the last stage's (``None`` elsewhere)."""
    source = mesh.rank_of(mesh.live_replicas[0], mesh.num_stages - 1)
    result = local_error = None
    if mesh.is_last_stage:
        what = f"{mesh.describe()}: the evaluation's predictions for compute_metrics"
        try:
            # (what fails here fails alike on every last stage: they all read the same descriptions)
            predictions = _gathered(_mine(collector.predictions), mesh, what)
            labels = _gathered(_mine(collector.labels), mesh, what)
            if mesh.rank == source:
                prediction = EvalPrediction(predictions=_numpy(predictions), label_ids=_numpy(labels))
                metrics = compute_metrics(prediction)
                result = {"metrics": {str(k): _plain(v) for k, v in dict(metrics or {}).items()}}
                encode(result)  # a value JSON cannot carry fails here, before the broadcast
        # raised on every rank after the broadcast, so no rank waits for the others
        except Exception as exc:  # noqa: BLE001
            local_error = exc
            if mesh.rank == source:
                result = {"error": traceback.format_exc(limit=6)}
    result = broadcast_json(result, source, group=mesh.world_group, what="compute_metrics' result")
    if local_error is not None and mesh.rank != source:
        raise local_error
    if "error" in result:
        raise RuntimeError(f"compute_metrics failed on {mesh.describe_rank(source)}:\n{result['error']}")
    return {
        (key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"): _number(value)
        for key, value in result["metrics"].items()
    }


def _mine(parts: list[torch.Tensor]) -> torch.Tensor | None:
    return padded_concat(parts) if parts else None
