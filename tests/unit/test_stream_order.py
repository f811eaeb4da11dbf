"""The order of a streamed training set, in one process: which replica reads which files, a seeded shuffle
that reads every row once per epoch, and a shuffled position that survives a checkpoint (``torch.save`` /
``torch.load(weights_only=True)``) so that a resumed stream yields exactly what a straight one would.

The documents are pre-tokenized rows whose first token names them (``1000 + i``), so every row of a stream
says which document it came from; no tokenizer is needed."""

import io
import itertools
import json
import os
import types

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from datasets.distributed import split_dataset_by_node

from hf_noloco.data.datasets import prepare_streams
from hf_noloco.data.encoding import make_encoder
from hf_noloco.data.sources import load_text_dataset
from hf_noloco.data.streaming import TokenStream

datasets.disable_progress_bars()

LENGTH = 8
PAD = 0
# What make_encoder and set_pad_token ask of a tokenizer for pre-tokenized rows.
TOKENIZER = types.SimpleNamespace(bos_token_id=None, eos_token_id=None, pad_token_id=PAD)


@pytest.fixture(autouse=True)
def _isolated_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


def document(i: int) -> list[int]:
    """Document ``i``: its name, then 1 to 13 tokens (some span two packed rows, some fit one padded row)."""
    return [1000 + i] + [(i * 5 + j) % 50 + 1 for j in range(1 + i * 7 % 13)]


def write_files(folder, files: int, per_file: int, fmt: str = "parquet") -> list[list[int]]:
    """``files`` files of ``per_file`` documents each; returns the documents' names, file by file."""
    os.makedirs(folder, exist_ok=True)
    names = []
    for f in range(files):
        ids = [document(f * per_file + j) for j in range(per_file)]
        path = os.path.join(folder, f"part-{f:02d}.{fmt}")
        if fmt == "parquet":
            pq.write_table(pa.table({"input_ids": ids}), path)
        else:
            with open(path, "w") as out:
                out.writelines(json.dumps({"input_ids": row}) + "\n" for row in ids)
        names.append([row[0] for row in ids])
    return names


def stream_of(folder, packed: bool, **kwargs) -> TokenStream:
    encoder, layout = make_encoder(TOKENIZER, ["input_ids"], packing=packed, add_bos=False, max_length=LENGTH)
    assert layout == ("wrapped" if packed else "padded")
    source = load_text_dataset(str(folder), streaming=True)
    return TokenStream(source, encoder, LENGTH, layout == "wrapped", PAD, **kwargs)


def names_of(rows) -> list[int]:
    """The document of each padded row (its first token)."""
    return [row["input_ids"][0] for row in rows]


def take(stream, n: int) -> list[dict]:
    return list(itertools.islice(iter(stream), n))


def through_checkpoint(position: dict) -> dict:
    """A position as a resumed run gets it back: saved and loaded the way checkpoints store it."""
    buffer = io.BytesIO()
    torch.save(position, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ------------------------------------------------------------------------------------------------ sharing


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_three_files_over_two_replicas_are_read_once_each_replica_its_own_files(tmp_path, fmt):
    files = write_files(tmp_path / "data", 3, 10, fmt)
    for shuffled in (False, True):
        kwargs = dict(repeat=False, shuffle_seed=3 if shuffled else None, shuffle_buffer_size=4)
        shares = [stream_of(tmp_path / "data", packed=False, **kwargs).shard(r, 2) for r in range(2)]
        assert [share.shard_source().num_shards for share in shares] == [2, 1]
        read = [names_of(share) for share in shares]
        assert sorted(read[0]) == sorted(files[0] + files[2])  # whole files: r, r + N, ...
        assert sorted(read[1]) == sorted(files[1])
        if not shuffled:
            assert read == [files[0] + files[2], files[1]]  # in the source's order
        assert sorted(read[0] + read[1]) == sorted(sum(files, []))  # every row once, none twice
    # Nothing of replica 0 touches replica 1's file: with it unreadable, replica 0 reads its share as before.
    with open(tmp_path / "data" / f"part-01.{fmt}", "wb") as broken:
        broken.write(b"\x00 not a data file \x00")
    alone = stream_of(tmp_path / "data", packed=False, repeat=False).shard(0, 2)
    assert names_of(alone) == files[0] + files[2]
    with pytest.raises(Exception):  # noqa: B017 - the reader's own error, whichever it is
        names_of(stream_of(tmp_path / "data", packed=False, repeat=False).shard(1, 2))


@pytest.mark.parametrize("seed", [None, 3])
def test_fewer_files_than_replicas_every_replica_keeps_one_row_in_n(tmp_path, seed):
    files = write_files(tmp_path / "data", 2, 15)
    stream = stream_of(tmp_path / "data", False, repeat=False, shuffle_seed=seed, shuffle_buffer_size=4)
    read = [names_of(stream.shard(r, 3)) for r in range(3)]
    assert [len(r) for r in read] == [10, 10, 10]
    assert sorted(sum(read, [])) == sorted(sum(files, []))


# ---------------------------------------------------------------------------------------------- shuffling


def epochs_of(stream: TokenStream, epochs: int, per_epoch: int) -> list[list[int]]:
    rows = names_of(take(stream, epochs * per_epoch))
    return [rows[e * per_epoch : (e + 1) * per_epoch] for e in range(epochs)]


def test_a_seeded_stream_reads_every_row_of_each_epoch_in_its_own_order(tmp_path):
    files = write_files(tmp_path / "data", 4, 12)
    source_order = sum(files, [])
    n = len(source_order)
    # Unshuffled: every epoch in the source's order (the files one after the other).
    assert epochs_of(stream_of(tmp_path / "data", packed=False), 3, n) == [source_order] * 3

    def shuffled(seed):
        stream = stream_of(tmp_path / "data", packed=False, shuffle_seed=seed, shuffle_buffer_size=4)
        return epochs_of(stream, 3, n)

    epochs = shuffled(7)
    for epoch in epochs:
        assert sorted(epoch) == sorted(source_order)  # each row once per epoch
        assert epoch != source_order
    assert len({tuple(epoch) for epoch in epochs}) == 3  # every epoch its own order
    assert shuffled(7) == epochs  # the same seed, the same order
    assert shuffled(8) != epochs
    # Its shares too: a shuffled replica reads the rows of its own files in an order of its own.
    share = stream_of(tmp_path / "data", packed=False, shuffle_seed=7, shuffle_buffer_size=4).shard(1, 2)
    [first] = epochs_of(share, 1, 2 * 12)
    assert sorted(first) == sorted(files[1] + files[3]) and first != files[1] + files[3]


def resume_cases(one_epoch: int, total: int) -> list[int]:
    buffer_fill = [1, 2, 3]  # the first documents drawn, the buffer still holding the first ones read
    mid = [one_epoch // 2, one_epoch // 2 + 1]
    boundary = [one_epoch - 2, one_epoch - 1, one_epoch, one_epoch + 1]  # the buffer drains, the next fills
    later = [one_epoch + one_epoch // 2, 2 * one_epoch, total - 1]
    return sorted(set(buffer_fill + mid + boundary + later))


def straight_run(make, total: int) -> tuple[list[dict], list[dict]]:
    """``total`` rows of a fresh stream, with the position before each."""
    stream = make()
    rows, positions = [], []
    iterator = iter(stream)
    for _ in range(total):
        positions.append(stream.state_dict())
        rows.append(next(iterator))
    return rows, positions


@pytest.mark.parametrize("share", [(0, 1), (1, 2)], ids=["one-replica", "replica-1-of-2"])
@pytest.mark.parametrize("packed", [True, False], ids=["wrapped", "padded"])
def test_a_shuffled_stream_resumed_from_a_checkpoint_reads_on_as_a_straight_one(tmp_path, packed, share):
    write_files(tmp_path / "data", 4, 12)

    def make():  # everything built anew, as a resumed process builds it
        stream = stream_of(tmp_path / "data", packed=packed, shuffle_seed=11, shuffle_buffer_size=4)
        return stream.shard(*share)

    one_epoch = len(list(TokenStream(**{**vars_of(make()), "repeat": False}).shard(*share)))
    total = 2 * one_epoch + 5  # crosses two epoch boundaries
    rows, positions = straight_run(make, total)
    assert rows[one_epoch : 2 * one_epoch] != rows[:one_epoch]  # the next epoch, another order
    for k in resume_cases(one_epoch, total):
        resumed = make()
        resumed.load_state_dict(through_checkpoint(positions[k]))
        assert take(resumed, total - k) == rows[k:], k


def test_prepare_streams_shuffles_the_training_stream_and_resumes_it_exactly(tmp_path):
    """The stream a run trains on: held-out rows skipped before the shuffle buffer, no evaluation set asked
    for (``evaluation=False``), and its positions resume exactly."""
    write_files(tmp_path / "data", 3, 30)

    def make():
        train, evaluation = prepare_streams(
            str(tmp_path / "data"),
            TOKENIZER,
            LENGTH,
            validation_split_percentage=20,
            shuffle_dataset=True,
            shuffle_buffer_size=4,
            seed=5,
            evaluation=False,
        )
        assert evaluation is None and train.shuffle_seed == 5 and train.holdout == (20, False)
        return train.shard(0, 1)

    one_epoch = len(list(TokenStream(**{**vars_of(make()), "repeat": False}).shard(0, 1)))
    total = one_epoch + 7
    rows, positions = straight_run(make, total)
    for k in (1, 3, one_epoch // 2, one_epoch - 1, one_epoch, one_epoch + 2):
        resumed = make()
        resumed.load_state_dict(through_checkpoint(positions[k]))
        assert take(resumed, total - k) == rows[k:], k
    # A run that evaluates still needs max_eval_samples: the held-out rows are spread over the whole stream.
    with pytest.raises(ValueError, match="needs max_eval_samples"):
        prepare_streams(str(tmp_path / "data"), TOKENIZER, LENGTH, shuffle_dataset=True)


def vars_of(stream: TokenStream) -> dict:
    """The arguments ``stream`` was made with (its shuffle and its held-out side included)."""
    names = ("source", "encoder", "max_length", "packing", "pad_token_id", "max_rows", "repeat", "holdout")
    return {
        **{name: getattr(stream, name) for name in names},
        "shuffle_seed": stream.shuffle_seed,
        "shuffle_buffer_size": stream.shuffle_buffer_size,
    }


@pytest.mark.parametrize("seed", [None, 5], ids=["unshuffled", "shuffled"])
def test_streams_of_one_split_keep_their_positions_apart(tmp_path, seed):
    """One replica, the evaluation rows held out of the training split: both streams read the same dataset.
    A resumed training stream evaluated mid-way still evaluates on the held-out rows from their start, and
    its own position after the evaluation still resumes exactly."""
    write_files(tmp_path / "data", 2, 40)

    def make():
        train, evaluation = prepare_streams(
            str(tmp_path / "data"),
            TOKENIZER,
            LENGTH,
            validation_split_percentage=20,
            max_eval_samples=5,
            shuffle_dataset=seed is not None,
            shuffle_buffer_size=4,
            seed=seed or 0,
        )
        return train.shard(0, 1), evaluation.shard(0, 1)

    reference_eval = take(make()[1], 100)
    assert len(reference_eval) == 5
    rows, positions = straight_run(lambda: make()[0], 40)
    train, evaluation = make()  # a resumed run
    train.load_state_dict(through_checkpoint(positions[7]))
    iterator = iter(train)
    before = [next(iterator) for _ in range(3)]
    assert take(evaluation, 100) == reference_eval  # from the start of the held-out rows
    after = [next(iterator) for _ in range(3)]
    assert before + after == rows[7:13]
    resumed, _ = make()
    resumed.load_state_dict(through_checkpoint(train.state_dict()))
    assert take(resumed, 27) == rows[13:]


def test_a_position_saved_before_shuffling_existed_resumes_where_it_was(tmp_path):
    """Positions of the previous version: the count named ``blocks``, the replica's rows read through
    ``split_dataset_by_node``, whose ``set_epoch`` reordered the files of later epochs. The rest of that epoch
    is read in its order, the epochs after in the source's."""
    files = write_files(tmp_path / "data", 4, 6)
    source = load_text_dataset(str(tmp_path / "data"), streaming=True)
    old = split_dataset_by_node(source, rank=0, world_size=1)
    old.set_epoch(2)
    old_order = [row["input_ids"][0] for row in old]
    assert sorted(old_order) == sorted(sum(files, [])) and old_order != sum(files, [])
    rows = iter(old)
    for _ in range(5):
        next(rows)
    position = {"epoch": 2, "source_state": old.state_dict(), "doc_offset": 0, "blocks": 5}  # padded: after
    stream = stream_of(tmp_path / "data", packed=False).shard(0, 1)
    stream.load_state_dict(through_checkpoint(position))
    assert names_of(take(stream, 19 + 24)) == old_order[5:] + sum(files, [])
    assert stream.state_dict()["epoch"] == 3
