"""Which model ``hf-noloco-train`` trains (:class:`ModelArguments`), as TRL's scripts take it beside their
config; the data's options are :class:`~hf_noloco.data.arguments.DataArguments`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hf_noloco.docstrings import help_from_docstring
from hf_noloco.rules import (
    AttnImplementation,
    WeightDtype,
    check_lora_values,
    check_lora_variant,
    looks_like_local_path,
)

# model_config sizes that must be positive integers (transformers would fail later, in its own words)
_MODEL_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "head_dim",
)


@help_from_docstring
@dataclass
class ModelArguments:
    r"""
    Which model `hf-noloco-train` trains. Give exactly one of `model_name_or_path` and `model_config`; one
    given on the command line replaces the recipe's.

    Parameters:
        model_name_or_path (`str` or `None`, *optional*, defaults to `None`):
            Fine-tune this Llama-family checkpoint: a Hub id or a local folder of safetensors weights. Each
            process reads only its own stage's tensors.
        model_config (`dict`, `str` or `None`, *optional*, defaults to `None`):
            Pretrain from scratch: the model's config as a mapping with a `model_type` (in a recipe), a JSON
            object (on the command line) or the path of a `config.json`.
        tokenizer_name_or_path (`str` or `None`, *optional*, defaults to `None`):
            The tokenizer (Hub id or folder). `None`: the checkpoint's, or, from scratch, a byte-level BPE
            tokenizer trained on the training documents and saved in `output_dir/tokenizer`.
        chat_template_path (`str` or `None`, *optional*, defaults to `None`):
            The chat template conversations are rendered with, replacing the tokenizer's (TRL's option): a
            Jinja template file, or a tokenizer (Hub id or folder) whose template is taken. The exported
            tokenizer keeps it.
        tokenizer_vocab_size (`int`, *optional*, defaults to `4096`):
            Vocabulary of the BPE tokenizer trained from scratch (at least 259: 256 bytes and 3 special
            tokens).
        model_revision (`str` or `None`, *optional*, defaults to `None`):
            The Hub branch, tag or commit of `model_name_or_path` (and of its tokenizer). `None`: `main`.
        dtype (`str` or `None`, *optional*, defaults to `None`):
            The weights' dtype: `"float32"` (what `None` means), `"bfloat16"` (bf16 weights, trained through
            float32 masters under bf16 autocast unless `master_weights` is `"none"`; the outer state stays
            float32) or `"auto"` (the checkpoint's own). The export is written in it unless `export_dtype`
            says otherwise. float16 is refused (no loss scaling).
        attn_implementation (`str` or `None`, *optional*, defaults to `None`):
            `"sdpa"` (what `None` means), `"eager"`, or `"flash_attention_2"` where the flash_attn package is
            installed.
        trust_remote_code (`bool`, *optional*, defaults to `False`):
            Allow the checkpoint's own modelling code (`auto_map` in its config) to run. The model must still
            be laid out like Llama; anything else is refused with the list of what it lacks.

        > LoRA (PEFT)

        use_peft (`bool`, *optional*, defaults to `False`):
            Fine-tune LoRA adapters (through PEFT, `pip install 'hf-noloco[peft]'`) instead of the whole
            model: each stage gets the adapters of its own layers, the base weights stay frozen, and only the
            adapters train, cross the network at an outer step, and go into checkpoints. The export is a PEFT
            adapter (or, with `merge_adapter`, the merged model). Needs `model_name_or_path`.
        lora_r (`int`, *optional*, defaults to `16`):
            LoRA rank: the inner dimension of each adapter's two factors.
        lora_alpha (`int`, *optional*, defaults to `32`):
            LoRA scaling numerator: the adapter's update is scaled by `lora_alpha / lora_r`.
        lora_dropout (`float`, *optional*, defaults to `0.05`):
            Dropout on the adapters' input, in [0, 1).
        lora_target_modules (`list[str]` or `None`, *optional*, defaults to `None`):
            Names of the modules that get adapters (e.g. `q_proj v_proj`), or `all-linear` (every linear layer
            of the decoder layers). Every pipeline stage must hold at least one. `None`: PEFT's default for
            the architecture (`q_proj` and `v_proj` for Llama-family models).
        lora_modules_to_save (`list[str]` or `None`, *optional*, defaults to `None`):
            Modules trained whole beside the adapters (PEFT's `modules_to_save`, e.g. `lm_head`): each stage
            that holds one trains a copy of it, which the export saves in the adapter. Not a tied embedding
            matrix (two stages hold it).
        lora_task_type (`str`, *optional*, defaults to `"CAUSAL_LM"`):
            PEFT's task type. Only `"CAUSAL_LM"`: the pipeline trains a causal language model.
        use_rslora (`bool`, *optional*, defaults to `False`):
            Rank-stabilised LoRA: the adapter's update is scaled by `lora_alpha / sqrt(lora_r)` instead of
            `lora_alpha / lora_r`.
        use_dora (`bool`, *optional*, defaults to `False`):
            DoRA (weight-decomposed LoRA): each adapted weight's update is split into a direction (the LoRA
            factors) and a trained magnitude per output feature.
        load_in_4bit (`bool`, *optional*, defaults to `False`):
            QLoRA's 4-bit base weights: refused. bitsandbytes' quantized layers need a GPU build of it, and
            their weights cannot be split into stages read tensor by tensor; train LoRA adapters on bf16 base
            weights instead (`dtype: bfloat16`, half the memory of float32).
        load_in_8bit (`bool`, *optional*, defaults to `False`):
            8-bit base weights: refused, as `load_in_4bit`.
    """

    model_name_or_path: str | None = None
    model_config: dict | str | None = None
    tokenizer_name_or_path: str | None = None
    chat_template_path: str | None = None
    tokenizer_vocab_size: int = 4096
    model_revision: str | None = None
    dtype: WeightDtype | None = None
    attn_implementation: AttnImplementation | None = None
    trust_remote_code: bool = False
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None
    lora_modules_to_save: list[str] | None = None
    lora_task_type: str = "CAUSAL_LM"
    use_rslora: bool = False
    use_dora: bool = False
    load_in_4bit: bool = False
    load_in_8bit: bool = False

    def __post_init__(self):
        for name in ("load_in_4bit", "load_in_8bit"):
            if getattr(self, name):
                raise ValueError(
                    f"{name} (QLoRA) is not supported: bitsandbytes' quantized layers need a GPU build of "
                    "it and cannot be split into stages tensor by tensor. Train LoRA adapters on bf16 base "
                    "weights instead (use_peft with dtype: bfloat16)."
                )
        if (self.model_name_or_path is None) == (self.model_config is None):
            raise ValueError(
                "Give exactly one of model_name_or_path (fine-tune) or model_config (pretrain from scratch)."
            )
        if self.use_peft:
            check_lora_values(self.lora_r, self.lora_alpha, self.lora_dropout, self.lora_target_modules)
            check_lora_variant(self.lora_task_type, self.lora_modules_to_save)
            from hf_noloco.adapters.settings import require_peft

            require_peft()
            if self.model_name_or_path is None:
                raise ValueError(
                    "use_peft fine-tunes LoRA adapters on a pretrained model: give model_name_or_path (a "
                    "model from scratch has nothing worth freezing)."
                )
        for name in ("model_name_or_path", "tokenizer_name_or_path", "chat_template_path"):
            path = getattr(self, name)
            if (
                path is not None
                and looks_like_local_path(path)
                and not os.path.exists(os.path.expanduser(path))
            ):
                raise ValueError(
                    f"{name}: no such file or folder {path!r} (a path that looks local is never looked up on "
                    "the Hub)."
                )
        if self.model_name_or_path is not None and os.path.isdir(self.model_name_or_path):
            from hf_noloco.engine.loading import check_model_folder

            check_model_folder(self.model_name_or_path)  # on every rank, before any process group
        if self.model_revision is not None and self.model_name_or_path is None:
            raise ValueError("model_revision applies to model_name_or_path, not to a model_config.")
        if self.model_config is not None:
            self.model_config = model_config_values(self.model_config)
            if self.tokenizer_name_or_path is None and self.tokenizer_vocab_size < 259:
                raise ValueError(
                    "tokenizer_vocab_size must be at least 259 for a byte-level BPE tokenizer, got "
                    f"{self.tokenizer_vocab_size}."
                )

    def model_init_kwargs(self) -> dict:
        """The settings given here, as :class:`NoLoCoConfig`'s ``model_init_kwargs`` holds them."""
        values = {
            "dtype": self.dtype,
            "attn_implementation": self.attn_implementation,
            "revision": self.model_revision,
            "trust_remote_code": self.trust_remote_code or None,
        }
        return {k: v for k, v in values.items() if v is not None}


def model_config_values(spec: dict | str) -> dict:
    """``model_config`` as a checked dict: a mapping, a JSON object or a config.json path, with a
    ``model_type``
    and positive sizes."""
    values = spec
    if isinstance(spec, str) and os.path.isfile(spec):
        try:
            with open(spec) as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"model_config: {spec} is not a readable JSON file ({exc}).") from None
    elif isinstance(spec, str):
        try:
            values = json.loads(spec)
        except json.JSONDecodeError:
            raise ValueError(
                f"model_config is neither a config.json path nor a JSON dict: {spec!r}"
            ) from None
    if not isinstance(values, dict):
        raise ValueError(
            f"model_config must be a mapping of config fields (with a model_type), got {spec!r}."
        )
    if "model_type" not in values:
        raise ValueError("model_config needs a model_type (e.g. llama, mistral, qwen2).")
    for name in _MODEL_SIZES:
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"model_config: {name} must be a positive integer, got {value!r}.")
    return values
