"""Tests for hf_noloco.data: loading, the built-in corpus, the BPE tokenizer, packing, train/eval splits.

Everything is local: files are written to tmp_path and the `datasets` cache is redirected there.
"""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer

from hf_noloco.data import corpus as builtin_docs
from hf_noloco.data import datasets as data
from hf_noloco.data import sources
from hf_noloco.data.arguments import BUILTIN_DATASET
from hf_noloco.data.encoding import make_encoder
from hf_noloco.data.packing import encode_dataset, pack_wrapped
from tests.helpers.chat_fixtures import WORDS

datasets.disable_progress_bars()


def make_docs(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct English-ish documents of varied length (1..40 words), deterministic."""
    docs = []
    for i in range(n):
        length = 1 + (i * 7 + seed) % 40
        words = [WORDS[(i * 3 + j * 5 + seed) % len(WORDS)] for j in range(length)]
        docs.append(f"Doc {i}: " + " ".join(words) + ".")
    return docs


@pytest.fixture(autouse=True)
def _isolated_datasets_cache(tmp_path, monkeypatch):
    # Never write to (or read a stale entry from) the user's ~/.cache during tests.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


@pytest.fixture(scope="module")
def tokenizer():
    # Small and fast: a few hundred merges on the pydoc topics (~0.5 MB) is plenty for these tests.
    texts = builtin_docs._topic_documents()[:40] + make_docs(200)
    return builtin_docs.train_bpe_tokenizer(texts, vocab_size=512)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return builtin_docs.builtin_corpus(cache_dir=str(tmp_path_factory.mktemp("builtin_cache")))


def reference_blocks(texts, tokenizer, max_length):
    """Plain-Python packing: concatenate every document + eos, cut, drop the tail."""
    stream = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n = len(stream) // max_length
    return [stream[i * max_length : (i + 1) * max_length] for i in range(n)]


def wrap(dataset, tokenizer, max_length, dataset_text_field="text", num_proc=None, batch_size=1000):
    """The rows of ``packing_strategy: wrapped`` (the default for text): encoded, then cut from one stream."""
    encoder, layout = make_encoder(tokenizer, dataset.column_names, dataset_text_field, packing=True)
    assert layout == "wrapped"
    encoded = encode_dataset(dataset, encoder, num_proc, batch_size)
    return pack_wrapped(encoded, max_length, num_proc, batch_size)


# ---------------------------------------------------------------------------------------------- packing


@pytest.mark.parametrize(
    "max_length, num_proc, batch_size",
    [(16, None, 1000), (7, None, 3), (64, 2, 5), (1, None, 50)],
)
def test_pack_matches_reference_concatenation(tokenizer, max_length, num_proc, batch_size):
    texts = make_docs(120)
    packed = wrap(
        Dataset.from_dict({"text": texts}), tokenizer, max_length, num_proc=num_proc, batch_size=batch_size
    )
    expected = reference_blocks(texts, tokenizer, max_length)
    assert packed.column_names == ["input_ids", "labels"]
    assert packed.num_rows == len(expected) > 0
    assert packed["input_ids"][:] == expected  # exact, across map batches and worker shards
    assert packed["labels"][:] == packed["input_ids"][:]
    assert all(len(row) == max_length for row in packed["input_ids"])


def test_pack_eos_between_documents(tokenizer):
    texts = ["hello world", "second doc", "third"]
    stream = [t for row in wrap(Dataset.from_dict({"text": texts}), tokenizer, 1)["input_ids"] for t in row]
    assert stream.count(tokenizer.eos_token_id) == 3
    assert tokenizer.decode(stream) == "hello world</s>second doc</s>third</s>"


def test_pack_too_small_dataset_says_how_many_tokens(tokenizer):
    texts = ["tiny", "docs"]
    num_tokens = len(reference_blocks(texts, tokenizer, 1))
    with pytest.raises(ValueError, match=rf"{num_tokens} tokens in 2 documents.*max_length=4096"):
        wrap(Dataset.from_dict({"text": texts}), tokenizer, 4096)


def test_pack_missing_text_column_names_columns(tokenizer):
    ds = Dataset.from_dict({"content": ["a b c"], "id": [0]})
    with pytest.raises(ValueError, match=r"no text column 'text'.*\['content', 'id'\]"):
        wrap(ds, tokenizer, 8)


def test_pack_other_text_column(tokenizer):
    texts = make_docs(30)
    packed = wrap(Dataset.from_dict({"body": texts, "n": list(range(30))}), tokenizer, 8, "body")
    assert packed["input_ids"][:] == reference_blocks(texts, tokenizer, 8)


# ---------------------------------------------------------------------------------------------- local files


def test_local_txt_one_row_per_paragraph(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("First paragraph,\nstill first.\n\n\n\nSecond paragraph.\n\n  Third  \n")
    ds = sources.load_text_dataset(str(path))
    assert ds["text"][:] == ["First paragraph,\nstill first.", "Second paragraph.", "Third"]


def test_local_jsonl_and_json(tmp_path):
    docs = make_docs(10)
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"content": d, "id": i}) + "\n" for i, d in enumerate(docs))
    )
    ds = sources.load_text_dataset(str(tmp_path / "a.jsonl"), dataset_text_field="content")
    assert ds["content"][:] == docs
    (tmp_path / "b.json").write_text(json.dumps([{"text": d} for d in docs]))
    assert sources.load_text_dataset(str(tmp_path / "b.json"))["text"][:] == docs


def test_local_parquet_and_folder(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    docs = make_docs(20)
    # Two shards, read back in sorted file order.
    pq.write_table(pa.table({"text": docs[10:]}), folder / "part-1.parquet")
    pq.write_table(pa.table({"text": docs[:10]}), folder / "part-0.parquet")
    assert sources.load_text_dataset(str(folder / "part-0.parquet"))["text"][:] == docs[:10]
    assert sources.load_text_dataset(str(folder))["text"][:] == docs


def test_local_missing_text_column_names_columns(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"body": "x", "title": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"no text column 'text'.*\['body', 'title'\]"):
        sources.load_text_dataset(str(path))


def test_local_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="No such file"):
        sources.load_text_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="No such file"):
        sources.load_text_dataset("./does/not/exist")
    (tmp_path / "table.xyz").write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"reads no file like 'table.xyz'.*JSON Lines"):
        sources.load_text_dataset(str(tmp_path / "table.xyz"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.md").write_text("hi")  # `datasets` reads .md files as task folders, not rows of text
    with pytest.raises(ValueError, match=r"reads no file like 'readme.md' as rows of text"):
        sources.load_text_dataset(str(empty))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    (mixed / "b.csv").write_text("text\ny\n")
    with pytest.raises(ValueError, match=r"mixes file types \(csv, jsonl\)"):
        sources.load_text_dataset(str(mixed))


# ---------------------------------------------------------------------------------------------- splits


def test_validation_carve_out_disjoint_and_deterministic(tmp_path, tokenizer):
    docs = make_docs(200)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train, eval_ = sources.load_splits(str(path), validation_split_percentage=5, seed=0)
    assert (train.num_rows, eval_.num_rows) == (190, 10)
    assert set(train["text"]).isdisjoint(eval_["text"])
    assert sorted(train["text"][:] + eval_["text"][:]) == sorted(docs)
    train2, eval2 = sources.load_splits(str(path), validation_split_percentage=5, seed=0)
    assert train2["text"][:] == train["text"][:] and eval2["text"][:] == eval_["text"][:]

    # Packed BEFORE vs after: the eval blocks are exactly the packing of the eval documents alone.
    ptrain, peval = data.prepare_datasets(str(path), tokenizer, 16, validation_split_percentage=5, seed=0)
    assert peval["input_ids"][:] == reference_blocks(eval_["text"], tokenizer, 16)
    assert ptrain["input_ids"][:] == reference_blocks(train["text"], tokenizer, 16)
    limited, _ = data.prepare_datasets(str(path), tokenizer, 16, max_train_samples=5, seed=0)
    assert limited["input_ids"][:] == ptrain["input_ids"][:5]


def test_existing_validation_split_is_used(monkeypatch, tokenizer):
    splits = DatasetDict(
        {
            "train": Dataset.from_dict({"text": make_docs(50)}),
            "validation": Dataset.from_dict({"text": make_docs(20, 3)}),
        }
    )
    monkeypatch.setattr(sources, "load_text_dataset", lambda *args, **kwargs: splits)
    train, eval_ = data.prepare_datasets("some/hub-dataset", tokenizer, 8)
    assert train["input_ids"][:] == reference_blocks(make_docs(50), tokenizer, 8)
    assert eval_["input_ids"][:] == reference_blocks(make_docs(20, 3), tokenizer, 8)


def test_eval_too_small_error(tmp_path, tokenizer):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_docs(20)))
    with pytest.raises(ValueError, match="evaluation documents are too few.*validation_split_percentage"):
        data.prepare_datasets(str(path), tokenizer, 128, validation_split_percentage=5)


# ---------------------------------------------------------------------------------------------- built-in
# corpus


def test_builtin_corpus_is_sizable_and_deterministic(corpus):
    texts = corpus["text"][:]
    assert corpus.column_names == ["text"]
    assert sum(len(t.encode()) for t in texts) > 1_000_000
    assert len(texts) > 200 and all(t.strip() for t in texts)
    assert any(t.startswith("Help on module json") for t in texts)
    # A second, uncached build gives the very same documents in the same order.
    assert [row["text"] for row in builtin_docs._generate_builtin_corpus("again")] == texts


def test_builtin_name_loads_builtin_corpus(corpus, monkeypatch):
    monkeypatch.setattr(sources, "builtin_corpus", lambda: corpus)
    ds = sources.load_text_dataset(BUILTIN_DATASET)
    assert ds.num_rows == corpus.num_rows


# ---------------------------------------------------------------------------------------------- tokenizer


def test_bpe_tokenizer_round_trip_save_load_and_determinism(tmp_path, corpus):
    texts = corpus["text"][:60]
    tok = builtin_docs.train_bpe_tokenizer(texts, vocab_size=600, output_dir=str(tmp_path / "tok"))
    assert len(tok) == 600
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    samples = [
        "def f(x):\n    return x ** 2  # square\n",
        "  Leading spaces, tabs\tand  double  spaces . , ! ?",
        texts[0][:2000],
        "Unicode survives too: caf\u00e9 \u2603 \U0001f600",
    ]
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert loaded(text, add_special_tokens=False)["input_ids"] == ids
        assert loaded.decode(ids) == text
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (0, 1, 2)
    again = builtin_docs.train_bpe_tokenizer(iter(texts), vocab_size=600)
    assert again.get_vocab() == tok.get_vocab()
    assert again(samples[2])["input_ids"] == tok(samples[2])["input_ids"]
