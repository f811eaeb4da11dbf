"""What ``hf-noloco-train`` adds to :class:`~hf_noloco.NoLoCoConfig`: which model (:class:`ModelArguments`)
and which data (:class:`DataArguments`), as TRL's scripts take them beside their config.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hf_noloco.rules import (
    BUILTIN_DATASET,
    AttnImplementation,
    WeightDtype,
    check_lora_values,
    help_from_docstring,
    is_local_dataset_path,
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
    """

    model_name_or_path: str | None = None
    model_config: dict | str | None = None
    tokenizer_name_or_path: str | None = None
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

    def __post_init__(self):
        if (self.model_name_or_path is None) == (self.model_config is None):
            raise ValueError(
                "Give exactly one of model_name_or_path (fine-tune) or model_config (pretrain from scratch)."
            )
        if self.use_peft:
            check_lora_values(self.lora_r, self.lora_alpha, self.lora_dropout, self.lora_target_modules)
            from hf_noloco.adapters import require_peft

            require_peft()
            if self.model_name_or_path is None:
                raise ValueError(
                    "use_peft fine-tunes LoRA adapters on a pretrained model: give model_name_or_path (a "
                    "model from scratch has nothing worth freezing)."
                )
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


@help_from_docstring
@dataclass
class DataArguments:
    r"""
    Which text `hf-noloco-train` trains and evaluates on.

    Parameters:
        dataset_name (`str`, *optional*, defaults to `"builtin:python-docs"`):
            A Hub dataset name, a local `.txt`/`.json`/`.jsonl`/`.parquet` file or folder of them, or
            `"builtin:python-docs"`: CPython's own English documentation, which needs no network.
        dataset_config (`str` or `None`, *optional*, defaults to `None`):
            The Hub dataset's configuration name (e.g. `wikitext-103-raw-v1`).
        text_column (`str`, *optional*, defaults to `"text"`):
            The column holding the documents' text.
        block_size (`int`, *optional*, defaults to `256`):
            Tokens per training sequence: documents are concatenated (an end-of-text token after each) and cut
            into blocks of this many tokens.
        validation_split_percentage (`float`, *optional*, defaults to `5`):
            Share of the documents held out for evaluation when the dataset has no validation or test split,
            in [0, 100); chosen by a seeded shuffle of documents (with `streaming`, by a hash of each row's
            content), so no block mixes both sides.
        max_train_samples (`int` or `None`, *optional*, defaults to `None`):
            Keep only the first this many training rows (blocks). With `streaming`, an epoch ends after this
            many blocks over all replicas.
        max_eval_samples (`int` or `None`, *optional*, defaults to `None`):
            Evaluate on at most this many rows (blocks of `block_size` tokens) over all replicas: the first
            ones of the evaluation split, the same at every evaluation. Needed with `streaming` when the
            dataset has no validation split.
        preprocessing_num_proc (`int` or `None`, *optional*, defaults to `None`):
            Processes used to tokenize and pack the dataset (not with `streaming`).
        streaming (`bool`, *optional*, defaults to `False`):
            Read the dataset as a stream (a Hub dataset or local files) instead of downloading and tokenizing
            it first: each replica reads its own shard (whole files when their count divides by the number of
            replicas), tokenizes and packs on the fly, and a checkpoint records where it is, so a resumed run
            continues at the very next block. Nothing is cached and no rank waits for another. Streams are
            read in the source's order (not shuffled), need `max_steps`, and evaluation needs
            `max_eval_samples` when the dataset has no validation split (rows are then held out by a hash of
            their content).
        packing (`bool` or `None`, *optional*, defaults to `None`):
            `True`: concatenate the documents and cut the stream into blocks of `block_size` tokens (blocks
            span documents, and attention crosses from one into the next, as in pretraining). `False`: one
            document per row, truncated to `block_size` and right-padded to it (padding masked out of
            attention and loss), so attention never crosses documents. `None`: `True` for text and
            pre-tokenized rows, `False` for conversations and prompt/completion pairs (which cannot be
            packed).
        add_bos (`bool` or `None`, *optional*, defaults to `None`):
            Put the tokenizer's beginning-of-text token before each text document (and plain prompt/completion
            pair). `None`: if the tokenizer adds one itself (Llama's does; GPT-2's and Qwen's do not). Chat
            templates and pre-tokenized rows keep their own tokens.
        add_eos (`bool` or `None`, *optional*, defaults to `None`):
            Put the tokenizer's end-of-text token after each text document (and plain prompt/completion pair),
            which tells a packed model where documents end. `None`: `True`.
        assistant_only_loss (`bool`, *optional*, defaults to `False`):
            For conversations (a `messages` column, rendered with the tokenizer's chat template): train only
            on the assistant turns, end-of-turn tokens included; every other label is -100.
        completion_only_loss (`bool` or `None`, *optional*, defaults to `None`):
            For `prompt`/`completion` rows: train only on the completion. `None`: `True` for such rows.
        pad_token (`str` or `None`, *optional*, defaults to `None`):
            The token that pads rows to `block_size` (never seen by the model: masked out of attention and
            loss). `None`: the tokenizer's own padding token, or its end-of-text token when it has none (the
            exported tokenizer keeps it as its padding token).
    """

    dataset_name: str = BUILTIN_DATASET
    dataset_config: str | None = None
    text_column: str = "text"
    block_size: int = 256
    validation_split_percentage: float = 5
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    preprocessing_num_proc: int | None = None
    streaming: bool = False
    packing: bool | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    assistant_only_loss: bool = False
    completion_only_loss: bool | None = None
    pad_token: str | None = None

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}.")
        if self.streaming and self.preprocessing_num_proc is not None:
            raise ValueError(
                "preprocessing_num_proc does nothing with streaming=True (each replica tokenizes its own "
                "rows as it reads them): remove it."
            )
        if self.streaming and self.dataset_name == BUILTIN_DATASET and self.max_eval_samples is None:
            raise ValueError(
                "Streaming the built-in corpus (which has no validation split) needs max_eval_samples."
            )
        if self.packing and (self.assistant_only_loss or self.completion_only_loss):
            raise ValueError(
                "packing=True cannot go with assistant_only_loss or completion_only_loss: conversations and "
                "prompt/completion pairs are padded, one per row, so that attention never crosses them."
            )
        if self.assistant_only_loss and self.completion_only_loss:
            raise ValueError(
                "assistant_only_loss (for `messages` rows) and completion_only_loss (for "
                "`prompt`/`completion` rows) apply to different formats: set the one of your dataset."
            )
        for name in ("max_train_samples", "max_eval_samples", "preprocessing_num_proc"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}.")
        if not 0 <= self.validation_split_percentage < 100:
            raise ValueError(
                f"validation_split_percentage must be in [0, 100), got {self.validation_split_percentage}."
            )
        name = self.dataset_name
        if (
            name != BUILTIN_DATASET
            and is_local_dataset_path(name)
            and not os.path.exists(os.path.expanduser(name))
        ):
            raise ValueError(f"dataset_name: no such file or folder {name!r}.")
