"""The proof, before any process trains, that the stages compute what Hugging Face's model computes.

The stages run the model's own decoder layers, norms and embeddings, but the glue around them (masks, rotary
embeddings, a family's arithmetic before the first layer and after ``lm_head``) is
:mod:`hf_noloco.engine.stage`'s own. A family may do something there that the stages do not, so every run
proves the split for the user's own config: a shrunken copy of it (the same ``model_type`` and every attribute
that shapes the forward, with few layers and small widths) is built on the CPU, cut at the user's stage
boundaries mapped onto its layers, and the composed stages are compared with the model's own forward on random
tokens: logits, loss (the pipeline's own, chunked as the run will chunk it), and, in training, every
parameter's gradient.

**Every input form the run feeds its stages** is proven, each against HF's forward given the same rows the way
HF's own Trainer gives them (no cache: its ``use_cache`` is off), since a family's attention may depend on how
the mask arrives, or whether it arrives (:data:`FORMS`):

- ``unpadded``: rows with neither attention mask nor position ids (wrapped rows): HF gets ``input_ids`` and
  ``labels``, as the stages do.
- ``padded``: rows with an attention mask (one document per row) and no position ids, on both sides: a batch
  with padding, and one whose mask is all ones (which sdpa's mask code drops; its logits and loss).
- ``packed``: rows of whole sequences whose position ids restart at each (best-fit-decreasing bins): the
  stages get the positions and no mask (the pipeline drops it), HF the same, as a padding-free collator gives
  them. A family whose model does not hand the positions to its mask functions (GPT-OSS, AFMoE) lets packed
  sequences attend to each other in HF's own forward, and is refused on this form. Under a flash-attention run
  the stages flatten such rows into one, as they do in the run, and the reference is HF's forward on each
  sequence as a row of its own (what the kernels compute from packed positions).
- ``evaluation``: the evaluation path, in eval mode without gradients, on each row form proven (padded rows:
  the batch with padding).

``forms`` (:func:`split_problem`, :func:`verify_split`) names the forms the run uses (:func:`forms_of_rows`
gives a dataset's); the others are skipped, all are proven without it. The proof runs at the run's attention
implementation where it runs on a CPU (``eager``, ``sdpa``, or transformers' default when none is given); any
other (flash attention, flex attention, hub kernels) is proven with transformers' default CPU implementation
standing in, flattening packed rows as that run does: the GPU kernels themselves are not run. A flattened
packed form runs without dropout (attention dropout over one flat row draws other numbers than over separate
rows). Given the run's ``dtype`` (the dtype of its weights and hidden states) other than float32, every proven
row form is also compared in that dtype, in eval mode: logits within a few roundings of the largest, the loss
within 1e-3 (it is float32 cross-entropy of the same logits, soft-capped in float32 where HF soft-caps in the
logits' dtype). Under autocast with float32 weights the stages' glue sees float32 hidden states: the float32
proof's path.

**Lengths.** The proof's rows are :data:`PROOF_TOKENS` tokens long, and every setting that may bound how far
attention or rotary behaviour reaches (a sliding window, an attention chunk, a dynamic mask's window, the
context length at which a rotary scaling switches, a top-k of keys) is shrunk so that the rows reach past it.
Nothing in a config says which settings are lengths, so the rule takes every integer setting, at the top level
or in a nested dict (rotary parameters per layer type included), that is larger than :data:`KEPT_LENGTH`, is
not an identifier (a name ending in ``_id``, ``_ids`` or ``_index``), is larger than the model's number of
layers (a smaller one may count layers: Qwen2's ``max_window_layers``), is not a width the shrinking sets, and
changes no parameter's or buffer's shape: such settings are mapped, in their order (equal values stay equal),
onto ``KEPT_LENGTH + 1, KEPT_LENGTH + 2, ...`` (at most :data:`LONGEST_SHRUNK`), below the length of every row
and of the longest sequence of each packed row. Some of them are not lengths (an integer rotary base, Gemma's
``query_pre_attn_scalar``); they then take another value on both sides of the comparison, which the model's
own modules read: the proof is of the glue, which reads none of them but
:class:`~hf_noloco.engine.stage.ForwardExtras`' settings, whose role does not change with their value. Lists
are not searched (per-layer lists follow the kept layers).

A model the stages do not reproduce is refused with one line naming the model type, the input form and what
differs, found by setting the family's own attributes (those Llama's config does not have) one at a time to a
neutral value: ``gemma2: final_logit_softcapping is not reproduced by the stages on unpadded rows (...)``.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace

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
# Settings the shrinking itself sets: never taken for lengths.
_SET_HERE = {*_SMALL, *_EXPERT_COUNTS, "num_hidden_layers", "num_attention_heads", "num_key_value_heads"}
_SET_HERE |= {"head_dim", "num_experts_per_tok"}
_IDENTIFIER_SUFFIXES = ("_id", "_ids", "_index")
_ROWS = 2
PROOF_TOKENS = 32  # every row of the proof; packed rows hold sequences of 19 + 13, and 25 + 7 of padding
KEPT_LENGTH = PROOF_TOKENS // 4  # length settings up to this stay; longer ones are shrunk to just above it
_PACKED = ((19, 13), (25,))  # sequence lengths per packed row (the rest of a row: padding, positions restart)
# What the longest length setting becomes, at most: the longest sequence of every packed row reaches past it.
LONGEST_SHRUNK = min(max(lengths) for lengths in _PACKED) - 1
_PADDING = 5  # right padding of the padded batch's second row
# Relative tolerances: logits and loss are the same operations (float rounding of the chunked loss aside);
# gradients sum the chunks' shares in another order. In bfloat16 or float16, a few roundings of the largest.
_LOGITS_REL, _LOSS_REL, _GRAD_REL = 1e-5, 1e-5, 1e-4
_LOW_PRECISION_LOGITS_REL, _LOW_PRECISION_LOSS_REL = 1e-2, 1e-3
_GRADIENT_FLOOR = 1e-3


@dataclass(frozen=True)
class InputForm:
    """One way the run hands rows to its stages (and HF's Trainer to the model)."""

    name: str
    description: str
    mask: bool = False  # the batch carries an attention mask (padding)
    positions: bool = False  # the batch carries position ids (packed sequences)


FORMS = {
    "unpadded": InputForm("unpadded", "unpadded rows (no attention mask, no position ids)"),
    "padded": InputForm("padded", "padded rows (an attention mask)", mask=True),
    "packed": InputForm(
        "packed", "packed rows (position ids restarting at each sequence, no attention mask)", positions=True
    ),
    "evaluation": InputForm("evaluation", "the evaluation path (eval mode, no gradients)"),
}
ROW_FORMS = ("unpadded", "padded", "packed")


def forms_of_rows(columns: Iterable[str]) -> str:
    """The row form (:data:`ROW_FORMS`) of a dataset with ``columns``, as the pipeline reads its batches:
    ``position_ids`` make packed rows (their mask, if any, is dropped), an ``attention_mask`` padded rows,
    neither unpadded rows."""
    columns = set(columns)
    if "position_ids" in columns:
        return "packed"
    return "padded" if "attention_mask" in columns else "unpadded"


class _FormError(Exception):
    """A form on which the proof could not run (an exception in the model or the stages)."""

    def __init__(self, form: str, cause: Exception):
        super().__init__(str(cause))
        self.form, self.cause = form, cause


# ------------------------------------------------------------------------------------------ the copy


def shrunken_config(config: PretrainedConfig, layer_ranges: Sequence[tuple[int, int]]):
    """A copy of ``config`` with small widths and, per stage, its first and last decoder layer (with their
    per-layer settings: layer types, no-rope layers, ...), its length settings shrunk below the proof's rows
    (see the module's docstring); returns ``(config, the stages' layer ranges in it)``. Everything else that
    shapes the forward is the user's."""
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
    for key in _TOKEN_IDS:  # ids beyond the small vocabulary would not embed
        ids = values.get(key)
        if isinstance(ids, int) and ids >= _SMALL["vocab_size"]:
            values[key] = _SMALL["vocab_size"] - 1
        elif isinstance(ids, list):
            values[key] = [i if i < _SMALL["vocab_size"] else _SMALL["vocab_size"] - 1 for i in ids]
    _shrink_rope_factors(values, old_head_dim, new_head_dim)
    _shrink_lengths(values, type(config), num_layers)
    return type(config).from_dict(values), ranges


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


def _length_candidates(values: dict, num_layers: int) -> list[tuple[str, ...]]:
    """The paths (keys from the top) of the integer settings the length rule may shrink."""
    found = []

    def walk(mapping: dict, path: tuple[str, ...]) -> None:
        for key, value in mapping.items():
            if isinstance(value, dict):
                walk(value, (*path, key))
            elif (
                isinstance(value, int)
                and not isinstance(value, bool)
                and value > max(KEPT_LENGTH, num_layers)
                and not (not path and key in _SET_HERE)
                and not str(key).endswith(_IDENTIFIER_SUFFIXES)
                and not str(key).startswith("_")
            ):
                found.append((*path, key))

    walk(values, ())
    return found


def _get(values: dict, path: tuple[str, ...]):
    for key in path:
        values = values[key]
    return values


def _set(values: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        values = values[key]
    values[path[-1]] = value


def _shapes(values: dict, config_class) -> dict | None:
    """Every parameter's and buffer's shape of the model ``values`` describe (built on the meta device), or
    ``None`` when it cannot be built."""
    try:
        config = config_class.from_dict(copy.deepcopy(values))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - a value the family does not accept: not shrunk
        return None
    return {n: tuple(t.shape) for n, t in itertools.chain(model.named_parameters(), model.named_buffers())}


def _shrink_lengths(values: dict, config_class, num_layers: int) -> None:
    """The length rule of the module's docstring, in place."""
    candidates = _length_candidates(values, num_layers)
    if not candidates:
        return
    reference = _shapes(values, config_class)
    if reference is None:  # the proof will say why the model cannot be built
        return

    def shrunk(paths) -> dict:
        trial = copy.deepcopy(values)
        order = sorted({_get(values, p) for p in paths})
        for path in paths:
            _set(trial, path, min(KEPT_LENGTH + 1 + order.index(_get(values, path)), LONGEST_SHRUNK))
        return trial

    trial = shrunk(candidates)
    if _shapes(trial, config_class) != reference:  # some are widths: keep only those that change no shape
        candidates = [p for p in candidates if _shapes(shrunk([p]), config_class) == reference]
        trial = shrunk(candidates)
    values.clear()
    values.update(trial)


# ------------------------------------------------------------------------------------------ the rows


@dataclass
class _Batch:
    model_inputs: dict  # what HF's Trainer gives the model (labels aside)
    attention_mask: torch.Tensor | None  # what the pipeline gives the stages
    position_ids: torch.Tensor | None
    labels: torch.Tensor
    gradients: bool = True  # in training, its gradients are compared too


def _batches(form: InputForm, vocab: int, seed: int) -> list[_Batch]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (_ROWS, PROOF_TOKENS), generator=g)
    labels = ids.clone()
    labels[0, 3] = IGNORE_INDEX
    if form.positions:
        positions = torch.empty_like(ids)
        for row, lengths in enumerate(_PACKED):
            padding = PROOF_TOKENS - sum(lengths)
            pieces = [torch.arange(n) for n in lengths] + ([torch.arange(padding)] if padding else [])
            positions[row] = torch.cat(pieces)
            if padding:
                labels[row, -padding:] = IGNORE_INDEX
        labels[positions == 0] = IGNORE_INDEX  # no sequence learns to predict the next one's start
        return [_Batch({"input_ids": ids, "position_ids": positions}, None, positions, labels)]
    if form.mask:
        batches = []
        for padding in (_PADDING, 0):  # with padding, and a batch whose rows are full (a mask of ones)
            mask = torch.ones_like(ids)
            if padding:
                mask[1, -padding:] = 0
            padded = labels.masked_fill(mask == 0, IGNORE_INDEX)
            # The mask of ones changes what the attention receives, not how gradients flow: its logits and
            # loss are compared, in training mode, its gradients not (the padded batch's are).
            batches.append(
                _Batch({"input_ids": ids, "attention_mask": mask}, mask, None, padded, bool(padding))
            )
        return batches
    return [_Batch({"input_ids": ids}, None, None, labels)]


def _relative_error(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    """The largest difference over the largest entry of either (or ``floor``, if larger)."""
    return _relative_errors([a], [b], floor)[0]


def _relative_errors(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], floor: float = 1e-12
) -> list[float]:
    """:func:`_relative_error` of each pair, read from the device at once. A NaN or an infinity on either
    side gives ``inf`` (NaN compares as equal to nothing, and must never pass): the largest entry or the
    largest difference is then not finite."""
    stats = torch.stack(
        [
            torch.stack([(x.float() - y.float()).abs().max(), x.float().abs().max(), y.float().abs().max()])
            for x, y in zip(a, b)
        ]
    ).tolist()
    return [
        d / max(s, t, floor) if math.isfinite(d) and math.isfinite(s) and math.isfinite(t) else math.inf
        for d, s, t in stats
    ]


# ------------------------------------------------------------------------------------ the comparison


@dataclass(frozen=True)
class _Proof:
    """How the proof runs: the run's choices that change the stages' path."""

    chunk_tokens: int | None  # the loss's chunking (None: one piece)
    forms: tuple[str, ...]  # FORMS names, in the order they are proven
    attn_implementation: str | None  # what the shrunken copy is built with (None: transformers' default)
    flatten_packed: bool  # packed rows run as one flat row (flash-attention runs)
    dtype: torch.dtype  # the run's weights and hidden states


def _build(config: PretrainedConfig, ranges, proof: _Proof, dtype: torch.dtype, seed: int):
    torch.manual_seed(seed)
    config = copy.deepcopy(config)
    model = AutoModelForCausalLM.from_config(
        config, dtype=dtype, attn_implementation=proof.attn_implementation
    )
    boundaries = [start for start, _ in ranges[1:]]
    stages = [split_model(model, s, len(ranges), boundaries or None) for s in range(len(ranges))]
    for stage in stages:
        stage.flatten_packed = proof.flatten_packed
    return model, stages


def _run_stages(stages, batch: _Batch, chunk_tokens: int | None):
    hidden = batch.model_inputs["input_ids"]
    for stage in stages:
        hidden = stage(
            hidden, attention_mask=batch.attention_mask, position_ids=batch.position_ids, logits=False
        )
    last = stages[-1]
    losses = next_token_losses(hidden, batch.labels, last.lm_head, chunk_tokens, last.extras)
    loss = losses.sum() / target_token_count(batch.labels)
    return hidden, loss


def _reference(model, batch: _Batch, proof: _Proof):
    """HF's forward on ``batch`` as HF's Trainer gives it (no cache). Packed rows under a flash-attention run:
    HF's forward on each packed sequence as a row of its own, which is what flash attention's
    variable-length kernels compute from packed rows' positions (the CPU implementation standing in for
    them would, in families whose model does not pass positions to its mask, let the sequences attend to
    each other); its loss is HF's own, over the batch's target tokens (``num_items_in_batch``)."""
    if not (proof.flatten_packed and batch.position_ids is not None):
        return model(**batch.model_inputs, labels=batch.labels, use_cache=False)
    ids, positions, labels = batch.model_inputs["input_ids"], batch.position_ids, batch.labels
    count = target_token_count(labels)
    rows, loss = [], 0.0
    for row in range(ids.shape[0]):
        starts = (positions[row] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        pieces = []
        for start, end in zip(starts, starts[1:]):
            piece = slice(start, end)
            out = model(
                input_ids=ids[row : row + 1, piece],
                labels=labels[row : row + 1, piece],
                use_cache=False,
                num_items_in_batch=count,
            )
            pieces.append(out.logits)
            loss = loss + out.loss
        rows.append(torch.cat(pieces, dim=1))
    return SimpleNamespace(logits=torch.cat(rows), loss=loss)


def _check(model, stages, batch: _Batch, proof: _Proof, seed: int, training: bool, gradients: bool, rel):
    """What differs on one batch, or ``None``."""
    model.train(training)
    for stage in stages:
        stage.train(training)
    logits_rel, loss_rel = rel
    with torch.set_grad_enabled(gradients):
        torch.manual_seed(seed + 1)
        reference = _reference(model, batch, proof)
        expected = {}
        if gradients:
            reference.loss.backward()
            expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
        torch.manual_seed(seed + 1)
        hidden, loss = _run_stages(stages, batch, proof.chunk_tokens)
        if gradients:
            loss.backward()
    last = stages[-1]
    with torch.no_grad():
        logits = last.extras.logits(last.lm_head(hidden.detach()))
    if _relative_error(logits, reference.logits.detach()) > logits_rel:
        difference = (logits.float() - reference.logits.detach().float()).abs().max().item()
        return f"logits differ by up to {difference:.3g}"
    if _relative_error(loss.detach(), reference.loss.detach()) > loss_rel:
        return f"the loss is {loss.item():.6g} where the model's is {reference.loss.item():.6g}"
    # A gradient that nearly cancels to zero (a scalar's sum over every token) is float noise on both sides:
    # each is compared relative to its own largest entry or to _GRADIENT_FLOOR of the model's, if larger.
    if gradients:
        for name, p in model.named_parameters():
            if (p.grad is None) != (name not in expected):
                return f"{name} gets a gradient in one and not the other"
        names = list(expected)
        grads = [model.get_parameter(name).grad for name in names]
        largest = max(torch.stack([g.abs().max() for g in expected.values()]).max().item(), 0.0)
        errors = _relative_errors(grads, [expected[n] for n in names], max(_GRADIENT_FLOOR * largest, 1e-12))
        for name, error in zip(names, errors):
            if error > _GRAD_REL:
                return f"the gradient of {name} differs"
    model.zero_grad(set_to_none=True)
    return None


def _compare(config: PretrainedConfig, ranges, proof: _Proof, seed: int = 0) -> tuple[str, str, tuple] | None:
    """``(the form, what differs, the forms that prove it again)`` for the first form on which HF's forward
    and the composed stages differ, or ``None`` when they agree on every form of ``proof``. Raises
    :class:`_FormError` for a form on which they cannot run."""
    vocab = config.get_text_config().vocab_size
    model, stages = _build(config, ranges, proof, torch.float32, seed)
    rows = [name for name in proof.forms if name in ROW_FORMS]
    checks = [(name, True, True) for name in rows]  # (form, training, gradients)
    rows = rows or list(ROW_FORMS)  # the evaluation path alone: on every row form
    if "evaluation" in proof.forms:  # (a mask of ones differs from padding in training already)
        checks += [(name, False, False) for name in rows]
    for name, training, gradients in checks:
        form = FORMS[name]
        label = form.description if training else f"{FORMS['evaluation'].description}, on {form.description}"
        # A flat row draws attention dropout over another shape than the rows: compared without dropout.
        flat_packed = form.positions and proof.flatten_packed
        try:
            for batch in _batches(form, vocab, seed)[: None if training else 1]:
                mode = training and not flat_packed
                rel = (_LOGITS_REL, _LOSS_REL)
                difference = _check(
                    model, stages, batch, proof, seed, mode, gradients and batch.gradients, rel
                )
                if difference is not None:
                    return label, difference, (name,) if training else (name, "evaluation")
        except Exception as exc:  # named with its form by split_problem
            raise _FormError(label, exc) from exc
    if proof.dtype != torch.float32:
        model, stages = _build(config, ranges, proof, proof.dtype, seed)
        for name in rows:
            form = FORMS[name]
            label = f"{form.description} in {str(proof.dtype).removeprefix('torch.')}"
            try:
                for batch in _batches(form, vocab, seed):
                    rel = (_LOW_PRECISION_LOGITS_REL, _LOW_PRECISION_LOSS_REL)
                    difference = _check(model, stages, batch, proof, seed, False, False, rel)
                    if difference is not None:
                        return label, difference, (name,)
            except Exception as exc:
                raise _FormError(label, exc) from exc
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


def _culprit(config: PretrainedConfig, ranges, proof: _Proof) -> str | None:
    """The one family attribute whose neutral value makes the stages agree, if there is one."""
    for name in _family_attributes(config):
        value = getattr(config, name)
        if isinstance(value, bool):
            neutrals = (not value,)
        elif not value:  # already at a neutral value (a dropout of 0 set to 1 would hide every difference)
            neutrals = (None,)
        else:
            neutrals = (None, type(value)(0), type(value)(1))
        for neutral in neutrals:
            if neutral == value:
                continue
            try:
                trial = copy.deepcopy(config)
                setattr(trial, name, neutral)
                if _compare(trial, ranges, proof) is None:
                    return name
            except Exception:  # noqa: BLE001 - a neutral value the family does not accept
                continue
    return None


def _resolve_forms(forms: Collection[str] | None) -> tuple[str, ...]:
    if forms is None:
        return tuple(FORMS)
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise ValueError(f"Unknown input forms {unknown}: the forms are {', '.join(FORMS)}.")
    return tuple(name for name in FORMS if name in set(forms))


def split_problem(
    config: PretrainedConfig,
    layer_ranges: Sequence[tuple[int, int]],
    loss_chunk_tokens: int | None = None,
    *,
    attn_implementation: str | None = None,
    forms: Collection[str] | None = None,
    dtype: torch.dtype | None = None,
) -> str | None:
    """``None`` when the stages reproduce ``config``'s model at ``layer_ranges`` (proven on a shrunken copy),
    else one line naming the model type, the input form and what differs.

    Args:
        loss_chunk_tokens: the run's chunking of the loss (a proof with chunks of 7 positions then covers the
            chunked path).
        attn_implementation: the run's attention implementation; ``None``: the config's own, else
            transformers' default (see the module's docstring for those that do not run on a CPU).
        forms: the input forms the run feeds its stages (names of :data:`FORMS`); ``None``: all of them.
        dtype: the dtype of the run's weights and hidden states; ``None``: float32.
    """
    model_type = getattr(config, "model_type", type(config).__name__)
    run_attention = attn_implementation or getattr(config, "_attn_implementation", None)
    proof = _Proof(
        chunk_tokens=7 if loss_chunk_tokens else None,
        forms=_resolve_forms(forms),
        attn_implementation=run_attention if run_attention in ("eager", "sdpa") else None,
        flatten_packed="flash" in str(run_attention or ""),
        dtype=dtype or torch.float32,
    )
    try:
        small, ranges = shrunken_config(config, layer_ranges)
        with torch.random.fork_rng(devices=[]):
            found = _compare(small, ranges, proof)
            # The culprit is looked for on the form that differs.
            culprit = None if found is None else _culprit(small, ranges, replace(proof, forms=found[2]))
    except Exception as exc:  # noqa: BLE001 - what cannot be proven is refused, with the reason
        cause = exc.cause if isinstance(exc, _FormError) else exc
        if isinstance(cause, ValueError) and str(cause).startswith(f"{model_type}:"):
            return str(cause)  # a stage refused the model (an unknown layer type, ...)
        first_line = str(cause).splitlines()[0] if str(cause) else ""
        why = f"{type(cause).__name__}: {first_line}"
        where = f", on {exc.form}" if isinstance(exc, _FormError) else ""
        return f"{model_type}: the split could not be proven on a shrunken copy of the config{where} ({why})."
    if found is None:
        return None
    form, difference, _ = found
    if culprit is not None:
        return f"{model_type}: {culprit} is not reproduced by the stages on {form} ({difference})."
    suspects = ", ".join(_family_attributes(small)) or "none"
    return (
        f"{model_type}: the stages do not reproduce the model's forward on {form} ({difference}); its own "
        f"settings: {suspects}."
    )


def verify_split(
    config: PretrainedConfig,
    num_stages: int,
    stage_boundaries: Sequence[int] | None,
    stage_balance: str,
    loss_chunk_tokens: int | None,
    trust_remote_code: bool = False,
    *,
    attn_implementation: str | None = None,
    forms: Collection[str] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Refuses, on every rank, a model whose split :func:`split_problem` does not prove. Rank 0 decides and
    the others receive its verdict: collective over the default process group. For Llama-3-8B's config at 4
    stages the proof of every form took 0.11 s on one CPU thread (0.06 s for wrapped rows and evaluation,
    0.15 s with bfloat16 weights too; ``benchmarks/fidelity_cost.py``).

    ``attn_implementation``, ``forms`` and ``dtype`` are the run's (see :func:`split_problem`); without
    ``attn_implementation``, the one transformers picks for the model."""
    verdict = [None]
    if dist.get_rank() == 0:
        with torch.device("meta"):  # (the run's attention implementation may need a GPU's packages)
            meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        ranges = split_model(meta, 0, num_stages, stage_boundaries, stage_balance).all_layer_ranges
        attention = attn_implementation or meta.config._attn_implementation  # transformers' default
        verdict[0] = split_problem(
            config, ranges, loss_chunk_tokens, attn_implementation=attention, forms=forms, dtype=dtype
        )
    if dist.get_world_size() > 1:
        verdict = [broadcast_json(verdict[0], src=0, what="sharing the verdict of the split's proof")]
    if verdict[0] is not None:
        raise ValueError(
            f"{verdict[0]} Refused before training: the pipeline would train another function than the "
            "model's (verify_split=False trains it anyway, on your own responsibility)."
        )
