"""How many bytes one rank needs: a memory model of a pipeline stage, for any config and set of options.

:func:`estimate_stage_memory` predicts the peak memory of one stage replica during training, as the sum of
what it holds for the whole run and the largest thing it holds for a moment:

- **weights, gradients, optimizer state**: the stage's parameters (a tied embedding's second copy on the last
  stage included) in the weights' dtype; AdamW keeps two tensors per parameter in that dtype. Gradients exist
  from a step's first backward to its end (the Trainer frees them after each step).
- **outer state**: NoLoCo and DiLoCo keep float32 slow weights and momentum, 8 bytes per parameter, on the
  device unless ``offload_outer_state``; a block-scaled ``outer_dtype`` (int8, float8_e4m3, int4) adds its
  float32 error-feedback buffers, 4 bytes per parameter and quantity sent (two for noloco with gamma != beta).
- **activations**: what autograd saves for the backward pass, per token and decoder layer, counted tensor by
  tensor for the Hugging Face Llama/Qwen decoder layer with ``sdpa`` attention (no padding mask, so no
  ``tokens x tokens`` tensor is ever made) in three precisions: float32, bfloat16 weights, and float32 weights
  under bf16 autocast (which also saves a bf16 copy of every weight matrix per microbatch in flight). With
  activation checkpointing a layer keeps only its input, and the backward rebuilds one layer at a time. A
  stage holds ``min(pipeline_stages - stage, microbatches)`` microbatches under 1F1B, all of them under GPipe.
- **the loss**: the last stage's float32 log-probabilities and their gradients, ``tokens x vocabulary``
  floats each, for a whole microbatch or, with ``loss_chunk_tokens``, for one chunk.
- **transients**: a layer's backward temporaries, and the outer step's flat buffers (which for a large
  embedding matrix are as large as the matrix in float32), with the wire copies of ``outer_dtype``.
- **an overlapped outer step** (``outer_overlap_steps`` > 0) holds, for the whole of its exchange, a float32
  copy of the stage's weights as they were sent and the wire copies sent and received.
- **NCCL's communicators** (``nccl=True``, an estimate): buffers per connected peer, 32 MiB each (NCCL's
  default 4 MiB buffer, two channels, both directions, simple and LL128 protocols rounded up); a rank connects
  to the replicas of its two neighbour stages, its gossip partners and its collective rings.

The coefficients are not fitted: they are the sizes of the tensors autograd saves (listed per layer in the
comments below). ``benchmarks/memory.py`` checks the predictions against the peak resident memory measured
on CPU for real Llama-3.2-1B, Llama-3.1-8B and Qwen3-8B configurations. What the model leaves out: the
framework's own memory (the CUDA context, about 0.5 GiB per GPU, and allocator caching; compare with
``torch.cuda.max_memory_allocated``), evaluation, and ``eager`` attention (which saves the
``heads x tokens x tokens`` attention weights).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from hf_noloco.engine.buffers import consecutive_buckets
from hf_noloco.engine.schedule import held_limit, pipeline_order
from hf_noloco.outer.compression import bytes_per_value, is_compressed

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes of one stage replica; ``peak`` is what a device must hold."""

    stage: int
    layers: int
    parameters: int
    weights: int
    gradients: int
    optimizer: int
    outer: int
    activations: int  # saved for the backward pass, all microbatches in flight
    activations_per_microbatch: int
    backward_extra: int  # momentary, on top of the activations: a layer's backward, the loss
    outer_step_extra: int  # momentary, after the backward: the outer step's (or ddp's) flat buffers
    communicators: int  # NCCL's buffers (estimated; 0 without nccl)
    peak: int  # see estimate_stage_memory

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.outer + self.communicators

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Shapes:
    hidden: int
    intermediate: int
    q_width: int  # heads x head_dim
    kv_width: int  # key/value heads x head_dim
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool


def _zero_bubble_peak(order, per_micro: int, joint: int) -> int:
    """The most a zb-h1 stage holds over its step's ``order``: each microbatch from its forward to its W
    (``per_micro``), and from its B to its W the kept joint gradients as well (``joint``)."""
    open_, pending, peak = set(), set(), 0
    for op, m in order:
        if op == "F":
            open_.add(m)
        elif op == "B":
            pending.add(m)
        else:  # its W: the graph and the kept gradients are freed
            open_.discard(m)
            pending.discard(m)
        peak = max(peak, len(open_) * per_micro + len(pending) * joint)
    return peak


def _shapes(config) -> _Shapes:
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    qk_norm = text.model_type in ("qwen3",)  # q_norm/k_norm over each head
    return _Shapes(
        text.hidden_size,
        text.intermediate_size,
        heads * head_dim,
        kv_heads * head_dim,
        heads,
        kv_heads,
        head_dim,
        text.vocab_size,
        qk_norm,
    )


def _layer_bytes_per_token(s: _Shapes, mode: str) -> int:
    """Bytes autograd saves per token in one decoder layer (its input included where the layer saves it).

    float32 (4 bytes each): input; RMSNorm's rsqrt, normalised and scaled outputs; q, k, v, the attention
    output and its log-sum-exp (sdpa); the second norm's input, rsqrt and two outputs; the MLP's gate, up,
    SiLU(gate) and product. bfloat16 weights: the norms keep a float32 copy of their input and float32 rsqrt,
    everything else is bf16; the layer's input itself is not kept. Autocast: float32 input and norms, a bf16
    cast of the normed input for each projection, bf16 attention and MLP tensors.
    """
    h, i, q, kv, heads = s.hidden, s.intermediate, s.q_width, s.kv_width, s.heads
    if mode == "float32":
        floats = 6 * h + 2 + 2 * q + 2 * kv + heads + 4 * i
        if s.qk_norm:  # q_norm, k_norm: input, rsqrt and output of each
            floats += 2 * q + heads + 2 * kv + s.kv_heads
        return 4 * floats
    extra = 6 * q + 4 * heads + 6 * kv + 4 * s.kv_heads if s.qk_norm else 0
    if mode == "bfloat16":
        return 16 * h + 8 + 4 * q + 4 * kv + 4 * heads + 8 * i + extra
    return 26 * h + 8 + 4 * q + 4 * kv + 4 * heads + 8 * i + extra  # autocast


@functools.lru_cache(maxsize=64)
def _stage_counts(config_json: str, pipeline_stages: int, boundaries: tuple | None, balance: str):
    """Per stage: (layers, parameters, parameters of the decoder layers' weight matrices, lm_head numel,
    largest parameter numel, bucket sizes in numel). Built on the meta device: no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_noloco.engine.partition import split_model

    config = AutoConfig.for_model(**json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    stages = []
    for stage in range(pipeline_stages):
        part = split_model(model, stage, pipeline_stages, list(boundaries) if boundaries else None, balance)
        params = list(part.parameters())  # a tied last stage: its lm_head copy counts here
        matrices = sum(
            m.weight.numel() for layer in part.model.layers.values() for m in layer.modules() if _is_linear(m)
        )
        head = part.lm_head.weight.numel() if part.is_last else 0
        embed = part.model.embed_tokens.weight.numel() if part.is_first else 0
        numels = [p.numel() for p in params]
        stages.append(
            dict(
                layers=len(part.model.layers),
                parameters=sum(numels),
                matrices=matrices,
                largest=max(numels),
                head=head,
                embed=embed,
                buckets=[
                    sum(numels[j] for j in b)
                    for b in consecutive_buckets([n * 4 for n in numels], 16 * 2**20)
                ],
            )
        )
    return stages


def _is_linear(module) -> bool:
    return isinstance(module, torch.nn.Linear)


def estimate_stage_memory(
    config,
    pipeline_stages: int = 1,
    stage: int = 0,
    *,
    microbatch_size: int = 1,
    seq_len: int = 1024,
    num_microbatches: int | None = None,
    dtype: str = "float32",
    bf16_autocast: bool = False,
    activation_checkpointing: bool = False,
    loss_chunk_tokens: int | None = 1024,
    schedule: str = "1f1b",
    outer_optimizer: str = "noloco",
    offload_outer_state: bool = False,
    num_replicas: int = 2,
    gossip_group_size: int = 2,
    stage_boundaries: Sequence[int] | None = None,
    stage_balance: str = "layers",
    master_weights: str = "float32",
    outer_dtype: str = "float32",
    outer_overlap_steps: int = 0,
    nccl: bool = False,
    sends_slow_weights: bool = False,
) -> MemoryEstimate:
    """Predicted peak bytes of ``stage`` of a ``pipeline_stages``-stage split of ``config`` during training.

    Args mirror the training options: ``microbatch_size`` rows of ``seq_len`` tokens, ``num_microbatches``
    per step (default: ``2 * pipeline_stages``, what ``microbatch_size=None`` aims at); ``dtype`` of the
    weights (``"float32"`` or ``"bfloat16"``), ``bf16_autocast`` (``bf16=True`` with float32 weights);
    ``outer_optimizer`` (``noloco``/``diloco`` keep float32 outer state; ``ddp`` all-reduces gradients;
    ``local`` neither); ``num_replicas`` and ``gossip_group_size`` size the outer step's receive buffers.
    ``master_weights`` as the training option: with ``"float32"`` (its default) bf16 weights are trained as
    float32 masters under bf16 autocast, which is what is counted; ``"none"``: pure bf16. ``outer_dtype``
    and ``outer_overlap_steps`` as the training options; ``nccl`` adds the communicators' buffers;
    ``sends_slow_weights``: noloco with ``outer_averaging`` != ``outer_lr`` (two quantities on the wire).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}.")
    if dtype == "bfloat16" and master_weights == "float32":
        dtype, bf16_autocast = "float32", True  # the trained weights are float32 masters, computed in bf16
    mode = "bfloat16" if dtype == "bfloat16" else ("autocast" if bf16_autocast else "float32")
    act = 2 if mode == "bfloat16" else 4  # bytes of a hidden state between layers
    wbytes = 2 if dtype == "bfloat16" else 4
    s = _shapes(config)
    counts = _stage_counts(
        config.to_json_string(use_diff=False),
        pipeline_stages,
        tuple(stage_boundaries) if stage_boundaries else None,
        stage_balance,
    )[stage]
    first, last = stage == 0, stage == pipeline_stages - 1
    params = counts["parameters"]
    micro = num_microbatches if num_microbatches is not None else 2 * pipeline_stages
    held = held_limit(schedule, micro, pipeline_stages, stage)
    tokens = microbatch_size * seq_len

    weights = params * wbytes
    gradients = params * wbytes
    optimizer = 2 * params * wbytes  # AdamW: exp_avg, exp_avg_sq in the weights' dtype
    has_outer = outer_optimizer in ("noloco", "diloco")
    compressed = is_compressed(outer_dtype)
    quantities = 2 if outer_optimizer == "noloco" and sends_slow_weights else 1
    outer = 8 * params if has_outer and not offload_outer_state else 0
    if has_outer and compressed and not offload_outer_state:  # the error-feedback buffers, float32
        outer += 4 * quantities * params
    wire = bytes_per_value(outer_dtype)
    partners = min(gossip_group_size, num_replicas) - 1
    if has_outer and outer_overlap_steps:  # held while the exchange runs: theta_k and the wire copies
        received = partners if outer_optimizer == "noloco" else (num_replicas if compressed else 0)
        outer += int(params * (4 + wire * (1 + received)))
    communicators = 0
    if nccl:
        peers = 2 * num_replicas + partners + 4  # both neighbour stages' replicas, partners, the rings
        communicators = 32 * 2**20 * peers

    # What one microbatch in flight keeps for its backward.
    layer_full = _layer_bytes_per_token(s, mode)
    copies = 2 * counts["matrices"] // max(counts["layers"], 1) if mode == "autocast" else 0  # bf16 weights
    if activation_checkpointing:
        per_micro = counts["layers"] * tokens * act  # each layer's input
    else:
        per_micro = counts["layers"] * (tokens * layer_full + copies)
    per_micro += 2 * seq_len * s.head_dim * act  # the rotary cos/sin of the microbatch
    if not first and mode == "bfloat16" and not activation_checkpointing:
        per_micro += tokens * s.hidden * 2  # the received input, which bf16 layers do not save themselves
    if not last:
        per_micro += tokens * s.hidden * act  # the stage's output, kept until its gradient comes back
    vocab_tokens = tokens * s.vocab
    chunked = bool(loss_chunk_tokens) and loss_chunk_tokens < tokens
    if last:  # the final norm: its input, rsqrt and outputs (bf16: a float32 copy of the input)
        per_micro += tokens * (8 * s.hidden + 4 if mode == "bfloat16" else 12 * s.hidden + 4)
        if not chunked:  # float32 log-probabilities (and autocast's bf16 copy of lm_head) kept for backward
            per_micro += 4 * vocab_tokens + (2 * counts["head"] if mode == "autocast" else 0)
    activations = held * per_micro
    grad_bytes = 2 if mode == "bfloat16" else 4
    if schedule == "zb-h1" and not first and not activation_checkpointing:
        # A deferred W keeps, beside its microbatch's saved activations, the gradient that reached each joint
        # of its parameters' branches (engine/split_backward.py): every linear layer's output (q, k, v, o,
        # gate, up, down) and each norm's output. The peak is where the schedule's order has the most open.
        joint = tokens * (s.q_width + 2 * s.kv_width + 4 * s.hidden + 2 * s.intermediate) * grad_bytes
        activations = _zero_bubble_peak(
            pipeline_order(schedule, micro, pipeline_stages, stage), per_micro, counts["layers"] * joint
        )

    # The largest momentary extra on top of the activations.
    layer_backward = tokens * (3 * s.intermediate + 3 * s.hidden) * grad_bytes
    if activation_checkpointing:  # one layer rebuilt at a time, with its weight copies under autocast
        layer_backward += tokens * layer_full + copies
    loss_backward = 0
    if last:
        head_grad_bytes = counts["head"] * wbytes  # lm_head's new gradient, before it is added to .grad
        if chunked:
            # the chunked loss's backward: the weight-gradient buffer, and one chunk's logits in the matmul
            # dtype, their float32 copy turned into their gradient, and its matmul-dtype copy
            chunk_logits = loss_chunk_tokens * s.vocab
            loss_backward = head_grad_bytes + chunk_logits * (8 if mode == "float32" else 10)
            if mode == "autocast":
                loss_backward += 4 * counts["head"]  # the bf16 copy of lm_head, and a chunk's bf16 gradient
        else:
            # log-softmax's backward holds the saved float32 log-probabilities (counted above), their
            # gradient and the logits' gradient; then lm_head's backward holds the logits' gradient in its
            # dtype and the weight's new gradient
            logits = tokens * s.vocab
            softmax = 8 * logits
            head = (4 if mode == "float32" else 2) * logits + head_grad_bytes - 4 * logits
            loss_backward = max(softmax, head)
    bucket = max(counts["buckets"])
    if outer_optimizer == "noloco" and compressed:
        # while decoding: own float32 weights and a distance temporary; per quantity sent the group's packets
        # (ours included), every member's decoded values and the mean
        outer_step = bucket * (8 + quantities * ((1 + partners) * (wire + 4) + 4))
    elif outer_optimizer == "noloco":
        # own weights in float32 and on the wire; per partner its copy, and (bf16 wire) its float32 difference
        outer_step = bucket * (4 + (wire if wire != 4 else 0) + partners * (wire + (4 if wire != 4 else 0)))
    elif outer_optimizer == "diloco" and compressed:
        # weights, pseudo-gradient, the encoder's temporaries, the gathered packets, the sum and one decoded
        outer_step = bucket * (4 + 4 + 8 + wire * (1 + num_replicas) + 8)
    elif outer_optimizer == "diloco":
        outer_step = bucket * (4 + wire + 4)  # weights, pseudo-gradient on the wire, its float32 mean
    elif outer_optimizer == "ddp":
        outer_step = bucket * grad_bytes * 2
    else:
        outer_step = 0
    outer_step = int(outer_step)
    # A weight's gradient is computed into a new tensor, then added to .grad (once it exists, from the step's
    # second microbatch on): for the embeddings (and lm_head, above) that temporary is as large as the matrix.
    # The embeddings' gradient comes last in the backward, when the layers' temporaries are gone.
    backward_extra = max(layer_backward + loss_backward, counts["embed"] * wbytes)
    # The Trainer frees the gradients after every step, and the step's first backward allocates them while it
    # frees one microbatch's activations. Under 1F1B with more microbatches than the stage holds, the next
    # forward fills the freed place again, now with the gradients allocated; otherwise (GPipe, or no more
    # forwards) the peak is at one end of that first backward. Or it is at the outer step.
    if schedule in ("1f1b", "zb-h1") and micro > held:
        backward = activations + gradients + backward_extra
    else:
        head_grad = counts["head"] * wbytes  # lm_head's gradient exists from the loss's backward on
        first_backward_starts = activations + backward_extra + head_grad
        first_backward_ends = activations - per_micro + gradients + layer_backward
        backward = max(first_backward_starts, first_backward_ends)
    # After the backward: the column's gradient norm, in float32 a slice of at most 2**24 elements at a time.
    norm = min(counts["largest"], 2**24) * 4 if wbytes != 4 else 0
    peak = weights + optimizer + outer + communicators + max(backward, gradients + max(outer_step, norm))
    return MemoryEstimate(
        stage,
        counts["layers"],
        params,
        weights,
        gradients,
        optimizer,
        outer,
        activations,
        per_micro,
        backward_extra,
        outer_step,
        communicators,
        peak,
    )


def estimate_peak_memory(config, pipeline_stages: int = 1, **options) -> MemoryEstimate:
    """The stage with the largest predicted peak: what every device of the run must hold."""
    estimates = [estimate_stage_memory(config, pipeline_stages, s, **options) for s in range(pipeline_stages)]
    return max(estimates, key=lambda e: e.peak)
