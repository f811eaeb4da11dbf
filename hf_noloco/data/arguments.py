"""Which text a run trains and evaluates on: :class:`DataArguments` (TRL's names), and the rule that tells a
local dataset path from a Hub name. Every ``prepare_*`` of :mod:`hf_noloco.data.datasets` takes one
:class:`DataArguments`; ``hf-noloco-train`` parses it from the recipe and the command line.

This module imports neither ``datasets`` nor torch: the command checks its options before loading anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass

from hf_noloco.docstrings import help_from_docstring
from hf_noloco.rules import PackingStrategy

BUILTIN_DATASET = "builtin:python-docs"
# Extensions that make a dataset_name local files (to be found here, never looked up on the Hub).
DATA_FILE_EXTENSIONS = (
    ".txt",
    ".json",
    ".jsonl",
    ".parquet",
    ".csv",
    ".tsv",
    ".arrow",
    ".gz",
    ".zst",
    ".bz2",
    ".xz",
)


def is_local_dataset_path(name: str) -> bool:
    """Whether ``dataset_name`` means local files. Hub names are ``name`` or ``owner/name``; anything with a
    file extension we read, or that starts like a filesystem path, is local, and must then exist (never fall
    through to the Hub)."""
    return (
        os.path.exists(os.path.expanduser(name))
        or name.startswith(("/", ".", "~"))
        or os.path.splitext(name)[1].lower() in DATA_FILE_EXTENSIONS
        or name.count("/") > 1
    )


@help_from_docstring
@dataclass
class DataArguments:
    r"""
    Which text `hf-noloco-train` trains and evaluates on. The names are TRL's (`SFTConfig`, its scripts'
    `ScriptArguments` and `DatasetMixtureConfig`) where TRL has the setting.

    Parameters:
        > Source

        dataset_name (`str`, *optional*, defaults to `"builtin:python-docs"`):
            A Hub dataset name, a local file or folder of files in any format `datasets` reads (text,
            JSON/JSON Lines, CSV, Parquet, Arrow; compressed ones too), a folder written by
            `Dataset.save_to_disk`, or `"builtin:python-docs"`: CPython's own English documentation, which
            needs no network. A folder's files are split by their names as `datasets` does (`train*`,
            `test*`, `validation*`); a `.txt` file gives one row per paragraph.
        dataset_config (`str` or `None`, *optional*, defaults to `None`):
            The Hub dataset's configuration name (e.g. `wikitext-103-raw-v1`).
        dataset_revision (`str` or `None`, *optional*, defaults to `None`):
            The Hub dataset's branch, tag or commit. `None`: `main`.
        data_files (`str`, `list[str]`, `dict` or `None`, *optional*, defaults to `None`):
            The files to read, as `datasets.load_dataset` takes them: a path or glob, a list of them, or a
            mapping from split name to them (in a recipe; on the command line a JSON object). Relative to
            `dataset_name` when that is a Hub dataset or a local folder.
        data_dir (`str` or `None`, *optional*, defaults to `None`):
            A folder inside the Hub dataset (or local folder) to read the files of.
        dataset_train_split (`str`, *optional*, defaults to `"train"`):
            The split to train on.
        dataset_test_split (`str` or `None`, *optional*, defaults to `None`):
            The split to evaluate on. `None`: `validation`, else `test`, else `validation_split_percentage`
            of the training rows, held out.
        dataset_mixture (`dict`, `str` or `None`, *optional*, defaults to `None`):
            Train on several datasets at once, in TRL's `DatasetMixtureConfig` format: `{datasets: [{path,
            name, data_dir, data_files, split, columns, fraction}, ...], test_split_size}` (`id`, `config`
            and `weight` are read as `path`, `name` and `fraction`, the alignment handbook's names). Each
            dataset's split is loaded and its `columns` kept; with `fraction` on every dataset, the mixture
            keeps the first `round(fraction * N)` rows of each, for the largest `N` that repeats no row (TRL's
            rule); the rows are concatenated in order. `test_split_size` (a fraction or a row count) holds
            rows out, by a seeded shuffle, for evaluation. Replaces `dataset_name` (not with
            `dataset_streaming`).
        dataset_text_field (`str`, *optional*, defaults to `"text"`):
            The column holding the documents' text (rows without a `messages`, `prompt`/`completion` or
            `input_ids` column).
        validation_split_percentage (`float`, *optional*, defaults to `5`):
            Share of the documents held out for evaluation when the dataset has no evaluation split, in [0,
            100); chosen by a seeded shuffle of documents (with `dataset_streaming`, by a hash of each row's
            content), so no row mixes both sides.
        max_train_samples (`int` or `None`, *optional*, defaults to `None`):
            Keep only the first this many training rows. With `dataset_streaming`, an epoch ends after this
            many rows over all replicas.
        max_eval_samples (`int` or `None`, *optional*, defaults to `None`):
            Evaluate on at most this many rows over all replicas: the first ones of the evaluation split, the
            same at every evaluation. Needed with `dataset_streaming` when the dataset has no evaluation
            split and the run evaluates.
        dataset_num_proc (`int` or `None`, *optional*, defaults to `None`):
            Processes used to tokenize and pack the dataset (not with `dataset_streaming`).

        > Rows

        max_length (`int`, *optional*, defaults to `256`):
            Tokens per training row. Packed rows are exactly this long; a document, conversation or
            prompt/completion pair longer than it is truncated (counted, and reported once), and a shorter
            one is padded (or packed with others).
        packing (`bool` or `None`, *optional*, defaults to `None`):
            Put several documents into one row of `max_length` tokens (`packing_strategy` says how) instead
            of padding each to a row. `None`: `True` for text and pre-tokenized rows, and for any rows when
            `packing_strategy` is given; `False` for conversations and prompt/completion pairs otherwise.
        packing_strategy (`str` or `None`, *optional*, defaults to `None`):
            `"wrapped"`: concatenate the documents and cut the stream into rows (rows span documents, and
            attention crosses from one into the next, as in pretraining; nothing is truncated). `"bfd"`:
            best-fit-decreasing bins of whole documents (each truncated to `max_length`), every row padded to
            `max_length`, with position ids restarting at each document so that attention never crosses
            one (the loss of a packed row equals its documents' losses unpacked). `"bfd_split"`: as `"bfd"`,
            but a document longer than `max_length` is cut into pieces that are packed too. `None`:
            `"wrapped"` for text and pre-tokenized rows, `"bfd"` for conversations and prompt/completion
            pairs. TRL's `pack_dataset` makes the bins; not with `dataset_streaming`.
        padding_free (`bool`, *optional*, defaults to `False`):
            TRL's option, as the pipeline can give it: its rows all have one shape, so `True` packs the
            sequences into rows with position ids (`packing_strategy: bfd`, unless `bfd_split` is given)
            rather than flattening a batch into one row. Refused with `packing: false` or `wrapped`.
        add_bos (`bool` or `None`, *optional*, defaults to `None`):
            Put the tokenizer's beginning-of-text token before each text document (and plain prompt/completion
            pair). `None`: if the tokenizer adds one itself (Llama's does; GPT-2's and Qwen's do not). Chat
            templates and pre-tokenized rows keep their own tokens.
        add_eos (`bool` or `None`, *optional*, defaults to `None`):
            Put the tokenizer's end-of-text token after each text document (and plain prompt/completion pair),
            which tells a packed model where documents end. `None`: `True`.
        assistant_only_loss (`bool`, *optional*, defaults to `False`):
            For conversations (a `messages` column, rendered with the tokenizer's chat template, with the
            row's `tools` when it has that column): train only on the assistant turns, end-of-turn tokens
            included; every other label is -100.
        completion_only_loss (`bool` or `None`, *optional*, defaults to `None`):
            For `prompt`/`completion` rows: train only on the completion. `None`: `True` for such rows.
        pad_token (`str` or `None`, *optional*, defaults to `None`):
            The token that pads rows to `max_length` (never seen by the model: masked out of attention and
            loss). `None`: the tokenizer's own padding token, or its end-of-text token when it has none (the
            exported tokenizer keeps it as its padding token).
        eos_token (`str` or `None`, *optional*, defaults to `None`):
            The token that ends a turn or a sequence (TRL's option): it becomes the tokenizer's end-of-text
            token, which `add_eos` appends and the exported tokenizer keeps. It must be in the tokenizer's
            vocabulary. `None`: the tokenizer's own.
        truncation_mode (`str`, *optional*, defaults to `"keep_start"`):
            Which part of a row longer than `max_length` is kept: `"keep_start"` (the only mode, as in TRL
            1.x; `"keep_end"`, deprecated there, is refused).
        pad_to_multiple_of (`int`, `str` or `None`, *optional*, defaults to `None`):
            Rows with padding (padded rows, best-fit-decreasing bins) are padded past `max_length` to the next
            multiple of this number (their content still ends at `max_length`); wrapped rows, which have no
            padding, need a `max_length` that is a multiple of it. `None` or `"auto"` (TRL's default, which
            pads only on AWS Neuron): rows of exactly `max_length`.
        eval_packing (`bool` or `None`, *optional*, defaults to `None`):
            Whether the evaluation rows are packed (as `packing` says for the training rows). `None`: as the
            training rows.
        dataset_kwargs (`dict`, `str` or `None`, *optional*, defaults to `None`):
            TRL's dataset options; the only key is `skip_prepare_dataset`: `true` takes the dataset's rows as
            they are (an `input_ids` column, and `labels`, `attention_mask`, `position_ids` if it has them;
            every row of one length), without tokenizing, packing or padding.

        > Streams

        dataset_streaming (`bool`, *optional*, defaults to `False`):
            Read the dataset as a stream (a Hub dataset or local files) instead of downloading and tokenizing
            it first: each replica reads its own share (whole files when there are at least as many files as
            replicas, so every row is read once; otherwise every replica reads all rows and keeps one in
            `num_replicas`), tokenizes and packs on the fly, and a checkpoint records where it is, so a
            resumed run continues at the very next row. Nothing is cached and no rank waits for another.
            Needs `max_steps`; evaluating on a dataset without an evaluation split needs `max_eval_samples`
            (rows are then held out by a hash of their content).
        shuffle_dataset (`bool`, *optional*, defaults to `False`):
            With `dataset_streaming`: read each epoch's files in a seeded order (the run's `seed` and the
            epoch) and draw rows from a buffer of `shuffle_buffer_size` documents, whose content and random
            state go into checkpoints, so a resumed run reads exactly the rows a straight run would. (Map
            datasets are always shuffled by the Trainer's sampler.)
        shuffle_buffer_size (`int`, *optional*, defaults to `1000`):
            Documents held in the shuffle buffer of a streamed dataset.

        > Former names (deprecated)

        block_size (`int` or `None`, *optional*, defaults to `None`):
            Deprecated: the former name of `max_length`.
        text_column (`str` or `None`, *optional*, defaults to `None`):
            Deprecated: the former name of `dataset_text_field`.
        preprocessing_num_proc (`int` or `None`, *optional*, defaults to `None`):
            Deprecated: the former name of `dataset_num_proc`.
        streaming (`bool` or `None`, *optional*, defaults to `None`):
            Deprecated: the former name of `dataset_streaming`.
    """

    dataset_name: str = BUILTIN_DATASET
    dataset_config: str | None = None
    dataset_revision: str | None = None
    data_files: dict | str | list[str] | None = None
    data_dir: str | None = None
    dataset_train_split: str = "train"
    dataset_test_split: str | None = None
    dataset_mixture: dict | str | None = None
    dataset_text_field: str = "text"
    validation_split_percentage: float = 5
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    dataset_num_proc: int | None = None
    max_length: int = 256
    packing: bool | None = None
    packing_strategy: PackingStrategy | None = None
    padding_free: bool = False
    add_bos: bool | None = None
    add_eos: bool | None = None
    assistant_only_loss: bool = False
    completion_only_loss: bool | None = None
    pad_token: str | None = None
    eos_token: str | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | str | None = None
    eval_packing: bool | None = None
    dataset_kwargs: dict | str | None = None
    dataset_streaming: bool = False
    shuffle_dataset: bool = False
    shuffle_buffer_size: int = 1000
    block_size: int | None = None
    text_column: str | None = None
    preprocessing_num_proc: int | None = None
    streaming: bool | None = None

    def __post_init__(self):
        self._take_former_names()
        if self.max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {self.max_length}.")
        self._check_sft_options()
        self.data_files = _json_value(self.data_files, "data_files")
        if self.dataset_mixture is not None:
            self.dataset_mixture = mixture_values(self.dataset_mixture)
            if self.dataset_streaming:
                raise ValueError("dataset_mixture cannot be streamed yet: set dataset_streaming: false.")
        if self.dataset_streaming and self.dataset_num_proc is not None:
            raise ValueError(
                "dataset_num_proc does nothing with dataset_streaming=True (each replica tokenizes its own "
                "rows as it reads them): remove it."
            )
        if self.shuffle_dataset and not self.dataset_streaming:
            raise ValueError(
                "shuffle_dataset shuffles a streamed dataset (dataset_streaming: true); map datasets are "
                "shuffled by the Trainer's sampler already."
            )
        if self.shuffle_buffer_size < 1:
            raise ValueError(
                f"shuffle_buffer_size must be a positive integer, got {self.shuffle_buffer_size}."
            )
        if self.packing is False and self.packing_strategy is not None:
            raise ValueError(f"packing_strategy={self.packing_strategy!r} needs packing (packing is false).")
        if self.dataset_streaming and self.packing_strategy in ("bfd", "bfd_split"):
            raise ValueError(
                f"packing_strategy={self.packing_strategy!r} needs the whole dataset to make its bins: not "
                "with dataset_streaming (streams pack with 'wrapped', or pad)."
            )
        if self.padding_free:
            if self.packing is False or self.packing_strategy not in ("bfd", "bfd_split", None):
                raise ValueError(
                    "padding_free=True: the rows of a pipeline all have one shape, so sequences are packed "
                    "into rows with position ids (packing_strategy: bfd) rather than flattened into one; it "
                    "cannot go with packing: false or packing_strategy: wrapped."
                )
            self.packing, self.packing_strategy = True, self.packing_strategy or "bfd"
        if self.packing_strategy == "wrapped" and (self.assistant_only_loss or self.completion_only_loss):
            raise ValueError(
                "packing_strategy='wrapped' cannot go with assistant_only_loss or completion_only_loss: "
                "wrapped rows let attention cross from one conversation into the next; use "
                "packing_strategy: bfd."
            )
        if self.assistant_only_loss and self.completion_only_loss:
            raise ValueError(
                "assistant_only_loss (for `messages` rows) and completion_only_loss (for "
                "`prompt`/`completion` rows) apply to different formats: set the one of your dataset."
            )
        for name in ("max_train_samples", "max_eval_samples", "dataset_num_proc"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}.")
        if not 0 <= self.validation_split_percentage < 100:
            raise ValueError(
                f"validation_split_percentage must be in [0, 100), got {self.validation_split_percentage}."
            )
        name = self.dataset_name
        if (
            self.dataset_mixture is None
            and name != BUILTIN_DATASET
            and is_local_dataset_path(name)
            and not os.path.exists(os.path.expanduser(name))
        ):
            raise ValueError(f"dataset_name: no such file or folder {name!r}.")

    def _check_sft_options(self) -> None:
        """TRL's SFTConfig data options, with TRL's meanings (where one cannot apply, a refusal names it)."""
        if self.truncation_mode != "keep_start":
            raise ValueError(
                f"truncation_mode={self.truncation_mode!r} is not supported: only 'keep_start' (TRL 1.x's "
                "only mode; it deprecated 'keep_end')."
            )
        multiple = self.pad_to_multiple_of
        if multiple == "auto":
            self.pad_to_multiple_of = multiple = None
        if isinstance(multiple, str) and multiple.isdigit():
            self.pad_to_multiple_of = multiple = int(multiple)
        if multiple is not None and (
            isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1
        ):
            raise ValueError(f"pad_to_multiple_of must be a positive integer or 'auto', got {multiple!r}.")
        if multiple is not None and self.dataset_streaming and self.max_length % multiple:
            raise ValueError(
                f"pad_to_multiple_of={multiple} with dataset_streaming: a stream's rows are max_length "
                f"tokens, so max_length ({self.max_length}) must be a multiple of it."
            )
        if self.eval_packing is not None and self.dataset_streaming and self.eval_packing != self.packing:
            raise ValueError(
                "eval_packing with dataset_streaming: a stream's evaluation rows are laid out as its "
                "training rows (set packing instead)."
            )
        self.dataset_kwargs = _json_value(self.dataset_kwargs, "dataset_kwargs")
        kwargs = self.dataset_kwargs
        if kwargs is not None:
            if not isinstance(kwargs, dict) or set(kwargs) - {"skip_prepare_dataset"}:
                raise ValueError(
                    "dataset_kwargs takes one key, skip_prepare_dataset (TRL's), got "
                    f"{sorted(kwargs) if isinstance(kwargs, dict) else kwargs!r}."
                )
            if kwargs.get("skip_prepare_dataset") and self.dataset_streaming:
                raise ValueError(
                    "dataset_kwargs skip_prepare_dataset is not supported with dataset_streaming."
                )

    @property
    def skip_prepare_dataset(self) -> bool:
        return bool((self.dataset_kwargs or {}).get("skip_prepare_dataset"))

    def _take_former_names(self) -> None:
        """The deprecated names set their TRL-named setting (the two agreeing, if both are given)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for old, new in FORMER_DATA_NAMES.items():
            value = getattr(self, old)
            if value is None:
                continue
            current = getattr(self, new)
            if current != defaults[new] and current != value:
                raise ValueError(f"{old} is the former name of {new}: give one of them, not both.")
            warnings.warn(f"`{old}` is deprecated: use `{new}` (TRL's name).", FutureWarning, stacklevel=3)
            setattr(self, new, value)
            setattr(self, old, None)


# The data options' former names, and the TRL names that replace them.
FORMER_DATA_NAMES = {
    "block_size": "max_length",
    "text_column": "dataset_text_field",
    "preprocessing_num_proc": "dataset_num_proc",
    "streaming": "dataset_streaming",
}

# A mixture's per-dataset keys (TRL's DatasetConfig), and the alignment handbook's names for some of them.
_MIXTURE_DATASET_KEYS = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction")
_HANDBOOK_NAMES = {"id": "path", "config": "name", "weight": "fraction"}


def _json_value(value, name: str):
    """A mapping or list given on the command line as JSON text, decoded; anything else as it is."""
    if isinstance(value, str) and value.strip().startswith(("{", "[")):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: {value!r} is not valid JSON ({exc}).") from None
    return value


def mixture_values(spec: dict | str) -> dict:
    """``dataset_mixture`` checked and in TRL's names: ``{"datasets": [...], "test_split_size": ...}``."""
    values = _json_value(spec, "dataset_mixture")
    if not isinstance(values, dict) or not isinstance(values.get("datasets"), list) or not values["datasets"]:
        raise ValueError(
            "dataset_mixture must be a mapping with a non-empty `datasets` list (TRL's DatasetMixtureConfig: "
            f"datasets: [{{path: ..., split: ...}}, ...]), got {spec!r}."
        )
    unknown = set(values) - {"datasets", "test_split_size", "streaming", "seed"}
    if unknown:
        raise ValueError(
            f"dataset_mixture: unknown keys {sorted(unknown)} (it takes datasets, test_split_size)."
        )
    if values.get("streaming"):
        raise ValueError("dataset_mixture cannot be streamed yet: remove its `streaming: true`.")
    datasets = []
    for i, entry in enumerate(values["datasets"]):
        if not isinstance(entry, dict):
            raise ValueError(f"dataset_mixture: datasets[{i}] must be a mapping, got {entry!r}.")
        entry = {_HANDBOOK_NAMES.get(k, k): v for k, v in entry.items()}
        unknown = set(entry) - set(_MIXTURE_DATASET_KEYS)
        if unknown or "path" not in entry:
            raise ValueError(
                f"dataset_mixture: datasets[{i}] needs a `path` and takes "
                f"{', '.join(_MIXTURE_DATASET_KEYS)}; got {sorted(entry)}."
            )
        fraction = entry.get("fraction")
        if fraction is not None and (isinstance(fraction, bool) or not 0 < float(fraction) <= 1):
            raise ValueError(f"dataset_mixture: datasets[{i}].fraction must be in (0, 1], got {fraction!r}.")
        datasets.append({"split": "train", **entry})
    given = [d.get("fraction") is not None for d in datasets]
    if any(given) and not all(given):
        raise ValueError("dataset_mixture: give a fraction for every dataset or for none (TRL's rule).")
    test_size = values.get("test_split_size")
    if test_size is not None and (isinstance(test_size, bool) or float(test_size) <= 0):
        raise ValueError(f"dataset_mixture: test_split_size must be positive, got {test_size!r}.")
    return {"datasets": datasets, "test_split_size": test_size}
