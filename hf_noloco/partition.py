"""Split a Llama-family causal LM into pipeline stages by decoder layers, and put the pieces back together.

A stage keeps the original module names (``model.embed_tokens``, ``model.layers.7``, ``model.norm``,
``lm_head``), so its state dict is a slice of the full model's and export is a merge. Decoder layers are
held in a ``ModuleDict`` keyed by their global index for exactly that reason.

Each stage computes the causal mask and the rotary embeddings itself: in transformers they are made once
in ``<Model>Model.forward``, which a stage never calls.
"""

from __future__ import annotations

import functools
import json
import os
import zlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .config import STAGE_BALANCES, check_choice, check_stage_boundaries

IGNORE_INDEX = -100

# A tied checkpoint stores the shared weight once, under the embeddings' name; lm_head is its other name.
TIED_SOURCE, TIED_COPY = "model.embed_tokens.weight", "lm_head.weight"

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


def ties_embeddings(config: PretrainedConfig) -> bool:
    """Whether ``lm_head`` is the input embedding matrix (``tie_word_embeddings=True``)."""
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


class PipelineStage(nn.Module):
    """One pipeline stage of a Llama-family causal LM.

    ``forward`` takes token ids on the first stage and hidden states elsewhere, and returns hidden states,
    or logits on the last stage. Parameter names are those of the full model.

    Tied embeddings (``tie_word_embeddings=True``): with one stage, ``lm_head.weight`` *is*
    ``model.embed_tokens.weight``. Across stages the first stage holds the embeddings and the last one
    ``lm_head``: two copies of one weight, built equal and kept equal by summing their gradients after every
    backward (:mod:`hf_noloco.tied`). :attr:`tied_weight` is this stage's copy; the last stage's is the
    *mirror*, which metrics and the export skip so that the weight counts once.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        stage_index: int,
        num_stages: int,
        layer_range: tuple[int, int],
        layers: Sequence[nn.Module],
        all_layer_ranges: Sequence[tuple[int, int]],
        rotary_emb: nn.Module,
        embed_tokens: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
    ):
        super().__init__()
        self.config = config
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_range = layer_range
        self.all_layer_ranges = list(all_layer_ranges)  # every stage's layers: what a checkpoint resumes with
        self.model = nn.Module()
        if embed_tokens is not None:
            self.model.embed_tokens = embed_tokens
        self.model.layers = nn.ModuleDict({str(i): layer for i, layer in zip(range(*layer_range), layers)})
        if norm is not None:
            self.model.norm = norm
        self.model.rotary_emb = rotary_emb
        if lm_head is not None:
            self.lm_head = lm_head
        layer_types = getattr(config, "layer_types", None)
        sliding = getattr(config, "sliding_window", None) is not None
        self._layer_types = [
            layer_types[i]
            if layer_types is not None
            else ("sliding_attention" if sliding else "full_attention")
            for i in range(*layer_range)
        ]
        self._checkpoint_fn = None  # set by activation_checkpointing_enable
        self._checkpoint_every = 1

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def ties_across_stages(self) -> bool:
        """The embeddings are tied and their two ends live on different stages."""
        return self.num_stages > 1 and ties_embeddings(self.config)

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of the tied embedding matrix when its two ends live on different stages
        (``embed_tokens.weight`` on the first stage, ``lm_head.weight`` on the last), else ``None``."""
        if not self.ties_across_stages:
            return None
        if self.is_first:
            return self.model.embed_tokens.weight
        return self.lm_head.weight if self.is_last else None

    @property
    def mirrored_names(self) -> set[str]:
        """State-dict names of this stage that are copies of a weight another stage counts: the last stage's
        ``lm_head.weight`` when the embeddings are tied across stages."""
        return {TIED_COPY} if self.ties_across_stages and self.is_last else set()

    # -------------------------------------------------------------------- activation checkpointing

    def activation_checkpointing_enable(
        self,
        activation_checkpointing_kwargs: dict | None = None,
        every_n_layers: int = 1,
        offload: bool = False,
    ) -> None:
        """Recompute decoder layers in the backward pass instead of keeping their activations: a layer then
        keeps only its input until its backward. The Trainer calls this when ``activation_checkpointing``
        (alias ``gradient_checkpointing``) is set, with ``every_n_layers`` (checkpoint the layers whose
        global index is a multiple of it) and ``offload`` (keep the saved inputs in host memory) taken from
        ``activation_checkpointing_kwargs``; other keys go to ``torch.utils.checkpoint.checkpoint``. Always
        non-reentrant (the reentrant variant drops the gradients of inputs passed by keyword)."""
        kwargs = dict(activation_checkpointing_kwargs or {})
        if kwargs.pop("use_reentrant", False):
            raise ValueError(
                "activation_checkpointing_kwargs: use_reentrant=True is not supported; the stages checkpoint "
                "their decoder layers with the non-reentrant implementation."
            )
        if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be a positive integer, got {every_n_layers!r}.")
        fn = functools.partial(torch_checkpoint, use_reentrant=False, **kwargs)
        if offload:
            device_type = next(self.parameters()).device.type
            pin = device_type != "cpu"

            def fn(function, *args, _inner=fn, **kw):
                with torch.autograd.graph.save_on_cpu(pin_memory=pin, device_type=device_type):
                    return _inner(function, *args, **kw)

        self._checkpoint_fn, self._checkpoint_every = fn, every_n_layers

    gradient_checkpointing_enable = activation_checkpointing_enable  # the name before transformers 5

    def activation_checkpointing_disable(self) -> None:
        self._checkpoint_fn, self._checkpoint_every = None, 1

    @property
    def is_activation_checkpointing(self) -> bool:
        return self._checkpoint_fn is not None

    # -------------------------------------------------------------------------------- forward

    def forward(
        self,
        inputs: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits: bool = True,
    ) -> torch.Tensor:
        """Hidden states, or on the last stage the logits; with ``logits=False`` the last stage returns the
        final normed hidden states instead, for a loss that applies ``lm_head`` chunk by chunk
        (:func:`next_token_losses`)."""
        hidden = self.model.embed_tokens(inputs) if self.is_first else inputs
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask_kwargs = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=None,
            position_ids=position_ids,
        )
        masks = {}
        if "full_attention" in self._layer_types:
            masks["full_attention"] = create_causal_mask(**mask_kwargs)
        if "sliding_attention" in self._layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        position_embeddings = self.model.rotary_emb(hidden, position_ids=position_ids)
        recompute = self._checkpoint_fn is not None and self.training and torch.is_grad_enabled()
        for (index, layer), layer_type in zip(self.model.layers.items(), self._layer_types):
            kwargs = dict(
                attention_mask=masks[layer_type],
                position_ids=position_ids,
                position_embeddings=position_embeddings,
            )
            if recompute and int(index) % self._checkpoint_every == 0:
                hidden = self._checkpoint_fn(layer, hidden, **kwargs)
            else:
                hidden = layer(hidden, **kwargs)
        if self.is_last:
            hidden = self.model.norm(hidden)
            if logits:
                hidden = self.lm_head(hidden)
        return hidden


def next_token_losses(
    outputs: torch.Tensor,
    labels: torch.Tensor,
    lm_head: nn.Module | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """The cross-entropy of every position's next-token prediction, shape ``(rows, tokens)``, as
    ``LlamaForCausalLM`` computes its loss: labels shifted inside, logits upcast to float32, positions whose
    target is ``-100`` contributing 0. Summed and divided by :func:`target_token_count` it is that loss.

    ``outputs`` are the logits, or, given ``lm_head``, the final hidden states that ``lm_head`` turns into
    logits. With ``lm_head`` and ``chunk_tokens`` (fewer than the positions), positions are scored
    ``chunk_tokens`` at a time, in the forward pass and again in the backward pass, which rebuilds each
    chunk's logits to compute its gradients: at most one chunk's float32 logits exist at any time, instead of
    ``rows * tokens * vocab`` floats (8 GiB for 4 x 4096 tokens of Llama-3's 128k vocabulary, and the
    backward of a cross-entropy holds three such tensors), for one more ``lm_head`` matrix multiply.
    """
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    flat_targets = targets.flatten()
    if lm_head is None:
        return _token_cross_entropy(outputs.flatten(0, 1), flat_targets).view(targets.shape)
    hidden = outputs.flatten(0, 1)
    if not chunk_tokens or chunk_tokens >= hidden.shape[0] or getattr(lm_head, "bias", None) is not None:
        return _token_cross_entropy(lm_head(hidden), flat_targets).view(targets.shape)
    losses = _ChunkedHeadCrossEntropy.apply(hidden, lm_head.weight, flat_targets, chunk_tokens)
    return losses.view(targets.shape)


def _token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # (positions, vocab) rows: three times faster on CPU than the class dimension in the middle
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T)`` per position, ``chunk`` positions at a time in both passes.

    The forward keeps only its inputs. The backward rebuilds a chunk's logits, turns them into their gradient
    in place (``grad_loss * (softmax - one_hot)``, zero where the target is ``-100``) and adds the chunk's
    share to the gradients of ``hidden`` and ``weight``; the weight's gradient is accumulated in the weight's
    dtype, as gradients of microbatches are. Matrix multiplies run in autocast's dtype when autocast is on (as
    ``lm_head`` would), softmax and loss in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        ctx.dtype, ctx.chunk = dtype, chunk
        ctx.save_for_backward(hidden, weight, targets)
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        w = weight.to(dtype)
        with torch.autocast(device, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                t = targets[start : start + chunk]
                logits = (hidden[start : start + chunk].to(dtype) @ w.t()).float()
                picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
                loss = torch.logsumexp(logits, dim=-1).sub_(picked)
                losses[start : start + chunk] = loss.masked_fill_(t == IGNORE_INDEX, 0.0)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, targets = ctx.saved_tensors
        dtype, chunk = ctx.dtype, ctx.chunk
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                t = targets[start : start + chunk]
                h = hidden[start : start + chunk].to(dtype)
                grad = torch.softmax((h @ w.t()).float(), dim=-1)  # then, in place, d loss / d logits
                grad.scatter_add_(1, t.clamp(min=0).unsqueeze(1), grad.new_full((len(t), 1), -1.0))
                scale = grad_losses[start : start + chunk].float().masked_fill(t == IGNORE_INDEX, 0.0)
                grad = grad.mul_(scale.unsqueeze(1)).to(dtype)
                if need_hidden:
                    grad_hidden[start : start + chunk] = grad @ w
                if need_weight and grad_weight.dtype == dtype:
                    grad_weight.addmm_(grad.t(), h)
                elif need_weight:  # autocast: float32 weights, bf16 products
                    grad_weight.add_(grad.t() @ h)
        return grad_hidden, grad_weight, None, None


def target_token_count(labels: torch.Tensor) -> torch.Tensor:
    """The number of positions :func:`next_token_losses` scores (targets other than ``-100``)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


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


def build_stage(
    config: PretrainedConfig,
    stage_index: int,
    num_stages: int,
    stage_boundaries: Sequence[int] | None = None,
    checkpoint: str | os.PathLike | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    stage_balance: str = "layers",
    seed: int | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PipelineStage:
    """Builds one stage without ever holding the full model: the model is built on the meta device (with
    ``dtype`` weights and ``attn_implementation``, transformers' default when ``None``), the stage is
    materialised on ``device``, then filled from ``checkpoint`` (a folder of safetensors files) or initialised
    with the model's own initialisation (``_init_weights``).

    A fresh initialisation draws each module's weights from a generator seeded by ``seed`` (default:
    ``torch.initial_seed()``) and the module's name, so every split of the model, ``pipeline_stages=1``
    included, starts from the same weights, and runs with different splits can be compared. The global
    random state is left as it was. A tied embedding matrix is initialised as the embeddings are, on the
    first stage and on the last alike."""
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code, **extra
        )
    stage = split_model(meta_model, stage_index, num_stages, stage_boundaries, stage_balance)
    stage.to_empty(device=device)
    tied = ties_embeddings(meta_model.config)
    if tied and stage.is_first and stage.is_last:
        stage.lm_head.weight = stage.model.embed_tokens.weight  # to_empty gave the two names two tensors
    # Rotary buffers are computed, not stored: rebuild them on the real device.
    with torch.device(device):
        stage.model.rotary_emb = type(meta_model.model.rotary_emb)(config=meta_model.config)
    if checkpoint is not None:
        load_stage_weights(stage, checkpoint)
    else:
        base_seed = torch.initial_seed() if seed is None else seed
        device = torch.device(device)
        with torch.random.fork_rng(
            devices=[device] if device.type == "cuda" else [], device_type=device.type
        ):
            for name, module in stage.named_modules():
                if tied and name == "lm_head":
                    continue  # the tied weight is initialised as the embeddings, below or by its own name
                torch.manual_seed(module_seed(base_seed, name))
                meta_model._init_weights(module)
            if tied and stage.is_last and not stage.is_first:
                # The last stage's copy: the embeddings' initialisation, drawn from the embeddings' seed.
                embedding = meta_model.model.embed_tokens  # a meta module of the throwaway model
                embedding.weight = stage.lm_head.weight
                torch.manual_seed(module_seed(base_seed, "model.embed_tokens"))
                meta_model._init_weights(embedding)
    return stage


def module_seed(seed: int, module_name: str) -> int:
    """The seed of one module's initialisation: a function of the run's seed and the module's name only."""
    return (seed * 1_000_003 + zlib.crc32(module_name.encode())) % 2**63


def _safetensors_files(checkpoint: str | os.PathLike) -> dict[str, str]:
    """``{tensor name: file}`` for a folder holding ``model.safetensors`` or a sharded index."""
    folder = os.fspath(checkpoint)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(
        f"No model.safetensors or model.safetensors.index.json in {folder}: hf_noloco loads safetensors "
        "checkpoints only (re-save the model with `save_pretrained`)."
    )


def load_stage_weights(stage: PipelineStage, checkpoint: str | os.PathLike) -> None:
    """Reads only this stage's tensors from a safetensors checkpoint into ``stage``."""
    from safetensors import safe_open

    files = _safetensors_files(checkpoint)
    wanted = stage.state_dict()
    by_file: dict[str, list[str]] = {}
    tied = ties_embeddings(stage.config)
    for name in wanted:
        source = name
        if name == TIED_COPY and (tied or name not in files):
            source = TIED_SOURCE  # a tied model's lm_head is its embeddings (HF ties them the same way)
        if source not in files:
            raise KeyError(f"{name} is missing from the checkpoint {os.fspath(checkpoint)}.")
        by_file.setdefault(files[source], []).append((name, source))
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name, source in names:
                    wanted[name].copy_(f.get_tensor(source))


def resolve_checkpoint(
    model_name_or_path: str, revision: str | None = None, trust_remote_code: bool = False
) -> str:
    """A local folder for ``model_name_or_path``: itself, or the Hub snapshot (at ``revision``) of its config,
    weights, generation config and tokenizer files, plus its Python files when ``trust_remote_code``."""
    if os.path.isdir(model_name_or_path):
        if revision is not None:
            raise ValueError(
                f"model_revision={revision!r} applies to Hub models, but {model_name_or_path!r} is a local "
                "folder: check out the revision there instead."
            )
        return model_name_or_path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt"] + (["*.py"] if trust_remote_code else [])
    return snapshot_download(model_name_or_path, revision=revision, allow_patterns=patterns)


def weights_dtype(name: str | None, config: PretrainedConfig) -> torch.dtype:
    """The torch dtype of ``model_init_kwargs["dtype"]``: float32 by default, ``"auto"`` the checkpoint's own
    (``config.dtype``, float32 when it names none)."""
    if name is None:
        return torch.float32
    if name == "auto":
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved, str):
            saved = getattr(torch, saved.removeprefix("torch."), None)
        return saved if saved in (torch.float32, torch.bfloat16) else torch.float32
    return getattr(torch, name)


def load_config(model_name_or_path: str, **overrides) -> PretrainedConfig:
    return AutoConfig.from_pretrained(model_name_or_path, **overrides)
