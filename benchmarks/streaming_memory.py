"""Streaming memory: the peak resident memory of reading a whole corpus through the streamed data path,
against the corpus size. Flat means the stream never holds the corpus.

For each corpus size, parquet shards of synthetic English-like text are written (the corpus grows by more
shards of the same size, as real corpora do), then a fresh process reads ALL of it, one replica reading every
shard, through `prepare_streams` -> `TokenStream` -> a DataLoader with `default_data_collator`, exactly as the
trainer does. It records its resident memory before reading (after imports, tokenizer and the stream's set-up)
and the peak while reading (Linux VmHWM, reset before reading), the tokens per second, and the bytes written
to the `datasets` cache. The same corpus is then read by the ordinary path (`prepare_datasets`: tokenized and
packed ahead into the cache, then iterated), for contrast.

    python benchmarks/streaming_memory.py          # corpora of 8, 32 and 128 MB of text: about 15 minutes
    python benchmarks/streaming_memory.py --quick  # 1 and 2 MB, both reads at once: checks the machinery

Writes benchmarks/results/streaming_memory.json (streaming_memory_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHARD_MB = {"full": 8, "quick": 1}
SIZES_MB = {"full": [8, 32, 128], "quick": [1, 2]}
BLOCK = 1024
BATCH = 8
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "more",
    "can",
    "who",
    "its",
    "out",
    "what",
    "about",
    "up",
    "some",
    "time",
    "them",
    "than",
    "into",
    "only",
    "other",
    "new",
    "years",
    "could",
    "two",
    "may",
    "then",
    "first",
    "any",
    "like",
    "these",
    "over",
    "such",
    "people",
    "also",
    "most",
    "made",
    "after",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "where",
    "much",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "here",
    "get",
    "both",
    "between",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
]


# ------------------------------------------------------------------------------------------------- corpus


def write_corpus(folder: str, total_mb: int, shard_mb: int, seed: int = 0) -> dict:
    """``total_mb`` MB of text as parquet shards of ``shard_mb`` MB (row groups of 2000 documents)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    shards, written, docs = 0, 0, 0
    while written < total_mb * 2**20:
        rows, size = [], 0
        while size < shard_mb * 2**20:
            words = rng.choices(WORDS, k=rng.randint(20, 900))
            text = " ".join(words).capitalize() + "."
            rows.append(text)
            size += len(text)
        pq.write_table(
            pa.table({"text": rows}), os.path.join(folder, f"part-{shards:05d}.parquet"), row_group_size=2000
        )
        shards, written, docs = shards + 1, written + size, docs + len(rows)
    return {"shards": shards, "text_bytes": written, "documents": docs}


# -------------------------------------------------------------------------------------- one measurement


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def measure(corpus: str, tokenizer_dir: str, mode: str, cache: str) -> dict:
    """Runs in a fresh process: reads the whole corpus once (``mode``: ``stream`` or ``map``)."""
    import datasets
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer, default_data_collator

    from hf_noloco.data import datasets as data

    datasets.disable_progress_bars()
    datasets.config.HF_DATASETS_CACHE = cache
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cache_before = _folder_bytes(cache) if os.path.isdir(cache) else 0
    baseline = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM: the peak from here on
        f.write("5")
    start = time.perf_counter()
    series = []
    if mode == "stream":
        train, _ = data.prepare_streams(
            corpus, tokenizer, BLOCK, validation_split_percentage=1, max_eval_samples=1
        )
        rows = train.shard(0, 1)
        rows.repeat = False  # one epoch: every shard, to the end
    else:
        rows, _ = data.prepare_datasets(corpus, tokenizer, BLOCK, validation_split_percentage=1)
    blocks = 0
    for batch in DataLoader(rows, batch_size=BATCH, collate_fn=default_data_collator):
        blocks += batch["input_ids"].shape[0]
        if blocks % (BATCH * 64) == 0:
            series.append((blocks, _status_kib("VmRSS") / 1024))
    seconds = time.perf_counter() - start
    return {
        "mode": mode,
        "baseline_mib": baseline / 1024,
        "peak_mib": _status_kib("VmHWM") / 1024,
        "peak_above_baseline_mib": (_status_kib("VmHWM") - baseline) / 1024,
        "blocks": blocks,
        "tokens": blocks * BLOCK,
        "seconds": seconds,
        "tokens_per_s": blocks * BLOCK / seconds,
        "cache_bytes_written": _folder_bytes(cache) - cache_before if os.path.isdir(cache) else 0,
        "rss_series": series,
    }


def run_child(corpus: str, tokenizer_dir: str, mode: str, cache: str) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", corpus, tokenizer_dir, mode, cache],
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    if out.returncode != 0:
        raise RuntimeError(f"measurement failed ({mode}, {corpus}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small corpora: checks the machinery")
    parser.add_argument("--output", help="the JSON to write (default: benchmarks/results/...)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    mode = "quick" if args.quick else "full"
    output = args.output or os.path.join(
        RESULTS, "streaming_memory_quick.json" if args.quick else "streaming_memory.json"
    )
    from hf_noloco.data.corpus import train_bpe_tokenizer

    runs = []
    with tempfile.TemporaryDirectory() as work:
        sample = os.path.join(work, "sample")
        write_corpus(sample, 1, 1, seed=99)
        import pyarrow.parquet as pq

        texts = pq.read_table(os.path.join(sample, "part-00000.parquet")).column("text").to_pylist()
        tokenizer_dir = os.path.join(work, "tokenizer")
        train_bpe_tokenizer(texts, vocab_size=4096, output_dir=tokenizer_dir)
        for size in SIZES_MB[mode]:
            corpus = os.path.join(work, f"corpus-{size}")
            shape = write_corpus(corpus, size, SHARD_MB[mode])
            reads = ("stream", "map")
            jobs = [
                (corpus, tokenizer_dir, read, os.path.join(work, f"cache-{size}-{read}")) for read in reads
            ]
            # --quick checks the machinery: both reads at once, a process each (peaks are per process; the
            # quick run's tokens/s are then not a measurement).
            with ThreadPoolExecutor(2 if args.quick else 1) as pool:
                results = list(pool.map(lambda job: run_child(*job), jobs))
            for read, result in zip(reads, results):
                result.update(corpus_mb=size, **shape)
                runs.append(result)
                print(
                    f"{size:>5} MB corpus ({shape['shards']:>3} shards), {read:>6}: peak "
                    f"{result['peak_mib']:7.1f} MiB, {result['peak_above_baseline_mib']:+7.1f} MiB over the "
                    f"{result['baseline_mib']:.1f} MiB before reading; {result['tokens']:>11,} tokens at "
                    f"{result['tokens_per_s']:>9,.0f}/s; cache written "
                    f"{result['cache_bytes_written'] / 2**20:7.1f} MiB",
                    flush=True,
                )
    stream = [r for r in runs if r["mode"] == "stream"]
    mapped = [r for r in runs if r["mode"] == "map"]
    summary = {
        "corpus_growth": stream[-1]["corpus_mb"] / stream[0]["corpus_mb"],
        "stream_peak_above_baseline_mib": {
            str(r["corpus_mb"]): round(r["peak_above_baseline_mib"], 1) for r in stream
        },
        "stream_peak_growth_mib": stream[-1]["peak_above_baseline_mib"]
        - stream[0]["peak_above_baseline_mib"],
        "stream_cache_bytes_written": sum(r["cache_bytes_written"] for r in stream),
        "map_cache_mib": {str(r["corpus_mb"]): round(r["cache_bytes_written"] / 2**20, 1) for r in mapped},
        "map_peak_above_baseline_mib": {
            str(r["corpus_mb"]): round(r["peak_above_baseline_mib"], 1) for r in mapped
        },
    }
    print(
        f"\nCorpus x{summary['corpus_growth']:.0f}: the stream's peak above its start moved by "
        f"{summary['stream_peak_growth_mib']:+.1f} MiB and it wrote {summary['stream_cache_bytes_written']} "
        f"bytes to the datasets cache; the ordinary path wrote {summary['map_cache_mib']} MiB."
    )
    import datasets
    import torch
    import transformers

    result = {
        "settings": {
            "mode": mode,
            "sizes_mb": SIZES_MB[mode],
            "shard_mb": SHARD_MB[mode],
            "block_size": BLOCK,
            "batch_size": BATCH,
            "replicas": 1,
        },
        "machine": {
            "cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "datasets": datasets.__version__,
        },
        "runs": runs,
        "summary": summary,
    }
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"Wrote {output}")


if __name__ == "__main__":
    main()
