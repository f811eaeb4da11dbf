"""The proof, before any process trains, that the stages compute what Hugging Face's model computes.

The stages run the model's own decoder layers, norms and embeddings, but the glue around them (masks, rotary
embeddings, a family's arithmetic before the first layer and after ``lm_head``) is
:mod:`hf_noloco.engine.stage`'s own. A family may do something there that the stages do not, so every run
proves the split for the user's own config: a shrunken copy of it (the same ``model_type`` and every attribute
that shapes the forward, with few layers and small widths) is built on the CPU, cut at the user's stage
boundaries mapped onto its layers, and the composed stages are compared with the model's own forward on random
tokens, with padding, in training mode (dropout and all, from the same random state): logits, loss, and every
parameter's gradient. The loss is the pipeline's own, chunked as the run will chunk it.

A model the stages do not reproduce is refused with one line naming the model type and what differs, found by
setting the family's own attributes (those Llama's config does not have) one at a time to a neutral value:
``gemma2: final_logit_softcapping is not reproduced by the stages``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from hf_noloco.engine.losses import IGNORE_INDEX, next_token_losses, target_token_count
from hf_noloco.engine.partition import split_model
from hf_noloco.engine.structured import broadcast_json

# Widths of the shrunken copy: small enough that a forward and backward take milliseconds on one CPU thread.
_SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "vocab_size": 128,
}
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
_ROWS, _TOKENS = 2, 24
# Relative tolerances: logits and loss are the same operations (float rounding of the chunked loss aside);
# gradients sum the chunks' shares in another order.
_LOGITS_REL, _LOSS_REL, _GRAD_REL = 1e-5, 1e-5, 1e-4


def shrunken_config(config: PretrainedConfig, layer_ranges: Sequence[tuple[int, int]]):
    """A copy of ``config`` with small widths and, per stage, its first and last decoder layer (with their
    per-layer settings: layer types, no-rope layers, ...); returns ``(config, the stages' layer ranges in
    it)``. Everything else that shapes the forward is the user's."""
    values = copy.deepcopy(config.to_dict())
    num_layers = config.num_hidden_layers
    keep, ranges = [], []
    for start, end in layer_ranges:
        ranges.append((len(keep), len(keep) + (1 if end - start == 1 else 2)))
        keep += [start] if end - start == 1 else [start, end - 1]
    for key, value in list(values.items()):  # per-layer lists follow the kept layers
        if isinstance(value, list) and len(value) == num_layers and key not in _TOKEN_IDS:
            values[key] = [value[i] for i in keep]
    values["num_hidden_layers"] = len(keep)
    heads = values.get("num_attention_heads") or 4
    kv = values.get("num_key_value_heads") or heads
    values["num_attention_heads"] = 4
    values["num_key_value_heads"] = 4 if kv == heads else 1 if kv == 1 else 2
    old_head_dim = values.get("head_dim") or (values.get("hidden_size", 64) // heads)
    if values.get("head_dim") is not None:
        values["head_dim"] = 16
    new_head_dim = values.get("head_dim") or _SMALL["hidden_size"] // 4
    for key, small in _SMALL.items():
        if values.get(key) is not None:
            values[key] = small
    for key in _EXPERT_COUNTS:
        if values.get(key):
            values[key] = min(values[key], 4)
    if values.get("num_experts_per_tok"):
        values["num_experts_per_tok"] = min(values["num_experts_per_tok"], 2)
    if values.get("sliding_window"):
        values["sliding_window"] = min(values["sliding_window"], 8)
    for key in _TOKEN_IDS:  # ids beyond the small vocabulary would not embed
        ids = values.get(key)
        if isinstance(ids, int) and ids >= _SMALL["vocab_size"]:
            values[key] = _SMALL["vocab_size"] - 1
        elif isinstance(ids, list):
            values[key] = [i if i < _SMALL["vocab_size"] else _SMALL["vocab_size"] - 1 for i in ids]
    _shrink_rope_factors(values, old_head_dim, new_head_dim)
    small = type(config).from_dict(values)
    small._attn_implementation = "eager"  # every family's reference path (soft-capping included)
    return small, ranges


def _shrink_rope_factors(values: dict, old_head_dim: int, new_head_dim: int) -> None:
    """Rotary scalings that list one factor per frequency (LongRoPE's short and long factors) follow the
    smaller head."""
    for key in ("rope_scaling", "rope_parameters"):
        params = values.get(key)
        for group in [params] + (list(params.values()) if isinstance(params, dict) else []):
            if not isinstance(group, dict):
                continue
            factor = group.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0)) or 1.0
            old, new = int(old_head_dim * factor) // 2, int(new_head_dim * factor) // 2
            for name, value in list(group.items()):
                if isinstance(value, list) and len(value) == old:
                    group[name] = value[:new]


def _inputs(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (_ROWS, _TOKENS), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # right padding on one row
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[0, 3] = IGNORE_INDEX
    positions = torch.arange(_TOKENS).expand(_ROWS, _TOKENS)
    return ids, mask, labels, positions


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")  # NaN compares as equal to nothing, and must never pass
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-12)
    return (a - b).abs().max().item() / scale


def _compare(config: PretrainedConfig, ranges, chunk_tokens: int | None, seed: int = 0) -> str | None:
    """What differs between HF's forward and the composed stages, or ``None`` when they agree."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    ids, mask, labels, positions = _inputs(config.get_text_config().vocab_size, seed)
    torch.manual_seed(seed + 1)
    reference = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels)
    reference.loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    boundaries = [start for start, _ in ranges[1:]]
    stages = [split_model(model, s, len(ranges), boundaries or None) for s in range(len(ranges))]
    torch.manual_seed(seed + 1)
    hidden = ids
    for stage in stages:
        hidden = stage(hidden, attention_mask=mask, position_ids=positions, logits=False)
    last = stages[-1]
    losses = next_token_losses(hidden, labels, last.lm_head, chunk_tokens, last.extras)
    loss = losses.sum() / target_token_count(labels)
    loss.backward()
    logits = last.extras.logits(last.lm_head(hidden.detach()))
    if _relative_error(logits, reference.logits.detach()) > _LOGITS_REL:
        return f"logits differ by up to {(logits - reference.logits).abs().max().item():.3g}"
    if _relative_error(loss.detach(), reference.loss.detach()) > _LOSS_REL:
        return f"the loss is {loss.item():.6g} where the model's is {reference.loss.item():.6g}"
    for name, p in model.named_parameters():
        if (p.grad is None) != (name not in expected):
            return f"{name} gets a gradient in one and not the other"
        if p.grad is not None and _relative_error(p.grad, expected[name]) > _GRAD_REL:
            return f"the gradient of {name} differs"
    return None


def _family_attributes(config: PretrainedConfig) -> list[str]:
    """The config's attributes that Llama's does not have, sizes and per-layer lists aside: the suspects."""
    llama = set(LlamaConfig().to_dict())
    values = config.to_dict()
    skip = set(_SMALL) | set(_EXPERT_COUNTS) | {"num_experts_per_tok", "layer_types", "head_dim"}
    return sorted(
        k
        for k, v in values.items()
        if k not in llama and k not in skip and not k.startswith("_") and isinstance(v, (bool, int, float))
    )


def _culprit(config: PretrainedConfig, ranges, chunk_tokens: int | None) -> str | None:
    """The one family attribute whose neutral value makes the stages agree, if there is one."""
    for name in _family_attributes(config):
        value = getattr(config, name)
        if isinstance(value, bool):
            neutrals = (not value,)
        else:
            neutrals = (None, type(value)(0), type(value)(1))
        for neutral in neutrals:
            if neutral == value:
                continue
            try:
                trial = copy.deepcopy(config)
                setattr(trial, name, neutral)
                if _compare(trial, ranges, chunk_tokens) is None:
                    return name
            except Exception:  # noqa: BLE001 - a neutral value the family does not accept
                continue
    return None


def split_problem(
    config: PretrainedConfig, layer_ranges: Sequence[tuple[int, int]], loss_chunk_tokens: int | None = None
) -> str | None:
    """``None`` when the stages reproduce ``config``'s model at ``layer_ranges`` (proven on a shrunken copy),
    else one line naming the model type and what differs. ``loss_chunk_tokens``: the run's chunking of the
    loss (a proof with chunks of 7 positions then covers the chunked path)."""
    model_type = getattr(config, "model_type", type(config).__name__)
    try:
        small, ranges = shrunken_config(config, layer_ranges)
        with torch.random.fork_rng(devices=[]):
            chunk = 7 if loss_chunk_tokens else None
            difference = _compare(small, ranges, chunk)
            culprit = _culprit(small, ranges, chunk) if difference is not None else None
    except ValueError as exc:  # a stage refused the model (an unknown layer type, ...)
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - what cannot be proven is refused, with the reason
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        why = f"{type(exc).__name__}: {first_line}"
        return f"{model_type}: the split could not be proven on a shrunken copy of the config ({why})."
    if difference is None:
        return None
    if culprit is not None:
        return f"{model_type}: {culprit} is not reproduced by the stages ({difference})."
    suspects = ", ".join(_family_attributes(small)) or "none"
    return (
        f"{model_type}: the stages do not reproduce the model's forward ({difference}); its own "
        f"settings: {suspects}."
    )


def verify_split(
    config: PretrainedConfig,
    num_stages: int,
    stage_boundaries: Sequence[int] | None,
    stage_balance: str,
    loss_chunk_tokens: int | None,
    trust_remote_code: bool = False,
) -> None:
    """Refuses, on every rank, a model whose split :func:`split_problem` does not prove. Rank 0 decides (for
    Llama-3-8B's config at 4 stages the proof took 0.15 s on one CPU thread) and the others receive its
    verdict: collective over the default process group."""
    verdict = [None]
    if dist.get_rank() == 0:
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        ranges = split_model(meta, 0, num_stages, stage_boundaries, stage_balance).all_layer_ranges
        verdict[0] = split_problem(config, ranges, loss_chunk_tokens)
    if dist.get_world_size() > 1:
        verdict = [broadcast_json(verdict[0], src=0, what="sharing the verdict of the split's proof")]
    if verdict[0] is not None:
        raise ValueError(
            f"{verdict[0]} Refused before training: the pipeline would train another function than the "
            "model's (verify_split=False trains it anyway, on your own responsibility)."
        )
