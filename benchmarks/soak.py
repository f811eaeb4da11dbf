"""Soak test: a long NoLoCo run of a tiny Llama, watching every rank's resident memory and step time.

Four gloo processes (2 pipeline stages x 2 replicas) train a tiny byte-level Llama with the real
NoLoCoTrainer for thousands of steps: routed pipeline steps, an outer step every 10 steps, logging with the
exact replica divergence, periodic evaluation and checkpoints with rotation, and a new epoch (a new
dataloader iterator) every few dozen steps. Every rank records its resident set size (RSS, psutil) and the
wall time of each training step (on_step_begin -> on_step_end: the pipeline step, clipping, the optimizer
and outer step; not evaluation or saving). After a warm-up, a straight line is fitted to per-window medians
of both; a leak shows as a slope that the noise around the line cannot explain.

    python benchmarks/soak.py            # 3000 steps: several minutes on 2 cores
    python benchmarks/soak.py --quick    # 40 steps, seconds: checks the machinery and the output

Writes benchmarks/results/soak.json (soak_quick.json with --quick) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch

from hf_noloco.launch.local_launch import run_distributed

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BLOCK = 32

SETTINGS = {
    # windows: the number of per-window medians the trend is fitted to (and stored in the JSON).
    # logging_steps is not a multiple of inner_steps (10), so the exact divergence is seen between outer
    # syncs.
    "full": {
        "steps": 3000,
        "warmup": 300,
        "eval_steps": 500,
        "save_steps": 1000,
        "logging_steps": 45,
        "windows": 54,
    },
    "quick": {
        "steps": 40,
        "warmup": 12,
        "eval_steps": 20,
        "save_steps": 20,
        "logging_steps": 15,
        "windows": 7,
    },
}


# ------------------------------------------------------------------------------------ one rank's work


def _byte_corpus(blocks: int, offset: int = 0):
    """Real English text (CPython's pydoc topics) as byte tokens: no tokenizer to train."""
    from pydoc_data.topics import topics

    from datasets import Dataset

    data = "\n".join(topics[k] for k in sorted(topics)).encode()[offset * BLOCK :]
    rows = [list(data[i * BLOCK : (i + 1) * BLOCK]) for i in range(blocks)]
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def _soak_rank(out_dir: str, settings: dict) -> dict:
    import psutil
    from transformers import LlamaConfig, TrainerCallback

    from hf_noloco.config import NoLoCoConfig
    from hf_noloco.trainer import NoLoCoTrainer

    class Recorder(TrainerCallback):
        """RSS and step wall time, once per optimizer step, on this rank."""

        def __init__(self):
            self.process = psutil.Process()
            self.rss, self.step_s = [], []
            self._start = None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self._start)
            self.rss.append(self.process.memory_info().rss)

    model = LlamaConfig(
        vocab_size=256,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    args = NoLoCoConfig(
        output_dir=os.path.join(out_dir, "run"),
        pipeline_stages=2,
        per_device_train_batch_size=8,
        microbatch_size=2,
        per_device_eval_batch_size=16,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=settings["steps"],
        logging_steps=settings["logging_steps"],
        divergence_steps=settings["logging_steps"],
        eval_strategy="steps",
        eval_steps=settings["eval_steps"],
        save_strategy="steps",
        save_steps=settings["save_steps"],
        save_total_limit=1,
        report_to="none",
        disable_tqdm=True,
        outer_optimizer="noloco",
        inner_steps=10,
        routing="sample",
        seed=0,
    )
    recorder = Recorder()
    trainer = NoLoCoTrainer(
        model, args, train_dataset=_byte_corpus(512), eval_dataset=_byte_corpus(64, 600), callbacks=[recorder]
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    mesh = trainer.mesh
    result = {
        "rank": mesh.rank,
        "stage": mesh.stage,
        "replica": mesh.replica,
        "rss": recorder.rss,
        "step_s": recorder.step_s,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    trainer.end()
    return result


# -------------------------------------------------------------------------------------------- analysis


def window_medians(values: list[float], start: int, windows: int) -> tuple[list[float], list[float]]:
    """Medians of ``windows`` equal slices of ``values[start:]``, and the centre step of each slice.
    Medians, not means: a step slowed by another process on a shared machine is noise, not a trend."""
    chunks = np.array_split(np.arange(start, len(values)), windows)
    steps = [float(c.mean()) + 1 for c in chunks]  # steps count from 1
    return steps, [float(np.median(np.asarray(values)[c])) for c in chunks]


def trend(values: list[float], warmup: int, windows: int) -> dict:
    """A straight line through the per-window medians after the warm-up.

    growth: what the line rises from the first to the last window; noise: the standard deviation of the
    medians around it. ``grows`` only when the rise is more than 3x the noise and more than 1% of the level,
    so that a flat series on a busy machine is not called a leak, and a real one, however slow, is.
    """
    steps, medians = window_medians(values, warmup, windows)
    slope, intercept = np.polyfit(steps, medians, 1)
    residuals = np.asarray(medians) - (slope * np.asarray(steps) + intercept)
    growth = float(slope * (steps[-1] - steps[0]))
    noise = float(residuals.std(ddof=2)) if len(steps) > 2 else 0.0
    level = float(np.median(medians))
    return {
        "level": level,
        "slope_per_1000_steps": float(slope * 1000),
        "growth": growth,
        "noise": noise,
        "first_window": medians[0],
        "last_window": medians[-1],
        "grows": bool(growth > 3 * noise and growth > 0.01 * level),
    }


def analyse(ranks: list[dict], warmup: int, windows: int) -> list[dict]:
    rows = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        rss_mib = [b / 2**20 for b in r["rss"]]
        step_ms = [s * 1000 for s in r["step_s"]]
        steps, rss_series = window_medians(rss_mib, 0, windows)
        _, time_series = window_medians(step_ms, 0, windows)
        rows.append(
            {
                "rank": r["rank"],
                "stage": r["stage"],
                "replica": r["replica"],
                "steps_recorded": len(step_ms),
                "rss_mib": trend(rss_mib, warmup, windows),
                "step_ms": trend(step_ms, warmup, windows),
                "rss_mib_at_warmup_end": rss_mib[warmup - 1],
                "rss_mib_peak": max(rss_mib),
                "first_loss": r["first_loss"],
                "last_loss": r["last_loss"],
                "series": {"step": steps, "rss_mib": rss_series, "step_ms": time_series},
            }
        )
    return rows


def plot(rows: list[dict], warmup: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for row in rows:
        label = f"rank {row['rank']} (stage {row['stage']}, replica {row['replica']})"
        top.plot(row["series"]["step"], row["series"]["rss_mib"], marker=".", label=label)
        bottom.plot(row["series"]["step"], row["series"]["step_ms"], marker=".", label=label)
    for ax in (top, bottom):
        ax.axvspan(0, warmup, color="0.9", label="warm-up (not fitted)" if ax is top else None)
        ax.grid(alpha=0.3)
    top.set_ylabel("resident memory (MiB)")
    bottom.set_ylabel("step time (ms, window median)")
    bottom.set_xlabel("optimizer step")
    top.legend(fontsize=8)
    top.set_title("NoLoCo soak: tiny Llama, pp=2 x dp=2, 4 gloo processes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 steps: a smoke run for CI.")
    parser.add_argument("--steps", type=int, help="Override the number of optimizer steps.")
    parser.add_argument("--output", help="JSON path (the PNG goes next to it).")
    cli = parser.parse_args(argv)
    settings = dict(SETTINGS["quick" if cli.quick else "full"])
    if cli.steps:
        settings["steps"] = cli.steps
        settings["warmup"] = min(settings["warmup"], cli.steps // 4)
    output = cli.output or os.path.join(RESULTS, "soak_quick.json" if cli.quick else "soak.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)

    start = time.monotonic()
    with tempfile.TemporaryDirectory() as out_dir:
        ranks = run_distributed(_soak_rank, 4, out_dir, settings, timeout_s=600)
    wall_s = time.monotonic() - start
    rows = analyse(ranks, settings["warmup"], settings["windows"])

    result = {
        "settings": {
            **settings,
            "mode": "quick" if cli.quick else "full",
            "processes": 4,
            "pipeline_stages": 2,
            "replicas": 2,
            "outer_optimizer": "noloco",
            "inner_steps": 10,
            "model": "llama, 4 layers x 48, byte vocab, block 32",
        },
        "machine": {
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "wall_s": wall_s,
        "ranks": rows,
        "summary": {
            "rss_growth_mib": {str(r["rank"]): r["rss_mib"]["growth"] for r in rows},
            "step_ms_growth": {str(r["rank"]): r["step_ms"]["growth"] for r in rows},
            "any_growth": any(r["rss_mib"]["grows"] or r["step_ms"]["grows"] for r in rows),
        },
    }
    with open(output, "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, settings["warmup"], os.path.splitext(output)[0] + ".png")

    print(f"{settings['steps']} steps in {wall_s:.0f} s; fitted after step {settings['warmup']}:")
    print(
        f"{'rank':>4} {'RSS MiB':>8} {'growth':>8} {'noise':>7} {'step ms':>8} {'growth':>8} {'noise':>7}  "
        "verdict"
    )
    for r in rows:
        m, t = r["rss_mib"], r["step_ms"]
        verdict = "GROWS" if m["grows"] or t["grows"] else "flat"
        print(
            f"{r['rank']:>4} {m['level']:>8.1f} {m['growth']:>+8.2f} {m['noise']:>7.2f} "
            f"{t['level']:>8.2f} {t['growth']:>+8.2f} {t['noise']:>7.2f}  {verdict}"
        )
    print(f"wrote {output}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
