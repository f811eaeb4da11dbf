"""Streamed training data: each replica reads its own share of a streamed dataset, tokenizes and packs (or
pads) it on the fly, and can say exactly where it is, so a resumed run continues at the very next row.

Nothing is downloaded or tokenized ahead: a replica holds one document and at most one row of tokens at a
time (plus the shuffle buffer, when shuffling), whatever the corpus size (``benchmarks/streaming_memory.py``
measures it), and no rank waits for another's preprocessing.

Sharing: with at least as many shards (files) as replicas, each replica reads whole shards of its own
(``IterableDataset.shard``, shards ``r, r + N, ...``), so every row is read once across the replicas; when
the count does not divide, the shares differ by one shard and the smaller ones start their next epoch
sooner. With fewer shards than replicas every replica reads all rows and keeps one in ``N``
(``split_dataset_by_node``). All stages of a replica read the same share in the same order; the stages
between the first and the last use no tensor of the batch (activations and labels reach them from the
previous stage), so they get placeholder rows of the same shape instead of tokenizing.

Shuffling (``shuffle_seed``): the order of a replica's shards is drawn from the seed and the epoch, and
rows pass through a buffer of ``shuffle_buffer_size`` from which a seeded generator draws the next.
``datasets``' own shuffle buffer is lost on resume; this one is part of the position, so a resumed run reads
exactly the rows a straight run would. Without a seed every epoch reads the source's order.

Position: ``(epoch, the source's state, the shuffle buffer and generator, all before the current document;
tokens of that document already used; rows yielded this epoch)``. A packed row never ends before the tokens
left over from earlier documents (they number fewer than a row), so whatever is left after a row belongs to
the current document: drawing that document again and skipping the used tokens restores the packer exactly.
"""

from __future__ import annotations

import atexit
import copy
import random
import weakref
import zlib

import torch
from datasets import concatenate_datasets
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
    """Rows of ``max_length`` tokens made on the fly from a streamed ``datasets.IterableDataset``.

    Rows are dicts of lists (``input_ids``, ``labels``; padded rows also ``attention_mask``), ready for
    ``default_data_collator``. Build it unsharded; the trainer calls :meth:`shard` for its replica.

    Args:
        source: the streamed dataset (every replica's rows).
        encoder: turns a row into ``(input_ids, labels)`` (:func:`~hf_noloco.data.encoding.make_encoder`).
        max_length: tokens per row.
        packing: concatenate documents and cut rows (spanning documents), or pad each document to a row.
        pad_token_id: the padding token of padded rows.
        max_rows: stop an epoch after this many rows over all replicas (each shard takes its share).
        repeat: a training stream starts the next epoch when its shard is exhausted and continues from its
            position when iterated again; an evaluation stream (``repeat=False``) starts from the beginning at
            every iteration and ends.
        holdout: ``(percentage, side)``: keep only the rows :func:`is_held_out` puts on ``side`` (``True``:
            the held-out evaluation rows), for datasets without a validation split.
        split: the name of the source's split (shown in the model card).
        shuffle_seed: read in a seeded order (see the module's docstring); ``None`` reads the source's order.
        shuffle_buffer_size: documents held to draw from when shuffling.
    """

    def __init__(
        self,
        source,
        encoder: DocumentEncoder,
        max_length: int,
        packing: bool,
        pad_token_id: int | None = None,
        max_rows: int | None = None,
        repeat: bool = True,
        holdout: tuple[float, bool] | None = None,
        split: str | None = None,
        shuffle_seed: int | None = None,
        shuffle_buffer_size: int = 1000,
    ):
        super().__init__()
        if not packing and pad_token_id is None:
            raise ValueError("Padded rows (packing=False) need a pad_token_id.")
        if shuffle_buffer_size < 1:
            raise ValueError(f"shuffle_buffer_size must be at least 1, got {shuffle_buffer_size}.")
        self.source = source
        self.encoder = encoder
        self.max_length = max_length
        self.packing = packing
        self.pad_token_id = pad_token_id
        self.max_rows = max_rows
        self.repeat = repeat
        self.holdout = holdout
        self.split = split
        self.shuffle_seed = shuffle_seed
        self.shuffle_buffer_size = shuffle_buffer_size
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
        if self.max_rows is not None:
            share, extra = divmod(self.max_rows, num_shards)
            shard.max_rows = share + (1 if index < extra else 0)
        shard._position = shard._start(0)
        return shard

    def shard_source(self, epoch: int = 0):
        """The part of the source this shard reads, in its order at ``epoch`` (see the module's docstring)."""
        # Always a new dataset (``shard`` builds its iterables anew): a dataset keeps the state it was loaded
        # with and its iteration's progress, which would reach every other reader of ``self.source`` (later
        # epochs, the other streams of the split) if it were read itself.
        by_files = self.num_shards > 1 and getattr(self.source, "num_shards", 1) >= self.num_shards
        if by_files:
            source = self.source.shard(num_shards=self.num_shards, index=self.shard_index, contiguous=False)
        else:
            source = self.source.shard(num_shards=1, index=0)
        if self.shuffle_seed is not None and getattr(source, "num_shards", 1) > 1:
            # The shard order is drawn here rather than by `datasets`' shuffle: its buffer (even of one row,
            # before datasets 5) is not restored on resume, and since 5 it interleaves shards in threads and
            # sleeps at every iterator's end. Drawn before the row split, so all replicas agree on it.
            order = list(range(source.num_shards))
            random.Random(f"shards:{self.shuffle_seed}:{epoch}").shuffle(order)
            source = concatenate_datasets([source.shard(num_shards=len(order), index=i) for i in order])
        if self.num_shards > 1 and not by_files:
            source = split_dataset_by_node(source, rank=self.shard_index, world_size=self.num_shards)
        return source

    # ----------------------------------------------------------------------------------------- position

    @staticmethod
    def _start(epoch: int) -> dict:
        return {"epoch": epoch, "source_state": None, "doc_offset": 0, "rows": 0, "buffer": None, "rng": None}

    def state_dict(self) -> dict:
        """Where the stream is: the next iteration yields the row after the last one yielded."""
        return copy.deepcopy(self._position)

    def load_state_dict(self, state: dict) -> None:
        state = copy.deepcopy(dict(state))
        if "blocks" in state:  # a position saved before the count was named rows
            state["rows"] = state.pop("blocks")
        position = self._start(0)
        position.update(state)
        self._position = position

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
                    f"complete row of {self.max_length} tokens: use more data, fewer replicas or a smaller "
                    "max_length."
                )
            self._position = self._start(self._position["epoch"] + 1)

    def _placeholders(self):
        rows = 0
        while self.repeat or self.max_rows is None or rows < self.max_rows:
            rows += 1
            # the keys of a real row: a padded stream's rows carry a mask, which the stages then pass on
            row = {"input_ids": [0] * self.max_length}
            if not self.packing:
                row["attention_mask"] = [1] * self.max_length
            yield row

    def _source_rows(self, position: dict):
        """``(state before the row, row)`` of this shard's source from ``position`` on, held-out rows
        filtered out. A state is ``(source state, shuffle buffer, generator state)``."""
        # No set_epoch: `datasets` would reorder the shards of every epoch after the first, even unshuffled.
        source = self.shard_source(position["epoch"])
        if position["source_state"] is not None:
            if position["source_state"].get("epoch"):  # saved by a version that let `datasets` reorder epochs
                source.set_epoch(position["source_state"]["epoch"])  # the rest of that epoch in its order
            source.load_state_dict(position["source_state"])
        rows = iter(source)
        if hasattr(rows, "close"):
            _OPEN_SOURCES.add(rows)
        before = position["source_state"]
        for row in rows:
            if self.holdout is not None:
                percentage, side = self.holdout
                fingerprint = row_fingerprint(row, self.encoder.fmt, self.encoder.dataset_text_field)
                if is_held_out(fingerprint, percentage) != side:
                    before = source.state_dict()
                    continue
            yield before, row
            before = source.state_dict()
        yield before, None  # the source is exhausted: its state at the end

    def _rows(self, position: dict):
        """``(position fields before the row, row)`` of this shard in reading order (drawn from the shuffle
        buffer when shuffling)."""
        if self.shuffle_seed is None:
            for state, row in self._source_rows(position):
                if row is not None:
                    yield {"source_state": state, "buffer": None, "rng": None}, row
            return
        buffer = list(position["buffer"] or [])
        rng = random.Random(self.shuffle_seed * 1_000_003 + position["epoch"])
        if position["rng"] is not None:
            rng.setstate(_as_rng_state(position["rng"]))
        for state, row in self._source_rows(position):
            if row is None:  # drain the buffer
                while buffer:
                    before = {"source_state": state, "buffer": list(buffer), "rng": rng.getstate()}
                    yield before, buffer.pop(rng.randrange(len(buffer)))
                return
            if len(buffer) < self.shuffle_buffer_size:
                buffer.append(row)
                continue
            before = {"source_state": state, "buffer": list(buffer), "rng": rng.getstate()}
            slot = rng.randrange(len(buffer))
            drawn, buffer[slot] = buffer[slot], row
            yield before, drawn

    def _epoch(self):
        position = self._position
        epoch, rows, skip = position["epoch"], position["rows"], position["doc_offset"]
        limit = self.max_rows
        if limit is not None and rows >= limit:
            return
        ids_buffer: list[int] = []
        labels_buffer: list[int] = []
        for before, row in self._rows(position):
            encoded = self.encoder(row)
            if encoded is None:
                continue
            ids, labels = encoded
            if not self.packing:
                if skip:  # the document of the recorded position was yielded before it was saved
                    skip = 0
                    continue
                rows += 1
                # resume after this document: the state before it, marked as used (doc_offset 1)
                self._position = {"epoch": epoch, **before, "doc_offset": 1, "rows": rows}
                yield pad_row(ids, labels, self.max_length, self.pad_token_id)
            else:
                length = len(ids)
                ids_buffer += ids[skip:]
                labels_buffer += labels[skip:]
                skip = 0
                while len(ids_buffer) >= self.max_length:
                    row_ids, ids_buffer = ids_buffer[: self.max_length], ids_buffer[self.max_length :]
                    row_labels = labels_buffer[: self.max_length]
                    labels_buffer = labels_buffer[self.max_length :]
                    rows += 1
                    # What is left belongs to this document: resume by reading it again, minus what is used.
                    self._position = {
                        "epoch": epoch,
                        **before,
                        "doc_offset": length - len(ids_buffer),
                        "rows": rows,
                    }
                    yield {"input_ids": row_ids, "labels": row_labels}
                    if limit is not None and rows >= limit:
                        return
            if limit is not None and rows >= limit:
                return


def _as_rng_state(state) -> tuple:
    """``random.Random.setstate``'s tuple from a state that may have been through a list-making format."""
    version, internal, gauss = state
    return int(version), tuple(int(x) for x in internal), gauss
