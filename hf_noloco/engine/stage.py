"""One pipeline stage of a Llama-family causal LM: a slice of its decoder layers, with the model's own
modules.

A stage keeps the original module names (``model.embed_tokens``, ``model.layers.7``, ``model.norm``,
``lm_head``), so its state dict is a slice of the full model's and the export is a merge. Decoder layers are
held in a ``ModuleDict`` keyed by their global index for exactly that reason.

The decoder layers, norms, embeddings and rotary embeddings are the model's own modules; what a stage writes
itself is the glue that ``<Model>Model.forward`` and ``<Model>ForCausalLM.forward`` hold, which a stage never
calls: the causal masks (HF's own mask functions, full and sliding window, by each layer's type), the rotary
embeddings (per layer type where the model's rotary module takes one), and the arithmetic around the decoder
stack that some families add (:class:`ForwardExtras`). Anything else a family does there is not reproduced:
:mod:`hf_noloco.engine.fidelity` proves, before training, that the stages compute what HF's model computes,
and refuses the model otherwise.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

# A tied checkpoint stores the shared weight once, under the embeddings' name; lm_head is its other name.
TIED_SOURCE, TIED_COPY = "model.embed_tokens.weight", "lm_head.weight"


# The attention masks a stage builds, by the layer type that uses them (HF's own mask functions).
MASK_FUNCTIONS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


def ties_embeddings(config: PretrainedConfig) -> bool:
    """Whether ``lm_head`` is the input embedding matrix (``tie_word_embeddings=True``)."""
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


@dataclass(frozen=True)
class ForwardExtras:
    """The arithmetic some families add around the decoder stack, in ``<Model>Model.forward`` and
    ``<Model>ForCausalLM.forward``, read from the config (``None``: the family does not do it).

    Args:
        embedding_multiplier: the embeddings are multiplied by it (Granite's ``embedding_multiplier``).
            Embedding scales held by the embedding module itself (Gemma's) need nothing here.
        logit_multiplier: the logits are multiplied by it (Cohere's ``logit_scale``).
        logit_divisor: the logits are divided by it (Granite's ``logits_scaling``).
        final_logit_softcapping: ``c * tanh(logits / c)`` (Gemma 2 and 3).
    """

    embedding_multiplier: float | None = None
    logit_multiplier: float | None = None
    logit_divisor: float | None = None
    final_logit_softcapping: float | None = None

    @classmethod
    def of(cls, config: PretrainedConfig) -> ForwardExtras:
        model_type = getattr(config, "model_type", "")
        value = lambda name: getattr(config, name, None)
        return cls(
            embedding_multiplier=value("embedding_multiplier") if model_type.startswith("granite") else None,
            logit_multiplier=value("logit_scale") if model_type.startswith("cohere") else None,
            logit_divisor=value("logits_scaling") if model_type.startswith("granite") else None,
            final_logit_softcapping=value("final_logit_softcapping"),
        )

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's logits from ``lm_head``'s output, in the order HF applies them."""
        if self.logit_multiplier is not None:
            logits = logits * self.logit_multiplier
        if self.logit_divisor is not None:
            logits = logits / self.logit_divisor
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    @property
    def changes_logits(self) -> bool:
        return any(
            v is not None for v in (self.logit_multiplier, self.logit_divisor, self.final_logit_softcapping)
        )


class PipelineStage(nn.Module):
    """One pipeline stage of a Llama-family causal LM.

    ``forward`` takes token ids on the first stage and hidden states elsewhere, and returns hidden states,
    or logits on the last stage. Parameter names are those of the full model.

    Tied embeddings (``tie_word_embeddings=True``): with one stage, ``lm_head.weight`` *is*
    ``model.embed_tokens.weight``. Across stages the first stage holds the embeddings and the last one
    ``lm_head``: two copies of one weight, built equal and kept equal by summing their gradients after every
    backward (:mod:`hf_noloco.engine.tied`). :attr:`tied_weight` is this stage's copy; the last stage's is the
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
        self.extras = ForwardExtras.of(config)
        layer_types = getattr(config, "layer_types", None)
        sliding = getattr(config, "sliding_window", None) is not None
        self._layer_types = [
            layer_types[i]
            if layer_types is not None
            else ("sliding_attention" if sliding else "full_attention")
            for i in range(*layer_range)
        ]
        unknown = sorted(set(self._layer_types) - set(MASK_FUNCTIONS))
        if unknown:
            raise ValueError(
                f"{getattr(config, 'model_type', type(config).__name__)}: decoder layers of type "
                f"{unknown[0]!r} are not reproduced by the stages (they compute the masks of "
                f"{', '.join(MASK_FUNCTIONS)})."
            )
        self.flatten_packed: bool | None = (
            None  # None: as the attention implementation needs (tests force it)
        )
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

            def fn(function, *args, _inner=fn, **kw):
                with offload_saved_tensors():
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
        varlen: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """Hidden states, or on the last stage the logits; with ``logits=False`` the last stage returns the
        final normed hidden states instead, for a loss that applies ``lm_head`` chunk by chunk
        (:func:`~hf_noloco.engine.losses.next_token_losses`, given :attr:`extras`).

        Packed rows under flash-attention run as one flat row whose sequences the kernels take from
        ``cu_seq_lens`` and ``max_length``: ``varlen`` when given (:func:`packed_sequence_lengths` of the
        rows' positions, computed where they are host data), else computed here from ``position_ids``, once
        for every layer (HF's own code would find them again in each decoder layer, each time waiting for the
        device), and no mask is built (flash-attention's is ``None`` without padding)."""
        hidden = inputs
        if self.is_first:
            hidden = self.model.embed_tokens(inputs)
            if self.extras.embedding_multiplier is not None:
                hidden = hidden * self.extras.embedding_multiplier
        given_positions = position_ids
        rows, seq_len = hidden.shape[:2]
        flat = given_positions is not None and self.flattens_packed_rows
        if flat:  # flash-attention kernels read packed sequences from the positions of one flat row only
            hidden, given_positions = hidden.reshape(1, rows * seq_len, -1), given_positions.reshape(1, -1)
        if given_positions is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        else:
            position_ids = given_positions
        extra = {}
        if flat and self.uses_flash_attention:
            cu, longest = varlen if varlen is not None else packed_sequence_lengths(given_positions)
            extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
            masks = dict.fromkeys(self._layer_types)
        else:  # only given positions are searched for packed sequences (an arange holds none to find)
            masks = self._masks(hidden, attention_mask, given_positions)
        rotary = self._rotary_embeddings(hidden, position_ids)
        recompute = self._checkpoint_fn is not None and self.training and torch.is_grad_enabled()
        for (index, layer), layer_type in zip(self.model.layers.items(), self._layer_types):
            kwargs = dict(
                attention_mask=masks[layer_type],
                position_ids=position_ids,
                position_embeddings=rotary[layer_type],
                **extra,
            )
            if recompute and int(index) % self._checkpoint_every == 0:
                hidden = self._checkpoint_fn(layer, hidden, **kwargs)
            else:
                hidden = layer(hidden, **kwargs)
        if flat:
            hidden = hidden.reshape(rows, seq_len, -1)
        if self.is_last:
            hidden = self.model.norm(hidden)
            if logits:
                hidden = self.extras.logits(self.lm_head(hidden))
        return hidden

    @property
    def flattens_packed_rows(self) -> bool:
        """Whether packed rows (given position ids) are run as one flat row: flash-attention's kernels find
        sequence boundaries in the positions of a batch of one row only (a mask does the job for the other
        implementations)."""
        return self.flatten_packed if self.flatten_packed is not None else _is_flash(self.config)

    @property
    def uses_flash_attention(self) -> bool:
        """Whether the layers run flash-attention kernels (``flash_attention_2``/``3`` and kernels' ones)."""
        return _is_flash(self.config)

    def _masks(self, hidden, attention_mask, position_ids) -> dict[str, torch.Tensor | None]:
        mask_kwargs = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=None,
            position_ids=position_ids,
        )
        return {t: MASK_FUNCTIONS[t](**mask_kwargs) for t in dict.fromkeys(self._layer_types)}

    def _rotary_embeddings(self, hidden, position_ids) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        rotary = self.model.rotary_emb
        if not _takes_layer_type(rotary):
            shared = rotary(hidden, position_ids=position_ids)
            return dict.fromkeys(self._layer_types, shared)
        return {t: rotary(hidden, position_ids, t) for t in dict.fromkeys(self._layer_types)}


def offload_saved_tensors():
    """Tensors saved for the backward pass go to host memory and come back for it, as
    ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` does, without blocking the host: the device-to-host
    copy is ``non_blocking`` into pinned memory (``save_on_cpu`` copies synchronously, a host sync per saved
    tensor), on the current stream, so the saved tensor's later writes and reuse come after it, and the copy
    back is the same stream's too. On the CPU the tensor is copied, as ``save_on_cpu`` copies it."""

    def pack(tensor: torch.Tensor):
        on_device = tensor.device.type != "cpu"
        packed = torch.empty(
            tensor.size(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            pin_memory=on_device and not tensor.is_sparse,
        )
        packed.copy_(tensor, non_blocking=on_device)
        return tensor.device, packed

    def unpack(saved) -> torch.Tensor:
        device, packed = saved
        return packed.to(device, non_blocking=packed.is_pinned())

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def packed_sequence_lengths(positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Flash-attention's ``cu_seq_lens`` (int32, on the positions' device) and ``max_length`` of packed rows
    run as one flat row: a sequence starts wherever the position is the rows' smallest (0 for our packing),
    as ``transformers.modeling_flash_attention_utils.prepare_fa_kwargs_from_position_ids`` finds them. On a
    device this waits for it once (``max_length`` is an int the kernels need); on host positions it does not
    wait at all."""
    flat = positions.reshape(-1)
    starts = (flat == flat.min()).nonzero().view(-1).to(torch.int32)
    cu = torch.cat([starts, starts.new_full((1,), flat.numel())])
    return cu, int(cu.diff().max())


def _is_flash(config) -> bool:
    return "flash" in str(getattr(config, "_attn_implementation", None) or "")


@functools.cache
def _signature_has_layer_type(forward) -> bool:
    return "layer_type" in inspect.signature(forward).parameters


def _takes_layer_type(rotary: nn.Module) -> bool:
    """Whether the model's rotary module computes per layer type (Gemma 3's local and global frequencies)."""
    return _signature_has_layer_type(type(rotary).forward)
