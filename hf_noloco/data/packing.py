"""Documents to rows of ``max_length`` tokens: tokenized (:mod:`hf_noloco.data.encoding`), then wrapped into
one stream cut into rows, packed into best-fit-decreasing bins, or padded one per row.

Every function is a ``Dataset.map(batched=True)``, so ``datasets`` caches it (for datasets backed by files)
and runs it on ``num_proc`` processes, and its result does not depend on either. Rows cut by ``max_length``
are counted (:func:`truncation_report`): a run says how much of its data it did not train on.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow.compute as pc
from datasets import Dataset

from hf_noloco.data.encoding import IGNORE_INDEX, DocumentEncoder, packed_row, pad_row

logger = logging.getLogger(__name__)


def _encode(batch: dict[str, list], encoder: DocumentEncoder) -> dict[str, list]:
    # Rows with nothing to train on (empty text, ...) are dropped here: a batched map may return fewer rows.
    out: dict[str, list] = {"input_ids": [], "labels": [], "truncated": []}
    for values in zip(*batch.values()):
        encoded = encoder.encode(dict(zip(batch, values)))
        if encoded is not None:
            for key, value in zip(out, encoded):
                out[key].append(value)
    return out


def encode_dataset(
    dataset: Dataset, encoder: DocumentEncoder, num_proc: int | None = None, batch_size: int = 1000
) -> Dataset:
    """``input_ids``, ``labels`` and ``truncated`` (whether ``max_length`` cut it) of every row that has
    something to train on (see :class:`~hf_noloco.data.encoding.DocumentEncoder`), in order; the other
    columns are dropped."""
    return dataset.map(
        _encode,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        fn_kwargs={"encoder": encoder},
        desc=f"Tokenizing ({encoder.fmt})",
    )


def truncation_report(encoded: Dataset, max_length: int, what: str) -> dict[str, float]:
    """How many of the encoded rows ``max_length`` cut: ``{"rows", "truncated", "share"}``, logged as a
    warning when any was."""
    truncated = (
        int(np.sum(encoded.data.column("truncated").to_numpy(zero_copy_only=False))) if len(encoded) else 0
    )
    report = {"rows": len(encoded), "truncated": truncated, "share": truncated / max(len(encoded), 1)}
    if truncated:
        logger.warning(
            "%s: %d of %d rows (%.1f%%) are longer than max_length=%d tokens and were cut: their ends are "
            "not trained on. Raise max_length, or pack with packing_strategy: bfd_split.",
            what,
            truncated,
            len(encoded),
            100 * report["share"],
            max_length,
        )
    return report


# ------------------------------------------------------------------------------------------------ wrapped


def _wrap(
    batch: dict[str, list], indices: list[int], offsets: np.ndarray, max_length: int, source: Dataset
) -> dict[str, list]:
    """Cuts the global token stream into rows; emits the rows that START inside this batch of documents.

    ``offsets[i]`` is where document ``i`` starts in the concatenation of all documents, so the result is the
    same as cutting the whole stream at once, whatever the batch size or ``num_proc``. The last row of a
    batch may need tokens of the following documents; they are read from ``source``.
    """
    first, end_doc = indices[0], indices[-1] + 1
    start, end = int(offsets[first]), int(offsets[end_doc])
    total = int(offsets[-1])
    first_row = -(-start // max_length)  # ceil: a row starting before `start` is the previous batch's
    row_starts = range(first_row * max_length, min(end, total - max_length + 1), max_length)
    if len(row_starts) == 0:
        return {"input_ids": [], "labels": []}
    need = row_starts[-1] + max_length  # global position one past the last token we must have
    packed = {}
    for column in ("input_ids", "labels"):
        stream = [t for ids in batch[column] for t in ids]
        if need > end:  # read just the documents that cover [end, need)
            last_doc = int(np.searchsorted(offsets, need, side="left"))
            for ids in source[end_doc:last_doc][column]:
                stream.extend(ids)
        packed[column] = [stream[s - start : s - start + max_length] for s in row_starts]
    return packed


def pack_wrapped(
    encoded: Dataset, max_length: int, num_proc: int | None = None, batch_size: int = 1000
) -> Dataset:
    """Concatenates the encoded documents in order and cuts the stream into rows of exactly ``max_length``
    tokens; the ragged tail is dropped. Rows may span documents, and attention then crosses them (standard
    for pretraining; the end-of-text token between documents tells the model where one ends)."""
    encoded = encoded.remove_columns([c for c in encoded.column_names if c not in ("input_ids", "labels")])
    if encoded.num_rows > 0:
        lengths = pc.list_value_length(encoded.data.column("input_ids")).to_numpy(zero_copy_only=False)
    else:
        lengths = np.zeros(0, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    total = int(offsets[-1])
    if total < max_length:
        raise ValueError(
            f"The dataset has {total} tokens in {encoded.num_rows} documents (eos included), fewer than "
            f"max_length={max_length}: no row can be made. Use more data or a smaller max_length."
        )
    return encoded.map(
        _wrap,
        batched=True,
        with_indices=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=encoded.column_names,
        fn_kwargs={"offsets": offsets, "max_length": max_length, "source": encoded},
        desc=f"Cutting into rows of {max_length}",
    )


# ---------------------------------------------------------------------------------------------------- bfd


def _bins_to_rows(batch: dict[str, list], max_length: int, pad_token_id: int) -> dict[str, list]:
    rows = [
        packed_row(ids, labels, lengths, max_length, pad_token_id)
        for ids, labels, lengths in zip(batch["input_ids"], batch["labels"], batch["seq_lengths"])
    ]
    return {
        key: [row[key] for row in rows] for key in ("input_ids", "labels", "attention_mask", "position_ids")
    }


def pack_bins(
    encoded: Dataset,
    max_length: int,
    pad_token_id: int,
    split: bool = False,
    num_proc: int | None = None,
    batch_size: int = 1000,
    row_length: int | None = None,
) -> Dataset:
    """Best-fit-decreasing bins of whole documents (TRL's ``pack_dataset``, per map batch of
    ``batch_size`` documents), each bin a row of ``max_length`` tokens (:func:`~hf_noloco.data.encoding
    .packed_row`: position ids restart at each document, padding after the last). ``split``: a document
    longer than ``max_length`` is cut into pieces packed like documents (``bfd_split``), instead of having
    been cut at ``max_length`` when it was encoded (``bfd``). ``row_length``: pad each row to this many tokens
    (at least ``max_length``; default ``max_length``)."""
    from trl import pack_dataset  # TRL's BFD: the same bins as SFTTrainer's packing

    encoded = encoded.remove_columns([c for c in encoded.column_names if c not in ("input_ids", "labels")])
    bins = pack_dataset(
        encoded,
        max_length,
        strategy="bfd_split" if split else "bfd",
        map_kwargs={"batch_size": batch_size, "num_proc": num_proc, "desc": "Packing (best fit decreasing)"},
    )
    return bins.map(
        _bins_to_rows,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=bins.column_names,
        fn_kwargs={"max_length": row_length or max_length, "pad_token_id": pad_token_id},
        desc=f"Padding bins to {row_length or max_length} tokens",
    )


# ------------------------------------------------------------------------------------------------- padded


def _pad(batch: dict[str, list], max_length: int, pad_token_id: int) -> dict[str, list]:
    rows = [
        pad_row(ids, labels, max_length, pad_token_id)
        for ids, labels in zip(batch["input_ids"], batch["labels"])
    ]
    return {key: [row[key] for row in rows] for key in ("input_ids", "labels", "attention_mask")}


def pad_dataset(
    encoded: Dataset, max_length: int, pad_token_id: int, num_proc: int | None = None, batch_size: int = 1000
) -> Dataset:
    """One encoded document per row, right-padded to exactly ``max_length`` tokens (attention mask 0 and
    labels -100 on the padding), so attention never crosses two documents and every batch has one shape."""
    return encoded.map(
        _pad,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=encoded.column_names,
        fn_kwargs={"max_length": max_length, "pad_token_id": pad_token_id},
        desc=f"Padding to {max_length} tokens",
    )


def row_length(max_length: int, layout: str, pad_to_multiple_of: int | None) -> int:
    """The tokens per row: ``max_length``, or, with ``pad_to_multiple_of``, the next multiple of it for the
    layouts that pad (wrapped rows, which have no padding, need a ``max_length`` that is a multiple)."""
    if not pad_to_multiple_of or max_length % pad_to_multiple_of == 0:
        return max_length
    if layout == "wrapped":
        raise ValueError(
            f"pad_to_multiple_of={pad_to_multiple_of}: wrapped rows have no padding, so max_length "
            f"({max_length}) must be a multiple of it (e.g. "
            f"{-(-max_length // pad_to_multiple_of) * pad_to_multiple_of})."
        )
    return -(-max_length // pad_to_multiple_of) * pad_to_multiple_of


def rows_of(
    encoded: Dataset,
    layout: str,
    max_length: int,
    pad_token_id: int,
    num_proc: int | None = None,
    batch_size: int = 1000,
    pad_to_multiple_of: int | None = None,
) -> Dataset:
    """The rows of ``layout`` (see :func:`~hf_noloco.data.encoding.row_layout`) from encoded documents, each
    :func:`row_length` tokens long."""
    length = row_length(max_length, layout, pad_to_multiple_of)
    if encoded.num_rows == 0:
        raise ValueError(
            f"None of the dataset's rows has a token to train on within max_length={max_length}."
        )
    if layout == "wrapped":
        return pack_wrapped(encoded, max_length, num_proc, batch_size)
    if layout in ("bfd", "bfd_split"):
        split = layout == "bfd_split"
        return pack_bins(encoded, max_length, pad_token_id, split, num_proc, batch_size, row_length=length)
    return pad_dataset(encoded, length, pad_token_id, num_proc, batch_size)


def trained_tokens(rows: Dataset) -> int:
    """Loss-bearing tokens of ``rows``: the labels, past each row's first position (the loss shifts them),
    that are not -100."""
    labels = np.asarray(rows["labels"]) if len(rows) else np.zeros((0, 2), dtype=np.int64)
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
