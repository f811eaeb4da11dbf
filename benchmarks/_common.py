"""Shared by the benchmarks that train: the corpus (BPE tokenizer trained once, cached), one NoLoCoTrainer
run on local gloo processes, and the curves of its log history.

A run is described by a plain dict (``spec``): the model config, the mesh (dp, pp), the outer method and its
hyperparameters, routing, seed and the training schedule. :func:`train_history` forks ``dp * pp`` processes
(one thread each, fork start, so the packed datasets are shared, not pickled), trains, and returns rank 0's
raw Trainer log history and the training wall time; :func:`curves` turns a log history into lists:

    {"steps": [...], "tokens": [...], "eval_perplexity": [...],         # every eval_steps, step 0 included
     "log_steps": [...], "loss": [...], "replica_divergence": [...],    # every logging step
     "replica_divergence_stages": {stage: [...]}, "final_perplexity": float}
"""

from __future__ import annotations

import hashlib
import os
import platform
import tempfile
import time

import torch
import transformers

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
BUILTIN = "builtin:python-docs"


def machine() -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cores": cores,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


# ------------------------------------------------------------------------------------------------- data


def _cache_dir(corpus: str, vocab_size: int, max_docs) -> str:
    """A tokenizer cache folder keyed by the corpus (path, size, mtime), its document cap and vocabulary."""
    key = corpus
    if corpus != BUILTIN:
        stat = os.stat(corpus)
        key = f"{os.path.abspath(corpus)}:{stat.st_size}:{int(stat.st_mtime)}"
    digest = hashlib.sha1(f"{key}:{vocab_size}:{max_docs}".encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), "hf_noloco_bench", f"tokenizer-{digest}")


def load_corpus(corpus: str, block_size: int, vocab_size: int, max_eval_blocks: int, max_docs=None):
    """Packed (train, eval) datasets of ``corpus`` (a text file or the built-in corpus) and its tokenizer.

    The BPE tokenizer is trained on the train documents once and cached in the temp folder; the 5%
    validation carve-out is by document (hf_noloco.data.sources.load_splits), so no block mixes both sides.
    ``max_docs`` keeps only the first that many train (and eval) documents (the smoke mode).
    """
    import datasets
    from transformers import AutoTokenizer

    from hf_noloco.data.corpus import train_bpe_tokenizer
    from hf_noloco.data.encoding import make_encoder
    from hf_noloco.data.packing import encode_dataset, pack_wrapped
    from hf_noloco.data.sources import load_splits

    datasets.disable_progress_bars()
    train_docs, eval_docs = load_splits(corpus, validation_split_percentage=5, seed=42)
    if max_docs is not None:
        train_docs = train_docs.select(range(min(max_docs, len(train_docs))))
        eval_docs = eval_docs.select(range(min(max(max_docs // 10, 2), len(eval_docs))))
    cache = _cache_dir(corpus, vocab_size, max_docs)
    if os.path.exists(os.path.join(cache, "tokenizer.json")):
        tokenizer = AutoTokenizer.from_pretrained(cache)
    else:
        tokenizer = train_bpe_tokenizer(train_docs["text"], vocab_size=vocab_size, output_dir=cache)
    encoder, _ = make_encoder(tokenizer, train_docs.column_names)  # text: wrapped rows
    train = pack_wrapped(encode_dataset(train_docs, encoder), block_size)
    eval_ = pack_wrapped(encode_dataset(eval_docs, encoder), block_size)
    eval_ = eval_.select(range(min(max_eval_blocks, len(eval_))))
    return train, eval_, tokenizer


def corpus_name(corpus: str) -> str:
    return "builtin" if corpus == BUILTIN else os.path.splitext(os.path.basename(corpus))[0]


# ---------------------------------------------------------------------------------------------- training


def _train_worker(spec: dict, train, eval_, out_dir: str):
    """Runs on every rank: one NoLoCoTrainer run; rank 0 returns the log history and the wall time."""
    import torch.distributed as dist
    from transformers import LlamaConfig
    from transformers.trainer_callback import PrinterCallback

    from hf_noloco.config import NoLoCoConfig
    from hf_noloco.trainer import NoLoCoTrainer

    steps = spec["max_steps"]
    outer = {}
    if spec["method"] in ("noloco", "diloco"):  # None: the paper's default for the method
        outer = {k: spec.get(k) for k in ("inner_steps", "outer_lr", "outer_momentum")}
        outer["outer_dtype"] = spec.get("outer_dtype", "float32")
    if spec["method"] == "noloco":
        outer.update(
            outer_averaging=spec.get("outer_averaging"), gossip_group_size=spec.get("gossip_group_size", 2)
        )
    args = NoLoCoConfig(
        output_dir=out_dir,
        pipeline_stages=spec["pp"],
        outer_optimizer=spec["method"],
        routing=spec["routing"],
        per_device_train_batch_size=spec["global_batch"] // spec["dp"],
        microbatch_size=spec["microbatch_size"],
        per_device_eval_batch_size=spec["eval_batch"],
        learning_rate=spec["lr"],
        weight_decay=0.01,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=spec["warmup_steps"],
        max_grad_norm=1.0,
        max_steps=steps,
        logging_steps=spec["log_every"],
        divergence_steps=spec["log_every"],
        eval_strategy="steps",
        eval_steps=spec["eval_every"],
        eval_on_start=True,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=spec["seed"],
        data_seed=spec["seed"],
        p2p_timeout=300,
        **outer,
        **{k: spec[k] for k in ("boundary_dtype", "boundary_grad_dtype", "boundary_block_size") if k in spec},
    )
    config = LlamaConfig(**spec["model"], tie_word_embeddings=False)
    transformers.logging.set_verbosity_error()
    trainer = NoLoCoTrainer(config, args, train_dataset=train, eval_dataset=eval_)
    trainer.remove_callback(PrinterCallback)  # the curves come back in the log history
    dist.barrier()
    start = time.monotonic()
    trainer.train()
    wall = time.monotonic() - start
    history = list(trainer.state.log_history)
    rank = dist.get_rank()
    trainer.end()
    return (history, wall) if rank == 0 else None


def curves(history: list[dict], tokens_per_step: int, num_stages: int) -> dict:
    """The curves of one run from its Trainer log history."""
    evals = [h for h in history if "eval_perplexity" in h]
    logs = [h for h in history if "loss" in h and "replica_divergence" in h]
    return {
        "steps": [h["step"] for h in evals],
        "tokens": [h["step"] * tokens_per_step for h in evals],
        "eval_perplexity": [h["eval_perplexity"] for h in evals],
        "log_steps": [h["step"] for h in logs],
        "loss": [h["loss"] for h in logs],
        "replica_divergence": [h["replica_divergence"] for h in logs],
        "replica_divergence_stages": {
            str(s): [h[f"replica_divergence/stage_{s}"] for h in logs] for s in range(num_stages)
        },
        "final_perplexity": evals[-1]["eval_perplexity"] if evals else float("nan"),
    }


def train_history(spec: dict, train, eval_) -> tuple[list[dict], float]:
    """Trains ``spec`` on ``dp * pp`` forked gloo processes; returns rank 0's Trainer log history (the raw
    log: one dict per logging step and per evaluation) and the training wall time in seconds."""
    from hf_noloco.launch.local_launch import run_distributed

    os.environ.setdefault("WANDB_MODE", "disabled")
    world = spec["dp"] * spec["pp"]
    with tempfile.TemporaryDirectory() as out_dir:
        results = run_distributed(_train_worker, world, spec, train, eval_, out_dir, timeout_s=600)
    return results[0]


def count_parameters(model: dict) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    return sum(
        p.numel() for p in LlamaForCausalLM(LlamaConfig(**model, tie_word_embeddings=False)).parameters()
    )
