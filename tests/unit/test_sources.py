"""Where rows come from (hf_noloco.data.sources): dataset mixtures against TRL's own loader, named splits,
`data_files`, the file formats `datasets` reads; the data options' former names; and the count of rows
that `max_length` cuts.

Everything is local: files are written to tmp_path and the `datasets` cache is redirected there.
"""

import bz2
import csv
import gzip
import json
import logging
import lzma

import datasets
import pyarrow as pa
import pytest
from datasets import Dataset, DatasetDict

from hf_noloco.data import datasets as data
from hf_noloco.data import sources
from hf_noloco.data.arguments import DataArguments
from hf_noloco.data.encoding import make_encoder
from hf_noloco.data.packing import encode_dataset, truncation_report
from tests.helpers.chat_fixtures import CHATML, chat_tokenizer, conversations, sentence

datasets.disable_progress_bars()


@pytest.fixture(autouse=True)
def _isolated_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


@pytest.fixture(scope="module")
def chatml():
    return chat_tokenizer(CHATML)


def texts(name: str, n: int) -> list[str]:
    return [f"{name} document {i}: {sentence(i, 3 + i % 5)}" for i in range(n)]


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ---------------------------------------------------------------------------------------------- mixtures


@pytest.fixture
def two_datasets(tmp_path):
    """Two local JSON Lines datasets of 50 and 40 rows; the first has a column the second lacks."""
    a, b = texts("alpha", 50), texts("beta", 40)
    path_a = write_jsonl(tmp_path / "a.jsonl", [{"text": t, "id": i} for i, t in enumerate(a)])
    path_b = write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in b])
    return (path_a, a), (path_b, b)


def test_a_mixture_with_fractions_keeps_the_rows_trl_keeps(two_datasets):
    from trl import DatasetMixtureConfig, get_dataset

    (path_a, a), (path_b, b) = two_datasets
    entries = [
        {"path": "json", "data_files": path_a, "columns": ["text"], "fraction": 0.7},
        {"path": "json", "data_files": path_b, "fraction": 0.3},
    ]
    reference = get_dataset(DatasetMixtureConfig(datasets=[dict(e) for e in entries]))["train"]["text"][:]
    # TRL's rule, written out: the largest N with w * N <= len for every dataset; the first rows of each.
    total = min(50 / 0.7, 40 / 0.3)
    assert reference == a[: round(0.7 * total)] + b[: round(0.3 * total)]
    assert (round(0.7 * total), round(0.3 * total)) == (50, 21)

    ours = DataArguments(dataset_mixture={"datasets": entries}).dataset_mixture
    assert sources.load_mixture(ours)["train"]["text"][:] == reference
    # The same datasets named by their local paths (read by hf_noloco's own loader) give the same rows.
    local = [{**e, "path": p} for e, p in zip(entries, (path_a, path_b))]
    for entry in local:
        del entry["data_files"]
    mixed = sources.load_mixture(DataArguments(dataset_mixture={"datasets": local}).dataset_mixture)
    assert mixed["train"]["text"][:] == reference and mixed["train"].column_names == ["text"]
    # Without fractions: every row of each, in order.
    whole = [{"path": path_a, "columns": ["text"]}, {"path": path_b}]
    assert sources.load_mixture(DataArguments(dataset_mixture={"datasets": whole}).dataset_mixture)["train"][
        "text"
    ][:] == (a + b)


@pytest.mark.parametrize("test_split_size, held_out", [(10, 10), (0.2, 15)])
def test_a_mixtures_test_split_size_holds_out_that_many_rows(two_datasets, test_split_size, held_out):
    from trl import DatasetMixtureConfig, get_dataset

    (path_a, a), (path_b, b) = two_datasets
    entries = [
        {"path": path_a, "columns": ["text"], "fraction": 0.7},
        {"path": path_b, "fraction": 0.3},
    ]
    mixture = {"datasets": entries, "test_split_size": test_split_size}
    kept = a[:50] + b[:21]
    train, evaluation = sources.load_splits(
        "unused", dataset_mixture=DataArguments(dataset_mixture=mixture).dataset_mixture, seed=3
    )
    assert evaluation.num_rows == held_out and train.num_rows == len(kept) - held_out
    assert sorted(train["text"][:] + evaluation["text"][:]) == sorted(kept)  # disjoint, nothing lost
    trl_entries = [{"path": "json", "data_files": e["path"], "fraction": e["fraction"]} for e in entries]
    trl_entries[0]["columns"] = ["text"]
    reference = get_dataset(DatasetMixtureConfig(datasets=trl_entries, test_split_size=test_split_size))
    assert (reference["train"].num_rows, reference["test"].num_rows) == (train.num_rows, held_out)
    # Seeded (TRL's own split is not): every rank of a job holds out the same rows.
    again_train, again = sources.load_splits(
        "unused", dataset_mixture=DataArguments(dataset_mixture=mixture).dataset_mixture, seed=3
    )
    assert again["text"][:] == evaluation["text"][:] and again_train["text"][:] == train["text"][:]

    # The alignment handbook's names for path, name and fraction give the very same mixture.
    handbook = {
        "datasets": [
            {"id": path_a, "config": None, "columns": ["text"], "weight": 0.7},
            {"id": path_b, "config": None, "weight": 0.3},
        ],
        "test_split_size": test_split_size,
    }
    normalised = DataArguments(dataset_mixture=handbook).dataset_mixture
    assert normalised == {
        "datasets": [{**e, "name": None, "split": "train"} for e in entries],
        "test_split_size": test_split_size,
    }
    h_train, h_eval = sources.load_splits("unused", dataset_mixture=normalised, seed=3)
    assert h_train["text"][:] == train["text"][:] and h_eval["text"][:] == evaluation["text"][:]
    # As a command line gives it: JSON text.
    assert DataArguments(dataset_mixture=json.dumps(handbook)).dataset_mixture == normalised


def test_mixture_mistakes_are_refused(two_datasets, tmp_path):
    (path_a, _), (path_b, _) = two_datasets
    with pytest.raises(ValueError, match="fraction for every dataset or for none"):
        DataArguments(dataset_mixture={"datasets": [{"path": path_a, "fraction": 0.5}, {"path": path_b}]})
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        DataArguments(dataset_mixture={"datasets": [{"path": path_a, "weight": 2}]})
    with pytest.raises(ValueError, match=r"needs a `path`.*got \['ids'\]"):
        DataArguments(dataset_mixture={"datasets": [{"ids": path_a}]})
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations(4)])
    mixture = DataArguments(dataset_mixture={"datasets": [{"path": path_b}, {"path": chat}]}).dataset_mixture
    with pytest.raises(ValueError, match="different formats"):
        sources.load_mixture(mixture)


# ---------------------------------------------------------------------------------------------- splits


def test_a_saved_dataset_dicts_own_split_names_are_trained_and_evaluated_on(tmp_path):
    train_rows, test_rows = texts("train", 12), texts("test", 5)
    DatasetDict(
        {
            "train_sft": Dataset.from_dict({"text": train_rows}),
            "test_sft": Dataset.from_dict({"text": test_rows}),
        }
    ).save_to_disk(str(tmp_path / "saved"))
    train, evaluation = sources.load_splits(
        str(tmp_path / "saved"), dataset_train_split="train_sft", dataset_test_split="test_sft"
    )
    assert train["text"][:] == train_rows and evaluation["text"][:] == test_rows
    with pytest.raises(
        ValueError, match=r"no split 'train' to train on; its splits are \['train_sft', 'test_sft'\]"
    ):
        sources.load_splits(str(tmp_path / "saved"))
    with pytest.raises(
        ValueError, match=r"no split 'test' to evaluate on; its splits are \['train_sft', 'test_sft'\]"
    ):
        sources.load_splits(
            str(tmp_path / "saved"), dataset_train_split="train_sft", dataset_test_split="test"
        )


def test_a_folders_split_names_are_those_datasets_gives_its_files(tmp_path):
    train_rows, test_rows = texts("train", 12), texts("test", 5)
    # The Hub's shard names (data/{split}-00000-of-00001.*) carry any split name, as `datasets` reads them.
    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    write_jsonl(hub / "train_sft-00000-of-00001.jsonl", [{"text": t} for t in train_rows])
    write_jsonl(hub / "test_sft-00000-of-00001.jsonl", [{"text": t} for t in test_rows])
    assert set(datasets.load_dataset(str(tmp_path / "hub"))) == {"train_sft", "test_sft"}  # the reference
    train, evaluation = sources.load_splits(
        str(tmp_path / "hub"), dataset_train_split="train_sft", dataset_test_split="test_sft"
    )
    assert train["text"][:] == train_rows and evaluation["text"][:] == test_rows

    # Plain train_sft.jsonl / test_sft.jsonl: `datasets` names them by their keywords, train and test ...
    flat = tmp_path / "flat"
    flat.mkdir()
    write_jsonl(flat / "train_sft.jsonl", [{"text": t} for t in train_rows])
    write_jsonl(flat / "test_sft.jsonl", [{"text": t} for t in test_rows])
    assert sorted(datasets.load_dataset(str(flat))) == ["test", "train"]
    train, evaluation = sources.load_splits(str(flat))
    assert train["text"][:] == train_rows and evaluation["text"][:] == test_rows
    with pytest.raises(
        ValueError, match=r"no split 'train_sft' to train on; its splits are \['train', 'test'\]"
    ):
        sources.load_splits(str(flat), dataset_train_split="train_sft", dataset_test_split="test_sft")
    # ... and data_files names them as a split: file mapping does.
    files = {"train_sft": "train_sft.jsonl", "test_sft": "test_sft.jsonl"}
    train, evaluation = sources.load_splits(
        str(flat), dataset_train_split="train_sft", dataset_test_split="test_sft", data_files=files
    )
    assert train["text"][:] == train_rows and evaluation["text"][:] == test_rows


def test_the_validation_split_is_preferred_to_test_and_test_to_a_carve_out(tmp_path):
    folder = tmp_path / "three"
    folder.mkdir()
    for split, n in (("train", 20), ("validation", 4), ("test", 3)):
        write_jsonl(folder / f"{split}.jsonl", [{"text": t} for t in texts(split, n)])
    assert sources.load_splits(str(folder))[1]["text"][:] == texts("validation", 4)
    assert sources.load_splits(str(folder), dataset_test_split="test")[1]["text"][:] == texts("test", 3)
    # Training on the test split evaluates on validation, never on what it trains on.
    train, evaluation = sources.load_splits(str(folder), dataset_train_split="test")
    assert train["text"][:] == texts("test", 3) and evaluation["text"][:] == texts("validation", 4)


# ---------------------------------------------------------------------------------------------- data_files


def test_data_files_as_a_mapping_a_glob_and_relative_to_the_folder(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    shards = [texts(f"shard{k}", 6) for k in range(3)]
    for k, rows in enumerate(shards):
        write_jsonl(folder / f"part-{k}.jsonl", [{"text": t} for t in rows])
    write_jsonl(folder / "sub" / "held.jsonl", [{"text": t} for t in texts("held", 4)])
    write_jsonl(folder / "other.jsonl", [{"text": t} for t in texts("other", 2)])

    # A glob, relative to the folder: those files only, in name order, as "train".
    globbed = sources.load_text_dataset(str(folder), data_files="part-*.jsonl")
    assert globbed["text"][:] == shards[0] + shards[1] + shards[2]
    # A list of files.
    listed = sources.load_text_dataset(str(folder), data_files=["part-2.jsonl", "other.jsonl"])
    assert sorted(listed["text"][:]) == sorted(shards[2] + texts("other", 2))
    # A mapping {split: files}, subfolders included.
    mapping = {"train": ["part-0.jsonl", "part-1.jsonl"], "validation": "sub/held.jsonl"}
    train, evaluation = sources.load_splits(str(folder), data_files=mapping)
    assert train["text"][:] == shards[0] + shards[1] and evaluation["text"][:] == texts("held", 4)
    # data_dir: the files of a subfolder.
    assert sources.load_text_dataset(str(folder), data_dir="sub")["text"][:] == texts("held", 4)
    # As DataArguments takes them from the command line: JSON text.
    args = DataArguments(dataset_name=str(folder), data_files=json.dumps(mapping))
    assert args.data_files == mapping
    with pytest.raises(ValueError, match=r"No file of .* matches data_files='nothing-\*.jsonl'"):
        sources.load_text_dataset(str(folder), data_files="nothing-*.jsonl")
    with pytest.raises(ValueError, match=r"No file of .* matches data_files=.*\['validation'\]"):
        sources.load_text_dataset(str(folder), data_files={"train": "part-*", "validation": "held-*"})
    with pytest.raises(ValueError, match=r"No file of .* matches .*Unable to find"):
        sources.load_text_dataset(str(folder), data_files={"train": "part-0.jsonl", "test": "missing.jsonl"})
    with pytest.raises(ValueError, match="select files in a folder"):
        sources.load_text_dataset(str(folder / "other.jsonl"), data_files="part-0.jsonl")


# ---------------------------------------------------------------------------------------------- formats


def test_csv_tsv_compressed_json_and_arrow_files_give_their_rows(tmp_path):
    rows = [{"text": t, "n": i} for i, t in enumerate(texts("row", 9))]
    rows[3]["text"] = 'has, a comma and "quotes"'  # csv quoting, and a comma that a tsv keeps as text
    expected = [r["text"] for r in rows]

    for name, delimiter in (("table.csv", ","), ("table.tsv", "\t")):
        with open(tmp_path / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["text", "n"], delimiter=delimiter)
            writer.writeheader()
            writer.writerows(rows)
        ds = sources.load_text_dataset(str(tmp_path / name))
        assert ds["text"][:] == expected and ds["n"][:] == list(range(9)), name

    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "rows.json.bz2").write_bytes(bz2.compress(lines))
    for name in ("rows.jsonl.gz", "rows.json.bz2"):
        ds = sources.load_text_dataset(str(tmp_path / name))
        assert ds["text"][:] == expected and ds["n"][:] == list(range(9)), name
    (tmp_path / "notes.txt.xz").write_bytes(lzma.compress(b"First paragraph.\n\n\nSecond\none.\n"))
    assert sources.load_text_dataset(str(tmp_path / "notes.txt.xz"))["text"][:] == [
        "First paragraph.",
        "Second\none.",
    ]

    # Arrow: the IPC stream format (as `datasets` writes its own) and the IPC file format.
    table = pa.table({"text": expected, "n": list(range(9))})
    with pa.ipc.new_stream(str(tmp_path / "stream.arrow"), table.schema) as writer:
        writer.write_table(table)
    with pa.ipc.new_file(str(tmp_path / "file.arrow"), table.schema) as writer:
        writer.write_table(table)
    for name in ("stream.arrow", "file.arrow"):
        ds = sources.load_text_dataset(str(tmp_path / name))
        assert ds["text"][:] == expected and ds["n"][:] == list(range(9)), name
    # A folder of .tsv shards is read with the tab separator too.
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(2):
        (shards / f"train-{k}.tsv").write_text("text\tn\n" + "".join(f"{t}\t{k}\n" for t in texts(str(k), 3)))
    assert sources.load_text_dataset(str(shards))["text"][:] == texts("0", 3) + texts("1", 3)


# ---------------------------------------------------------------------------------------------- former names


def test_the_former_option_names_warn_and_set_the_trl_names():
    with pytest.warns(FutureWarning, match="`block_size` is deprecated: use `max_length`"):
        args = DataArguments(block_size=64)
    assert args.max_length == 64 and args.block_size is None  # recorded once, under the new name
    with pytest.raises(ValueError, match="block_size is the former name of max_length"):
        DataArguments(block_size=64, max_length=128)
    with pytest.warns(FutureWarning):
        assert DataArguments(block_size=128, max_length=128).max_length == 128  # the two agree
    with pytest.warns(FutureWarning) as caught:
        args = DataArguments(text_column="body", preprocessing_num_proc=2)
    assert (args.dataset_text_field, args.dataset_num_proc) == ("body", 2) and len(caught) == 2
    with pytest.warns(FutureWarning, match="`streaming` is deprecated"):
        assert DataArguments(streaming=True, max_eval_samples=4).dataset_streaming is True
    with pytest.raises(ValueError, match="max_length must be at least 2, got 1"), pytest.warns(FutureWarning):
        DataArguments(block_size=1)  # the former name is checked as the new one


# ---------------------------------------------------------------------------------------------- truncation


def test_truncation_counts_exactly_the_rows_max_length_cuts(chatml, caplog):
    max_length = 20
    # prompt/completion pairs (completion-only loss); some longer than max_length, one whose prompt alone is.
    pairs = [(sentence(i, 2 + 3 * (i % 6)), " " + sentence(i + 1, 2 + 2 * (i % 5))) for i in range(30)]
    pairs.append((sentence(99, 60), " the end."))
    expected_rows = expected_cut = 0
    for prompt, completion in pairs:
        prompt_ids = chatml(prompt, add_special_tokens=False)["input_ids"]
        ids = prompt_ids + chatml(completion, add_special_tokens=False)["input_ids"] + [chatml.eos_token_id]
        if len(prompt_ids) >= max_length:  # nothing of the completion left to train on: dropped
            continue
        expected_rows += 1
        expected_cut += len(ids) > max_length
    assert 0 < expected_cut < expected_rows < len(pairs)
    rows = Dataset.from_dict({"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]})
    encoder, layout = make_encoder(chatml, rows.column_names, max_length=max_length)
    assert layout == "padded" and encoder.completion_only_loss
    encoded = encode_dataset(rows, encoder)
    with caplog.at_level(logging.WARNING, logger="hf_noloco.data.packing"):
        report = truncation_report(encoded, max_length, "Training rows")
    assert report == {"rows": expected_rows, "truncated": expected_cut, "share": expected_cut / expected_rows}
    [record] = [r for r in caplog.records if r.name == "hf_noloco.data.packing"]
    assert record.levelno == logging.WARNING
    assert f"Training rows: {expected_cut} of {expected_rows} rows" in record.getMessage()
    assert f"max_length={max_length}" in record.getMessage()
    assert all(len(ids) <= max_length for ids in encoded["input_ids"])

    # Conversations: cut when the rendered conversation is longer than max_length.
    convs = conversations(40)
    lengths = [
        len(chatml.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"]) for m in convs
    ]
    max_length = sorted(lengths)[len(lengths) // 2]
    encoder, layout = make_encoder(chatml, ["messages"], max_length=max_length)
    encoded = encode_dataset(Dataset.from_dict({"messages": convs}), encoder)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_noloco.data.packing"):
        report = truncation_report(encoded, max_length, "Evaluation rows")
    cut = sum(n > max_length for n in lengths)
    assert 0 < cut < len(convs) and report == {
        "rows": len(convs),
        "truncated": cut,
        "share": cut / len(convs),
    }
    assert f"Evaluation rows: {cut} of {len(convs)} rows" in caplog.text

    # Nothing cut: nothing said. bfd_split cuts nothing at encoding (long rows are split into pieces).
    caplog.clear()
    encoder, layout = make_encoder(chatml, ["messages"], max_length=max_length, packing_strategy="bfd_split")
    assert layout == "bfd_split" and encoder.max_length is None
    encoded = encode_dataset(Dataset.from_dict({"messages": convs}), encoder)
    with caplog.at_level(logging.WARNING, logger="hf_noloco.data.packing"):
        assert truncation_report(encoded, max_length, "Training rows")["truncated"] == 0
    assert not caplog.records


def test_a_run_reports_the_rows_it_cuts_on_each_side(tmp_path, chatml, caplog, monkeypatch):
    """prepare_datasets counts the cut rows of the training and the evaluation split, each on its own (on
    rank 0: the one process of this test)."""
    monkeypatch.delenv("RANK", raising=False)
    max_length = 24
    folder = tmp_path / "pairs"
    folder.mkdir()
    cut = {}
    for split, n, seed in (("train", 30, 0), ("validation", 12, 7)):
        pairs = [
            (sentence(i + seed, 3 + i % 4), " " + sentence(i + seed + 1, 2 + 3 * (i % 6))) for i in range(n)
        ]
        write_jsonl(folder / f"{split}.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
        lengths = [
            sum(len(chatml(t, add_special_tokens=False)["input_ids"]) for t in pair) + 1  # + eos
            for pair in pairs
        ]
        cut[split] = sum(length > max_length for length in lengths)
    assert all(k > 0 for k in cut.values())
    with caplog.at_level(logging.WARNING, logger="hf_noloco.data.packing"):
        train, evaluation = data.prepare_datasets(str(folder), chatml, max_length)
    assert (train.num_rows, evaluation.num_rows) == (30, 12)
    assert f"Training rows: {cut['train']} of 30 rows" in caplog.text
    assert f"Evaluation rows: {cut['validation']} of 12 rows" in caplog.text
