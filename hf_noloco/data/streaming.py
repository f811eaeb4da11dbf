"""Streamed training data: each replica reads its own shard of a streamed dataset, tokenizes and packs (or
pads) it on the fly, and can say exactly where it is, so a resumed run continues at the very next block.

Nothing is downloaded or tokenized ahead: a replica holds one document and at most one block of tokens at a
time, whatever the corpus size (``benchmarks/streaming_memory.py`` measures it), and no rank waits for
another's preprocessing. The replicas split the source with ``datasets.distributed.split_dataset_by_node``:
whole shards (files) each when their count divides by the number of replicas, otherwise every replica reads
all rows and keeps one in ``num_replicas``. All stages of a replica read the same shard in the same order;
the stages between the first and the last use no tensor of the batch (activations and labels reach them
from the previous stage), so they get placeholder rows of the same shape instead of tokenizing.

Position: ``(epoch, the source's state before the current document, tokens of that document already used,
blocks yielded this epoch)``. A packed block never ends before the tokens left over from earlier documents
(they number fewer than a block), so whatever is left after a block belongs to the current document: reading
that document again and skipping the used tokens restores the packer exactly.

The order is the source's: streams are not shuffled (a shuffle buffer cannot be restored exactly on resume).
C4 and FineWeb's shards are shuffled already; shuffle your own files once before training.
"""

from __future__ import annotations

import atexit
import copy
import weakref
import zlib

import torch
from datasets.distributed import split_dataset_by_node

from hf_noloco.data.encoding import DocumentEncoder, pad_row, row_fingerprint

# The source iterators still open. `datasets`' file readers must be closed before the interpreter tears down
# their modules (a training stream is never read to its end), or each prints an ignored exception at exit.
_OPEN_SOURCES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_sources() -> None:
    for iterator in list(_OPEN_SOURCES):
        iterator.close()


def is_held_out(fingerprint: bytes, percentage: float) -> bool:
    """Whether a row goes to the evaluation side of a streamed split: a hash of its content, so every rank,
    every mesh and every run agrees, and repeated documents fall on the same side."""
    return zlib.crc32(fingerprint) % 10_000 < percentage * 100


class TokenStream(torch.utils.data.IterableDataset):
    """Blocks of ``block_size`` tokens made on the fly from a streamed ``datasets.IterableDataset``.

    Rows are dicts of lists (``input_ids``, ``labels``; padded rows also ``attention_mask``), ready for
    ``default_data_collator``. Build it unsharded; the trainer calls :meth:`shard` for its replica.

    Args:
        source: the streamed dataset (every replica's rows).
        encoder: turns a row into ``(input_ids, labels)`` (:func:`hf_noloco.encoding.make_encoder`).
        block_size: tokens per row.
        packing: concatenate documents and cut blocks (spanning documents), or pad each document to a row.
        pad_token_id: the padding token of padded rows.
        max_blocks: stop an epoch after this many blocks over all replicas (each shard takes its share).
        repeat: a training stream starts the next epoch when its shard is exhausted and continues from its
            position when iterated again; an evaluation stream (``repeat=False``) starts from the beginning at
            every iteration and ends.
        holdout: ``(percentage, side)``: keep only the rows :func:`is_held_out` puts on ``side`` (``True``:
            the held-out evaluation rows), for datasets without a validation split.
        split: the name of the source's split (shown in the model card).
    """

    def __init__(
        self,
        source,
        encoder: DocumentEncoder,
        block_size: int,
        packing: bool,
        pad_token_id: int | None = None,
        max_blocks: int | None = None,
        repeat: bool = True,
        holdout: tuple[float, bool] | None = None,
        split: str | None = None,
    ):
        super().__init__()
        if not packing and pad_token_id is None:
            raise ValueError("Padded rows (packing=False) need a pad_token_id.")
        self.source = source
        self.encoder = encoder
        self.block_size = block_size
        self.packing = packing
        self.pad_token_id = pad_token_id
        self.max_blocks = max_blocks
        self.repeat = repeat
        self.holdout = holdout
        self.split = split
        self.shard_index, self.num_shards, self.reads = 0, 1, True
        self._position = self._start(0)

    # ------------------------------------------------------------------------------------------- sharding

    def shard(self, index: int, num_shards: int, read: bool = True) -> TokenStream:
        """This stream restricted to shard ``index`` of ``num_shards`` (a replica's share), at its start.
        With ``read=False`` it yields placeholder rows of the same shape (zeros) and never touches the
        source."""
        if not 0 <= index < num_shards:
            raise ValueError(f"shard index must be in [0, {num_shards}), got {index}.")
        shard = copy.copy(self)
        shard.shard_index, shard.num_shards, shard.reads = index, num_shards, read
        if self.max_blocks is not None:
            share, extra = divmod(self.max_blocks, num_shards)
            shard.max_blocks = share + (1 if index < extra else 0)
        shard._position = shard._start(0)
        return shard

    # ----------------------------------------------------------------------------------------- position

    @staticmethod
    def _start(epoch: int) -> dict:
        return {"epoch": epoch, "source_state": None, "doc_offset": 0, "blocks": 0}

    def state_dict(self) -> dict:
        """Where the stream is: the next iteration yields the block after the last one yielded."""
        return copy.deepcopy(self._position)

    def load_state_dict(self, state: dict) -> None:
        self._position = copy.deepcopy(dict(state))

    # ---------------------------------------------------------------------------------------- iteration

    def __iter__(self):
        if not self.reads:
            yield from self._placeholders()
            return
        if not self.repeat:
            self._position = self._start(0)
            yield from self._epoch()
            return
        while True:
            fresh = self._position == self._start(self._position["epoch"])
            produced = False
            for row in self._epoch():
                produced = True
                yield row
            if fresh and not produced:
                raise ValueError(
                    f"Shard {self.shard_index} of {self.num_shards} of the streamed dataset holds no "
                    f"complete block of {self.block_size} tokens: use more data, fewer replicas or a smaller "
                    "block_size."
                )
            self._position = self._start(self._position["epoch"] + 1)

    def _placeholders(self):
        blocks = 0
        while self.repeat or self.max_blocks is None or blocks < self.max_blocks:
            blocks += 1
            # the keys of a real row: a padded stream's rows carry a mask, which the stages then pass on
            row = {"input_ids": [0] * self.block_size}
            if not self.packing:
                row["attention_mask"] = [1] * self.block_size
            yield row

    def _rows(self, position: dict):
        """``(source state before the row, source state after it, row)`` of this shard from ``position`` on,
        held-out rows filtered out."""
        source = split_dataset_by_node(self.source, rank=self.shard_index, world_size=self.num_shards)
        source.set_epoch(position["epoch"])
        if position["source_state"] is not None:
            source.load_state_dict(position["source_state"])
        before = position["source_state"]
        rows = iter(source)
        if hasattr(rows, "close"):
            _OPEN_SOURCES.add(rows)
        for row in rows:
            state, before = before, source.state_dict()
            if self.holdout is not None:
                percentage, side = self.holdout
                fingerprint = row_fingerprint(row, self.encoder.fmt, self.encoder.text_column)
                if is_held_out(fingerprint, percentage) != side:
                    continue
            yield state, before, row

    def _epoch(self):
        position = self._position
        epoch, blocks, skip = position["epoch"], position["blocks"], position["doc_offset"]
        limit = self.max_blocks
        if limit is not None and blocks >= limit:
            return
        ids_buffer: list[int] = []
        labels_buffer: list[int] = []
        for state, after, row in self._rows(position):
            encoded = self.encoder(row)
            if encoded is None:
                continue
            ids, labels = encoded
            if not self.packing:
                blocks += 1
                self._position = {"epoch": epoch, "source_state": after, "doc_offset": 0, "blocks": blocks}
                yield pad_row(ids, labels, self.block_size, self.pad_token_id)
            else:
                length = len(ids)
                ids_buffer += ids[skip:]
                labels_buffer += labels[skip:]
                skip = 0
                while len(ids_buffer) >= self.block_size:
                    block_ids, ids_buffer = ids_buffer[: self.block_size], ids_buffer[self.block_size :]
                    block_labels = labels_buffer[: self.block_size]
                    labels_buffer = labels_buffer[self.block_size :]
                    blocks += 1
                    # What is left belongs to this document: resume by reading it again, minus what is used.
                    self._position = {
                        "epoch": epoch,
                        "source_state": state,
                        "doc_offset": length - len(ids_buffer),
                        "blocks": blocks,
                    }
                    yield {"input_ids": block_ids, "labels": block_labels}
                    if limit is not None and blocks >= limit:
                        return
            if limit is not None and blocks >= limit:
                return
