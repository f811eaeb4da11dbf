"""Datasets: loading (Hub, local files, the built-in corpus of :mod:`hf_noloco.data.corpus`), packing and
padding, and the training and evaluation sets of a run. How one row becomes tokens and labels is
:mod:`hf_noloco.data.encoding`'s job; streamed data is :mod:`hf_noloco.data.streaming`'s
(:func:`prepare_streams` builds it).

Every function here is deterministic: the same inputs give the same rows in the same order on every rank
and every machine, so each process of a multi-process job can call them (the caller may wrap them in
``main_process_first`` so that rank 0 fills the ``datasets`` cache and the others read it).
"""

from __future__ import annotations

import os

import datasets
import numpy as np
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict

from hf_noloco.data.corpus import builtin_corpus, train_bpe_tokenizer  # noqa: F401 - re-exported
from hf_noloco.data.encoding import DocumentEncoder, dataset_format, make_encoder, pad_row, set_pad_token
from hf_noloco.data.streaming import TokenStream
from hf_noloco.rules import BUILTIN_DATASET, is_local_dataset_path

# File types `load_text_dataset` reads, mapped to the `datasets` packaged builder that reads them.
_BUILDER_BY_EXTENSION = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}

# ----------------------------------------------------------------------------------------------------------
# Loading


def _check_text_column(dataset, text_column: str, what: str) -> None:
    """Checks that the dataset has a format :mod:`hf_noloco.encoding` reads (a text column, conversations,
    prompt/completion pairs or token ids); the error lists its columns."""
    # Streaming datasets may not know their columns until read; `None` means "cannot check yet".
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, dict):  # DatasetDict: {split: columns}
        for split, split_columns in columns.items():
            if split_columns is not None:
                dataset_format(split_columns, text_column, f"{what} (its {split!r} split)")
    elif columns is not None:
        dataset_format(columns, text_column, what)


def _local_data_files(path: str) -> tuple[str, list[str]]:
    """``(builder, files)`` for a local file or folder, or a clear error."""
    supported = ", ".join(sorted(_BUILDER_BY_EXTENSION))
    if os.path.isdir(path):
        files = sorted(
            os.path.join(dirpath, f)
            for dirpath, dirnames, filenames in os.walk(path)
            for f in filenames
            if not f.startswith(".")
        )
        usable = [f for f in files if os.path.splitext(f)[1].lower() in _BUILDER_BY_EXTENSION]
        if not usable:
            raise ValueError(
                f"The folder {path!r} holds no file of a supported type ({supported}); "
                f"found {len(files)} other file(s)" + (f", e.g. {files[:3]}." if files else ".")
            )
        builders = sorted({_BUILDER_BY_EXTENSION[os.path.splitext(f)[1].lower()] for f in usable})
        if len(builders) > 1:
            raise ValueError(
                f"The folder {path!r} mixes file types ({', '.join(builders)}); put one type of file in it."
            )
        return builders[0], usable
    extension = os.path.splitext(path)[1].lower()
    if extension not in _BUILDER_BY_EXTENSION:
        raise ValueError(
            f"Unsupported file type {extension or '(none)'!r} for {path!r}; supported: {supported}."
        )
    return _BUILDER_BY_EXTENSION[extension], [path]


def _clean_paragraphs(batch: dict[str, list], text_column: str) -> dict[str, list]:
    # The "text" builder splits on blank lines but keeps surrounding newlines and empty pieces of runs of
    # blank lines; drop those so that every row is one non-empty paragraph.
    texts = [t.strip() for t in batch[text_column]]
    return {text_column: [t for t in texts if t]}


def load_text_dataset(
    dataset_name: str,
    dataset_config: str | None = None,
    text_column: str = "text",
    split: str | None = "train",
    streaming: bool = False,
) -> Dataset | DatasetDict | datasets.IterableDataset | datasets.IterableDatasetDict:
    """Loads a text dataset by name: the built-in corpus, local files, or a Hugging Face Hub dataset.

    Args:
        dataset_name: ``BUILTIN_DATASET`` (``"builtin:python-docs"``); a local file or folder of ``.txt``,
            ``.json``, ``.jsonl`` or ``.parquet`` files (one type per folder, read recursively in sorted
            order); or a Hub dataset name for `datasets.load_dataset`.
            A ``.txt`` file gives one row per paragraph: text separated by blank lines, stripped, empty
            pieces dropped. JSON Lines / JSON / Parquet give one row per record.
        dataset_config: the Hub dataset's configuration (e.g. ``"wikitext-2-raw-v1"``).
        text_column: the column holding the text; checked to exist (the error lists the columns).
        split: the split to return, or ``None`` for a `DatasetDict` of all splits. Local files and the
            built-in corpus have one split, ``"train"``.
        streaming: stream a Hub dataset instead of downloading it (returns an iterable dataset).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: an unsupported file type, or a dataset without ``text_column``.
    """
    what = repr(dataset_name)
    if dataset_name == BUILTIN_DATASET:
        corpus = builtin_corpus()
        if streaming:
            dataset = datasets.IterableDatasetDict({"train": corpus.to_iterable_dataset()})
        else:
            dataset = DatasetDict({"train": corpus})
    elif is_local_dataset_path(dataset_name):
        path = os.path.expanduser(dataset_name)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"No such file or folder: {dataset_name!r} (resolved to {os.path.abspath(path)!r})."
            )
        builder, files = _local_data_files(path)
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        dataset = datasets.load_dataset(builder, data_files={"train": files}, streaming=streaming, **kwargs)
        if builder == "text":
            # The text builder names its only column "text"; rename so `text_column` works for .txt too.
            if text_column != "text":
                dataset = dataset.rename_column("text", text_column)
            progress = {} if streaming else {"desc": "Paragraphs"}  # iterable datasets take no desc
            dataset = dataset.map(
                _clean_paragraphs, batched=True, fn_kwargs={"text_column": text_column}, **progress
            )
    else:
        dataset = datasets.load_dataset(dataset_name, dataset_config, streaming=streaming)
    if split is not None:
        if split not in dataset:
            raise ValueError(f"The dataset {what} has no split {split!r}; its splits are {list(dataset)}.")
        dataset = dataset[split]
    _check_text_column(dataset, text_column, what)
    return dataset


# ----------------------------------------------------------------------------------------------------------
# Tokenization and packing


def _encode(batch: dict[str, list], encoder: DocumentEncoder) -> dict[str, list]:
    # Rows with nothing to train on (empty text, ...) are dropped here: a batched map may return fewer rows.
    out: dict[str, list] = {"input_ids": [], "labels": []}
    for values in zip(*batch.values()):
        encoded = encoder(dict(zip(batch, values)))
        if encoded is not None:
            out["input_ids"].append(encoded[0])
            out["labels"].append(encoded[1])
    return out


def _pack(
    batch: dict[str, list], indices: list[int], offsets: np.ndarray, block_size: int, source: Dataset
) -> dict[str, list]:
    """Cuts the global token stream into blocks; emits the blocks that START inside this batch of docs.

    ``offsets[i]`` is where document ``i`` starts in the concatenation of all documents, so the result
    is the same as packing the whole stream at once, whatever the batch size or ``num_proc``. The last
    block of a batch may need tokens of the following documents; they are read from ``source``.
    ``input_ids`` and ``labels`` are packed alike.
    """
    first, end_doc = indices[0], indices[-1] + 1
    start, end = int(offsets[first]), int(offsets[end_doc])
    total = int(offsets[-1])
    first_block = -(-start // block_size)  # ceil: a block starting before `start` is the previous batch's
    block_starts = range(first_block * block_size, min(end, total - block_size + 1), block_size)
    if len(block_starts) == 0:
        return {"input_ids": [], "labels": []}
    need = block_starts[-1] + block_size  # global position one past the last token we must have
    packed = {}
    for column in ("input_ids", "labels"):
        stream = [t for ids in batch[column] for t in ids]
        if need > end:
            # Read just the documents that cover [end, need).
            last_doc = int(np.searchsorted(offsets, need, side="left"))
            for ids in source[end_doc:last_doc][column]:
                stream.extend(ids)
        packed[column] = [stream[s - start : s - start + block_size] for s in block_starts]
    return packed


def encode_dataset(
    dataset: Dataset, encoder: DocumentEncoder, num_proc: int | None = None, batch_size: int = 1000
) -> Dataset:
    """``input_ids`` and ``labels`` of every row that has something to train on (see
    :class:`~hf_noloco.encoding.DocumentEncoder`), in order; the other columns are dropped."""
    return dataset.map(
        _encode,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        fn_kwargs={"encoder": encoder},
        desc=f"Tokenizing ({encoder.fmt})",
    )


def pack_dataset(
    dataset: Dataset,
    tokenizer,
    block_size: int,
    text_column: str = "text",
    num_proc: int | None = None,
    batch_size: int = 1000,
    encoder: DocumentEncoder | None = None,
) -> Dataset:
    """Tokenizes ``dataset`` and packs it into blocks of exactly ``block_size`` tokens.

    The documents are concatenated in order and the stream is cut into consecutive blocks; the ragged tail
    (fewer than ``block_size`` tokens) is dropped. Blocks may span documents, and attention then crosses
    them (standard for pretraining; the end-of-text token between documents tells the model where one
    ends). Text documents get the tokenizer's beginning-of-text token if it adds one and an end-of-text token
    after each (``encoder`` decides; by default :func:`~hf_noloco.encoding.make_encoder`'s); empty and
    whitespace-only rows are dropped; pre-tokenized rows (an ``input_ids`` column) are used as they are.
    Both steps are ``Dataset.map(batched=True)`` calls, so ``datasets`` caches them (for datasets backed by
    files) and runs them on ``num_proc`` processes; the result does not depend on ``num_proc`` or
    ``batch_size`` (documents per map batch; lower it to save memory on long documents).

    Returns:
        A `Dataset` with columns ``input_ids`` and ``labels`` (equal for text; the model shifts labels
        itself).

    Raises:
        ValueError: a missing text column, a tokenizer without eos, or too few tokens for one block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}.")
    _check_text_column(dataset, text_column, "to pack")
    if encoder is None:
        encoder, _ = make_encoder(tokenizer, dataset.column_names, text_column, packing=True)
    tokenized = encode_dataset(dataset, encoder, num_proc, batch_size)
    if tokenized.num_rows > 0:
        lengths = pc.list_value_length(tokenized.data.column("input_ids")).to_numpy(zero_copy_only=False)
    else:
        lengths = np.zeros(0, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    total = int(offsets[-1])
    if total < block_size:
        raise ValueError(
            f"The dataset has {total} tokens in {dataset.num_rows} documents (eos included), fewer than "
            f"block_size={block_size}: no block can be made. Use more data or a smaller block_size."
        )
    return tokenized.map(
        _pack,
        batched=True,
        with_indices=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=tokenized.column_names,
        fn_kwargs={"offsets": offsets, "block_size": block_size, "source": tokenized},
        desc=f"Packing into blocks of {block_size}",
    )


def _pad(batch: dict[str, list], block_size: int, pad_token_id: int) -> dict[str, list]:
    rows = [
        pad_row(ids, labels, block_size, pad_token_id)
        for ids, labels in zip(batch["input_ids"], batch["labels"])
    ]
    return {key: [row[key] for row in rows] for key in ("input_ids", "labels", "attention_mask")}


def pad_dataset(
    dataset: Dataset,
    encoder: DocumentEncoder,
    block_size: int,
    pad_token_id: int,
    num_proc: int | None = None,
    batch_size: int = 1000,
) -> Dataset:
    """One row per document, truncated and right-padded to exactly ``block_size`` tokens (attention mask 0 and
    labels -100 on the padding), so attention never crosses two documents and every batch has one shape.
    Rows left with nothing to train on are dropped (:class:`~hf_noloco.encoding.DocumentEncoder`)."""
    encoded = encode_dataset(dataset, encoder, num_proc, batch_size)
    if encoded.num_rows == 0:
        raise ValueError(
            f"None of the dataset's {dataset.num_rows} rows has a token to train on within block_size="
            f"{block_size}."
        )
    return encoded.map(
        _pad,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        fn_kwargs={"block_size": block_size, "pad_token_id": pad_token_id},
        desc=f"Padding to {block_size} tokens",
    )


# ----------------------------------------------------------------------------------------------------------
# Train / eval


def load_splits(
    dataset_name: str,
    dataset_config: str | None = None,
    text_column: str = "text",
    validation_split_percentage: float = 5,
    seed: int = 42,
) -> tuple[Dataset, Dataset]:
    """The (train, eval) DOCUMENTS of a dataset, before tokenization.

    Uses the dataset's own ``"validation"`` split, else its ``"test"`` split; otherwise carves
    ``validation_split_percentage`` % of the documents (at least one) out of ``"train"``, chosen with a
    seeded shuffle, so the split is the same on every rank and every run. Useful to train a tokenizer
    on the train documents only, then `prepare_datasets`.
    """
    raw = load_text_dataset(dataset_name, dataset_config, text_column=text_column, split=None)
    if "train" not in raw:
        raise ValueError(f"The dataset {dataset_name!r} has no 'train' split; its splits are {list(raw)}.")
    for eval_split in ("validation", "test"):
        if eval_split in raw:
            return raw["train"], raw[eval_split]
    train = raw["train"]
    if not 0 < validation_split_percentage < 100:
        raise ValueError(
            f"The dataset {dataset_name!r} has no validation split, so one is carved out of 'train', but "
            f"validation_split_percentage={validation_split_percentage} is not in (0, 100)."
        )
    if train.num_rows < 2:
        raise ValueError(
            f"The dataset {dataset_name!r} has {train.num_rows} document(s): too few to carve out a "
            "validation split."
        )
    num_eval = min(train.num_rows - 1, max(1, round(train.num_rows * validation_split_percentage / 100)))
    # Split documents, not blocks, so that no block holds text from both sides.
    split = train.train_test_split(test_size=num_eval, shuffle=True, seed=seed)
    return split["train"], split["test"]


def prepare_datasets(
    dataset_name: str,
    tokenizer,
    block_size: int,
    dataset_config: str | None = None,
    text_column: str = "text",
    validation_split_percentage: float = 5,
    num_proc: int | None = None,
    max_train_samples: int | None = None,
    seed: int = 42,
    *,
    max_eval_samples: int | None = None,
    packing: bool | None = None,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    assistant_only_loss: bool = False,
    completion_only_loss: bool | None = None,
    pad_token: str | None = None,
) -> tuple[Dataset, Dataset]:
    """Loads ``dataset_name`` and returns ``(train, eval)`` datasets of ``block_size``-token rows.

    The eval documents come from `load_splits` (the dataset's validation/test split, or a deterministic
    carve-out of ``validation_split_percentage`` % of the documents before packing). Each side is then packed
    with `pack_dataset` (text and pre-tokenized rows, by default) or padded, one document per row, with
    `pad_dataset` (conversations and prompt/completion pairs, or ``packing=False``); the keyword options are
    those of :func:`~hf_noloco.encoding.make_encoder`. ``max_train_samples`` / ``max_eval_samples`` keep the
    first that many train / eval ROWS. The tokenizer gets a padding token if it has none
    (:func:`~hf_noloco.encoding.set_pad_token`).
    """
    train_docs, eval_docs = load_splits(
        dataset_name,
        dataset_config,
        text_column,
        validation_split_percentage=validation_split_percentage,
        seed=seed,
    )
    encoder, packing = make_encoder(
        tokenizer,
        train_docs.column_names,
        text_column,
        packing=packing,
        add_bos=add_bos,
        add_eos=add_eos,
        assistant_only_loss=assistant_only_loss,
        completion_only_loss=completion_only_loss,
        block_size=block_size,
    )
    _check_same_format(eval_docs.column_names, encoder, dataset_name)
    pad_token_id = set_pad_token(tokenizer, pad_token)

    def build(docs: Dataset) -> Dataset:
        if packing:
            return pack_dataset(docs, tokenizer, block_size, text_column, num_proc, encoder=encoder)
        return pad_dataset(docs, encoder, block_size, pad_token_id, num_proc)

    train = build(train_docs)
    try:
        eval_ = build(eval_docs)
    except ValueError as e:
        raise ValueError(
            f"The validation documents are too small for one block ({e}) Raise validation_split_percentage "
            "or lower block_size."
        ) from e
    if max_train_samples is not None:
        train = train.select(range(min(max_train_samples, train.num_rows)))
    if max_eval_samples is not None:
        eval_ = eval_.select(range(min(max_eval_samples, eval_.num_rows)))
    return train, eval_


def _check_same_format(columns, encoder: DocumentEncoder, dataset_name: str) -> None:
    if columns is not None and dataset_format(columns, encoder.text_column) != encoder.fmt:
        raise ValueError(
            f"The dataset {dataset_name!r}'s evaluation split has columns {list(columns)}, of another format "
            f"than its training split ({encoder.fmt})."
        )


def prepare_streams(
    dataset_name: str,
    tokenizer,
    block_size: int,
    dataset_config: str | None = None,
    text_column: str = "text",
    validation_split_percentage: float = 5,
    max_train_samples: int | None = None,
    *,
    max_eval_samples: int | None = None,
    packing: bool | None = None,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    assistant_only_loss: bool = False,
    completion_only_loss: bool | None = None,
    pad_token: str | None = None,
) -> tuple[TokenStream, TokenStream]:
    """``(train, eval)`` as :class:`~hf_noloco.streaming.TokenStream`: nothing is downloaded or tokenized
    ahead, each replica reads its own shard when training starts.

    Evaluation reads the dataset's ``validation`` (else ``test``) split; without one, it reads the rows of
    ``train`` that a hash of their content holds out (``validation_split_percentage`` % of them; the
    training stream skips those), so it needs ``max_eval_samples``: held-out rows are spread over the whole
    stream. ``max_train_samples`` ends an epoch after that many training blocks; ``max_eval_samples`` caps
    every evaluation. Options as in :func:`prepare_datasets`.
    """
    raw = load_text_dataset(dataset_name, dataset_config, text_column=text_column, split=None, streaming=True)
    if "train" not in raw:
        raise ValueError(f"The dataset {dataset_name!r} has no 'train' split; its splits are {list(raw)}.")
    train_source = raw["train"]
    eval_split = next((name for name in ("validation", "test") if name in raw), None)
    columns = train_source.column_names
    if columns is None:  # some streamed datasets learn their columns from the first row
        columns = list(next(iter(train_source)).keys())
    encoder, packing = make_encoder(
        tokenizer,
        columns,
        text_column,
        packing=packing,
        add_bos=add_bos,
        add_eos=add_eos,
        assistant_only_loss=assistant_only_loss,
        completion_only_loss=completion_only_loss,
        block_size=block_size,
    )
    pad_token_id = set_pad_token(tokenizer, pad_token)
    holdout = None
    if eval_split is None:
        if not 0 < validation_split_percentage < 100:
            raise ValueError(
                f"The dataset {dataset_name!r} has no validation split, so one is held out of 'train', but "
                f"validation_split_percentage={validation_split_percentage} is not in (0, 100)."
            )
        if max_eval_samples is None:
            raise ValueError(
                "Streaming a dataset without a validation split needs max_eval_samples: the held-out rows "
                "are spread over the whole stream, which evaluation would otherwise read to the end."
            )
        holdout = validation_split_percentage
    else:
        _check_same_format(raw[eval_split].column_names, encoder, dataset_name)
    common = dict(encoder=encoder, block_size=block_size, packing=packing, pad_token_id=pad_token_id)
    train = TokenStream(
        train_source,
        max_blocks=max_train_samples,
        repeat=True,
        holdout=None if holdout is None else (holdout, False),
        split="train",
        **common,
    )
    evaluation = TokenStream(
        train_source if holdout is not None else raw[eval_split],
        max_blocks=max_eval_samples,
        repeat=False,
        holdout=None if holdout is None else (holdout, True),
        split="train" if holdout is not None else eval_split,
        **common,
    )
    return train, evaluation


def datasets_from_args(data_args, tokenizer, seed: int = 42):
    """``(train, eval)`` as a :class:`~hf_noloco.config.DataArguments` says: packed or padded datasets, or
    streams with ``streaming=True``."""
    options = dict(
        max_eval_samples=data_args.max_eval_samples,
        packing=data_args.packing,
        add_bos=data_args.add_bos,
        add_eos=data_args.add_eos,
        assistant_only_loss=data_args.assistant_only_loss,
        completion_only_loss=data_args.completion_only_loss,
        pad_token=data_args.pad_token,
    )
    if data_args.streaming:
        return prepare_streams(
            data_args.dataset_name,
            tokenizer,
            data_args.block_size,
            data_args.dataset_config,
            data_args.text_column,
            data_args.validation_split_percentage,
            data_args.max_train_samples,
            **options,
        )
    return prepare_datasets(
        data_args.dataset_name,
        tokenizer,
        data_args.block_size,
        data_args.dataset_config,
        data_args.text_column,
        data_args.validation_split_percentage,
        data_args.preprocessing_num_proc,
        data_args.max_train_samples,
        seed=seed,
        **options,
    )
