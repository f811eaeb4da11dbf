"""Where a Llama-family causal LM is cut into pipeline stages: which decoder layers each stage holds (evenly,
by estimated compute, or at given boundaries), and :func:`split_model`, the cut itself (no copy).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from transformers import PreTrainedModel

from hf_noloco.engine.stage import PipelineStage
from hf_noloco.rules import STAGE_BALANCES, check_choice, check_stage_boundaries

EXPECTED_LAYOUT = (
    "a Llama-family *ForCausalLM with `model.embed_tokens`, `model.layers` (a ModuleList of decoder "
    "layers), `model.norm`, `model.rotary_emb` and `lm_head` (Llama, Mistral, Qwen2, Qwen3, SmolLM, "
    "TinyLlama, ...)"
)


def check_llama_layout(model: nn.Module) -> None:
    """Raises a ``ValueError`` naming what is missing when ``model`` is not laid out like Llama."""
    base = getattr(model, "model", None)
    missing = []
    if base is None:
        missing.append("model")
    else:
        for name in ("embed_tokens", "norm", "rotary_emb"):
            if not isinstance(getattr(base, name, None), nn.Module):
                missing.append(f"model.{name}")
        if not isinstance(getattr(base, "layers", None), nn.ModuleList):
            missing.append("model.layers (ModuleList)")
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        missing.append("lm_head")
    if missing:
        module = type(model).__module__
        remote = "" if module.startswith("transformers.") else f" (its own code, from {module})"
        raise ValueError(
            f"{type(model).__name__}{remote} is not a Llama-family causal LM: it lacks {', '.join(missing)}. "
            f"hf_noloco splits {EXPECTED_LAYOUT}."
        )


def stage_layer_ranges(
    num_layers: int, num_stages: int, boundaries: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the decoder layers of each stage, end exclusive.

    Without ``boundaries`` the layers are split as evenly as possible, earlier stages taking the remainder
    (10 layers over 3 stages: 4/3/3). ``boundaries`` lists the first layer of stages 1..num_stages-1,
    e.g. ``[4, 7]`` for 4/3/3.
    """
    if num_stages < 1:
        raise ValueError(f"pipeline_stages must be >= 1, got {num_stages}.")
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_stages={num_stages} is more than the model's {num_layers} decoder layers: "
            "every stage needs at least one layer."
        )
    if boundaries is None:
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
        starts = [sum(sizes[:s]) for s in range(num_stages)]
    else:
        check_stage_boundaries(boundaries, num_stages, num_layers)
        starts = [0, *boundaries]
    ends = starts[1:] + [num_layers]
    return list(zip(starts, ends))


def compute_balanced_boundaries(
    layer_costs: Sequence[int], num_stages: int, last_stage_cost: int = 0
) -> list[int]:
    """First layer of stages 1..num_stages-1 that make the costliest stage as cheap as possible.

    ``layer_costs`` are the decoder layers' costs, ``last_stage_cost`` what the last stage does besides its
    layers (lm_head and the loss). Among the splits with the smallest maximum, the one with the smallest sum
    of squared stage costs wins (the most even), then the one whose earlier stages hold more layers, so with
    equal layers and no extra cost this is the even split of :func:`stage_layer_ranges`. Integer costs keep
    the comparisons exact.
    """
    num_layers = len(layer_costs)
    stage_layer_ranges(num_layers, num_stages)  # validates the counts
    prefix = [0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)

    def cost(stage: int, start: int, end: int) -> int:
        return prefix[end] - prefix[start] + (last_stage_cost if stage == num_stages - 1 else 0)

    def best_split(score, combine):
        # best[s][i]: the best score of layers[:i] over stages 0..s-1; start[s][i]: where stage s-1 starts
        best = [[None] * (num_layers + 1) for _ in range(num_stages + 1)]
        start = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0
        for s in range(1, num_stages + 1):
            for i in range(s, num_layers - (num_stages - s) + 1):
                for j in range(s - 1, i):  # ascending with <=: ties go to the latest start
                    if best[s - 1][j] is None or score(s - 1, j, i) is None:
                        continue
                    value = combine(best[s - 1][j], score(s - 1, j, i))
                    if best[s][i] is None or value <= best[s][i]:
                        best[s][i], start[s][i] = value, j
        boundaries, end = [], num_layers
        for s in range(num_stages, 1, -1):
            end = start[s][end]
            boundaries.append(end)
        return best[num_stages][num_layers], boundaries[::-1]

    smallest_max, _ = best_split(cost, max)

    def squared_within_max(stage: int, start: int, end: int) -> int | None:  # None: this stage is not allowed
        c = cost(stage, start, end)
        return c * c if c <= smallest_max else None

    return best_split(squared_within_max, lambda a, b: a + b)[1]


def stage_compute_costs(model: nn.Module) -> tuple[list[int], int]:
    """Multiply-adds per token of each decoder layer and of ``lm_head``: their parameter counts, since a
    dense layer uses each weight once per token. Attention scores, norms and the loss are left out: they are
    small next to the matrix multiplies at the sizes where pipelines pay. Works on the meta device."""
    layer_costs = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    return layer_costs, model.lm_head.weight.numel()


def split_model(
    model: PreTrainedModel,
    stage_index: int,
    num_stages: int,
    stage_boundaries: Sequence[int] | None = None,
    stage_balance: str = "layers",
) -> PipelineStage:
    """The stage ``stage_index`` of ``model``, sharing its modules (no copy). ``model`` may live on the meta
    device; see :func:`build_stage` for materialising only the stage.

    Without ``stage_boundaries``, ``stage_balance`` chooses the split: ``"layers"`` gives every stage the same
    number of decoder layers, ``"compute"`` balances their estimated compute, counting ``lm_head`` on the last
    stage (:func:`compute_balanced_boundaries`).

    With tied embeddings the first stage holds ``embed_tokens`` and the last ``lm_head``; split from one
    model in memory, the two are still the same tensor (so stages composed in one process are the tied
    model), while stages in different processes hold copies that :mod:`hf_noloco.tied` keeps equal."""
    check_llama_layout(model)
    config = model.config
    layers = model.model.layers
    check_choice("stage_balance", stage_balance, STAGE_BALANCES)
    if stage_boundaries is None and stage_balance == "compute":
        layer_costs, head_cost = stage_compute_costs(model)
        stage_boundaries = compute_balanced_boundaries(layer_costs, num_stages, head_cost)
    ranges = stage_layer_ranges(len(layers), num_stages, stage_boundaries)
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}.")
    start, end = ranges[stage_index]
    first, last = stage_index == 0, stage_index == num_stages - 1
    return PipelineStage(
        config,
        stage_index,
        num_stages,
        (start, end),
        [layers[i] for i in range(start, end)],
        ranges,
        rotary_emb=model.model.rotary_emb,
        embed_tokens=model.model.embed_tokens if first else None,
        norm=model.model.norm if last else None,
        lm_head=model.lm_head if last else None,
    )
