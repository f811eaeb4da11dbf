"""Streamed data: per-replica shares of local parquet files, packed or padded on the fly, positions that
resume at exactly the next row, and whole streamed runs (pp2 x dp2 resume, pp3 with a middle stage that
reads nothing)."""

import itertools
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hf_noloco.data import datasets as data
from hf_noloco.data.corpus import train_bpe_tokenizer
from hf_noloco.data.encoding import make_encoder
from hf_noloco.data.sources import load_text_dataset
from hf_noloco.data.streaming import TokenStream, is_held_out
from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.chat_fixtures import chat_tokenizer, write_chat_jsonl
from tests.helpers.paths import ROOT
from tests.helpers.runs import make_args

datasets.disable_progress_bars()

BLOCK = 16


@pytest.fixture(autouse=True)
def _isolated_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


def documents(n: int, offset: int = 0) -> list[str]:
    """Documents of 1 to ~60 words; every seventh is empty or blank (dropped), some span several rows."""
    docs = []
    for i in range(offset, offset + n):
        if i % 7 == 3:
            docs.append("" if i % 2 else "   \n ")
            continue
        words = [f"w{(i * 13 + j * 7) % 97}" for j in range(1 + (i * 11) % 60)]
        docs.append(f"doc {i}: " + " ".join(words))
    return docs


def write_shards(folder, shards: int, per_shard: int) -> list[list[str]]:
    os.makedirs(folder, exist_ok=True)
    files = []
    for s in range(shards):
        docs = documents(per_shard, s * per_shard)
        pq.write_table(pa.table({"text": docs}), os.path.join(folder, f"part-{s:02d}.parquet"))
        files.append(docs)
    return files


def reference_rows(texts, tokenizer, max_length):
    """Plain-Python packing: every non-blank document + eos, concatenated, cut, tail dropped."""
    stream = []
    for text in texts:
        if text.strip():
            stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return [stream[i * max_length : (i + 1) * max_length] for i in range(len(stream) // max_length)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(documents(300), vocab_size=320)


def stream_of(path, tokenizer, **kwargs) -> TokenStream:
    source = load_text_dataset(str(path), streaming=True)
    encoder, layout = make_encoder(tokenizer, ["text"])
    return TokenStream(source, encoder, BLOCK, layout == "wrapped", tokenizer.pad_token_id, **kwargs)


def take(stream, n):
    return [row["input_ids"] for row in itertools.islice(iter(stream), n)]


def test_each_shard_packs_its_own_files_exactly(tmp_path, tokenizer):
    files = write_shards(tmp_path / "pq", 3, 40)
    stream = stream_of(tmp_path / "pq", tokenizer, repeat=False)
    assert take(stream.shard(0, 1), 10**6) == reference_rows(sum(files, []), tokenizer, BLOCK)
    for index, docs in enumerate(files):  # 3 files over 3 replicas: one file each
        assert take(stream.shard(index, 3), 10**6) == reference_rows(docs, tokenizer, BLOCK)
    # 3 files over 2 replicas: files 0 and 2, and file 1; together they read every row once.
    halves = [stream_of(tmp_path / "pq", tokenizer, repeat=False).shard(i, 2) for i in range(2)]
    rows = [list(h._rows(h._position)) for h in halves]
    texts = [[row["text"] for _, row in r] for r in rows]
    assert sorted(texts[0] + texts[1]) == sorted(sum(files, []))
    assert {t for t in texts[0] if t.strip()}.isdisjoint(texts[1])  # blank documents repeat in every file


@pytest.mark.parametrize("padded", [False, True])
def test_resuming_at_any_row_continues_with_the_very_next_one(tmp_path, tokenizer, padded):
    if padded:
        chat = chat_tokenizer()
        write_chat_jsonl(tmp_path / "chat.jsonl", 25)
        encoder, layout = make_encoder(chat, ["messages"], assistant_only_loss=True, max_length=48)
        assert layout == "padded"
        source = load_text_dataset(str(tmp_path / "chat.jsonl"), streaming=True)
        stream = TokenStream(source, encoder, 48, False, chat.pad_token_id)
    else:
        write_shards(tmp_path / "pq", 2, 30)
        stream = stream_of(tmp_path / "pq", tokenizer)
    one_epoch = len(take(TokenStream(**{**vars_of(stream), "repeat": False}), 10**6))
    total = 2 * one_epoch + 5  # crosses two epoch boundaries
    straight = stream.shard(0, 1)
    rows, positions = [], []
    iterator = iter(straight)
    for _ in range(total):
        positions.append(straight.state_dict())
        rows.append(next(iterator))
    assert rows[one_epoch] == rows[0]  # the next epoch starts over
    for k in sorted({1, 2, 3, one_epoch - 1, one_epoch, one_epoch + 1, *range(5, total, 7)}):
        resumed = stream.shard(0, 1)
        resumed.load_state_dict(positions[k])
        assert list(itertools.islice(iter(resumed), total - k)) == rows[k:], k


def vars_of(stream: TokenStream) -> dict:
    return dict(
        source=stream.source,
        encoder=stream.encoder,
        max_length=stream.max_length,
        packing=stream.packing,
        pad_token_id=stream.pad_token_id,
    )


def test_held_out_rows_and_caps(tmp_path, tokenizer):
    files = write_shards(tmp_path / "pq", 2, 200)
    train, evaluation = data.prepare_streams(
        str(tmp_path / "pq"), tokenizer, BLOCK, validation_split_percentage=10, max_eval_samples=6
    )
    kept = [d for d in sum(files, []) if d.strip()]
    held = [d for d in kept if is_held_out(d.encode(), 10)]
    assert 0.05 < len(held) / len(kept) < 0.15
    assert take(evaluation.shard(0, 1), 100) == reference_rows(held, tokenizer, BLOCK)[:6]
    rest = [d for d in kept if d not in held]
    assert take(train.shard(0, 1), 50) == reference_rows(rest, tokenizer, BLOCK)[:50]
    # Caps are shared out between replicas: 6 evaluation rows over 4 replicas is 2 + 2 + 1 + 1.
    assert [len(take(evaluation.shard(i, 4), 100)) for i in range(4)] == [2, 2, 1, 1]
    capped, _ = data.prepare_streams(
        str(tmp_path / "pq"),
        tokenizer,
        BLOCK,
        validation_split_percentage=10,
        max_train_samples=10,
        max_eval_samples=6,
    )
    assert take(capped.shard(0, 1), 20) == take(train.shard(0, 1), 10) * 2  # an epoch is 10 rows
    with pytest.raises(ValueError, match="needs max_eval_samples"):
        data.prepare_streams(str(tmp_path / "pq"), tokenizer, BLOCK)


def test_a_stage_that_reads_nothing_gets_rows_of_the_same_shape(tokenizer):
    class Unreadable:
        def __iter__(self):
            raise AssertionError("a placeholder stream must not read its source")

    encoder, _ = make_encoder(tokenizer, ["text"])
    stream = TokenStream(Unreadable(), encoder, BLOCK, True).shard(1, 2, read=False)
    assert take(stream, 3) == [[0] * BLOCK] * 3


def test_too_little_data_for_a_shard_is_a_clear_error(tmp_path, tokenizer):
    write_shards(tmp_path / "pq", 1, 1)
    with pytest.raises(ValueError, match="holds no complete row of 512 tokens"):
        next(iter(TokenStream(**{**vars_of(stream_of(tmp_path / "pq", tokenizer)), "max_length": 512})))


# ---------------------------------------------------------------------------------------------- whole runs


def _streamed_run(folder, steps):
    from transformers import AutoTokenizer, LlamaConfig

    from hf_noloco.trainer import NoLoCoTrainer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    train, evaluation = data.prepare_streams(
        os.path.join(folder, "pq"), tokenizer, 32, validation_split_percentage=10, max_eval_samples=12
    )
    runs = []
    half = os.path.join(folder, "run", f"checkpoint-{steps // 2}")
    for resume in (None, half):
        args = make_args(
            os.path.join(folder, "run"),
            max_steps=steps,
            save_strategy="steps",
            save_steps=steps // 2,
            eval_strategy="no",
            logging_steps=1,
            inner_steps=3,
            per_device_train_batch_size=4,
        )
        trainer = NoLoCoTrainer(config, args, train_dataset=train, eval_dataset=evaluation)
        trainer.train(resume_from_checkpoint=resume)
        metrics = trainer.evaluate()
        logs = [
            {k: h[k] for k in ("step", "loss", "epoch")} for h in trainer.state.log_history if "loss" in h
        ]
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        runs.append((logs, weights, metrics["eval_tokens"], trainer.parts.loaders.train_stream.state_dict()))
    trainer.end()
    return runs


def test_streamed_run_resumes_exactly(tmp_path):
    """pp2 x dp2 NoLoCo over four local parquet shards: 8 straight steps equal 4 steps, a resume from the
    checkpoint, then 4 steps (losses, weights and stream positions), evaluation reads exactly
    max_eval_samples rows, and nothing is written to the datasets cache."""
    write_shards(tmp_path / "pq", 4, 150)
    train_bpe_tokenizer(documents(300), vocab_size=320, output_dir=str(tmp_path / "tokenizer"))
    results = run_distributed(_streamed_run, 4, str(tmp_path), 8, timeout_s=180)
    for (logs, weights, eval_tokens, position), (
        resumed_logs,
        resumed_weights,
        resumed_eval,
        resumed_position,
    ) in results:
        assert [h["step"] for h in resumed_logs] == list(range(1, 9))
        assert resumed_logs == logs
        for name in weights:
            assert torch.equal(weights[name], resumed_weights[name]), name
        assert eval_tokens == resumed_eval == 12 * 31
        assert resumed_position == position
    first_stage = results[0][0]
    assert first_stage[0][-1]["loss"] < first_stage[0][0]["loss"]  # it trains
    assert first_stage[3]["rows"] == 8 * 4  # 8 steps of 4 rows read by replica 0
    cache = str(tmp_path / "hf_datasets_cache")
    arrow = [f for _, _, files in os.walk(cache) for f in files if f.endswith(".arrow")]
    assert arrow == []  # nothing materialised


def _three_stages(folder):
    from transformers import AutoTokenizer, LlamaConfig

    from hf_noloco.engine.loading import build_stage
    from hf_noloco.trainer import NoLoCoTrainer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    train, evaluation = data.prepare_streams(
        os.path.join(folder, "pq"), tokenizer, 32, validation_split_percentage=10, max_eval_samples=4
    )
    args = make_args(
        os.path.join(folder, "run"),
        pipeline_stages=3,
        outer_optimizer="local",
        max_steps=2,
        eval_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=4,
    )
    trainer = NoLoCoTrainer(config, args, train_dataset=train, eval_dataset=evaluation)
    trainer.train()
    loss = trainer.state.log_history[0]["loss"]
    reads = trainer.parts.loaders.train_stream.reads
    trainer.end()
    # The reference: the unsplit model, same initialisation, on the first 4 rows of the stream.
    model = build_stage(config, 0, 1, seed=args.seed)
    batch = torch.tensor(take(train.shard(0, 1), 4))
    with torch.no_grad():
        logits = model(batch)
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()).item()
    return loss, reference, reads


def test_middle_stages_train_without_reading_the_stream(tmp_path):
    write_shards(tmp_path / "pq", 2, 80)
    train_bpe_tokenizer(documents(300), vocab_size=320, output_dir=str(tmp_path / "tokenizer"))
    results = run_distributed(_three_stages, 3, str(tmp_path), timeout_s=180)
    assert [reads for _, _, reads in results] == [True, False, True]
    for loss, reference, _ in results:
        assert loss == pytest.approx(reference, rel=1e-5)


def test_streamed_pretraining_from_the_command_line(tmp_path):
    """As a user runs it: the tiny recipe streamed from local parquet shards, 2 replicas, a resume."""
    import subprocess
    import sys

    root = ROOT
    write_shards(tmp_path / "pq", 4, 150)
    train_bpe_tokenizer(documents(300), vocab_size=320, output_dir=str(tmp_path / "tokenizer"))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_DATASETS_CACHE=str(tmp_path / "c"))

    def launch(max_steps: int, *extra: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            *("--config_file", os.path.join(root, "recipes", "accelerate_configs", "cpu.yaml")),
            *("--num_processes", "2", os.path.join(root, "recipes", "train.py")),
            os.path.join(root, "recipes", "llama-tiny", "noloco.yaml"),
            *("--dataset_name", str(tmp_path / "pq"), "--dataset_streaming", "true"),
            *("--max_eval_samples", "8", "--tokenizer_name_or_path", str(tmp_path / "tokenizer")),
            *("--max_length", "32"),
            *("--pipeline_stages", "1", "--inner_steps", "2", "--max_steps", str(max_steps)),
            *("--save_steps", "2", "--eval_steps", "2", "--logging_steps", "1", "--report_to", "none"),
            *("--output_dir", str(tmp_path / "out"), "--disable_tqdm", "true", *extra),
        ]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)

    first = launch(2)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    resumed = launch(4, "--resume_from_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "Final eval perplexity" in resumed.stdout and "after 4 steps" in resumed.stdout
    position = torch.load(
        tmp_path / "out" / "checkpoint-4" / "stage-0-replica-1" / "pipeline.pt", weights_only=True
    )["stream"]
    assert position["rows"] == 4 * 8  # 4 steps of 8 rows, read by replica 1 across the resume
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.vocab_size == 320
    assert not os.path.exists(tmp_path / "c") or not any(
        f.endswith(".arrow") for _, _, files in os.walk(tmp_path / "c") for f in files
    )


def _train_in_process(argv):
    """``recipes/train.py ARGV`` on a rank forked by ``run_distributed`` (no interpreter to start); a refused
    setting's exit status and ``error:`` line come back instead of ending the rank."""
    import contextlib
    import io

    from hf_noloco.launch.cli import main

    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        try:
            main(argv)
            status = 0
        except SystemExit as exc:
            status = exc.code
    return status, printed.getvalue(), errors.getvalue()


def test_a_streamed_run_that_never_evaluates_needs_no_max_eval_samples(tmp_path):
    """One process, two steps, streamed from local parquet files without an evaluation split: with
    ``eval_strategy: no`` it trains without max_eval_samples (and builds no evaluation set); a run that
    evaluates is still refused without it."""
    write_shards(tmp_path / "pq", 2, 40)
    train_bpe_tokenizer(documents(300), vocab_size=320, output_dir=str(tmp_path / "tokenizer"))
    model = '{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, '
    model += '"num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}'

    def argv(eval_strategy: str) -> list[str]:
        return [
            *("--model_config", model, "--tokenizer_name_or_path", str(tmp_path / "tokenizer")),
            *("--dataset_name", str(tmp_path / "pq"), "--dataset_streaming", "true", "--max_length", "16"),
            *("--shuffle_dataset", "true", "--shuffle_buffer_size", "8"),
            *("--pipeline_stages", "1", "--outer_optimizer", "local", "--per_device_train_batch_size", "2"),
            *("--max_steps", "2", "--logging_steps", "1", "--save_strategy", "no"),
            *("--eval_strategy", eval_strategy, "--eval_steps", "1", "--report_to", "none"),
            *("--disable_tqdm", "true", "--output_dir", str(tmp_path / f"out-{eval_strategy}")),
        ]

    [(status, printed, errors)] = run_distributed(_train_in_process, 1, argv("no"), timeout_s=120)
    assert status == 0, printed[-3000:] + errors[-3000:]
    assert printed.count("{'loss'") == 2  # both steps trained and logged
    assert "Final eval perplexity" not in printed  # nothing evaluated
    assert (tmp_path / "out-no" / "model.safetensors").exists()
    [(status, printed, errors)] = run_distributed(_train_in_process, 1, argv("steps"), timeout_s=120)
    assert status == 2 and "needs max_eval_samples" in errors, printed[-3000:] + errors[-3000:]
    assert not (tmp_path / "out-steps").exists() or not any((tmp_path / "out-steps").iterdir())
