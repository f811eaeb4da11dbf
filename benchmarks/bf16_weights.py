"""Do bf16 weights learn at a fine-tuning learning rate? float32 weights against bf16 weights with float32
master weights (``master_weights: float32``, the default) and pure bf16 (``master_weights: none``).

A tiny Qwen2 (hidden 64, 4 layers, byte vocabulary) is first trained in float32 on real text (CPython's pydoc
topics as bytes) for ``--warmup_steps`` steps at lr 3e-3 and saved: the "pretrained" checkpoint. Each arm then
fine-tunes it for ``--steps`` steps at lr 2e-5, constant schedule, pp 2 (two gloo processes, the real
NoLoCoTrainer pipeline). Reported per arm: the fraction of the matrices' elements whose bf16 value moved off
the starting one (for float32 weights, their bf16 rounding), the evaluation loss before and after on held-out
blocks, its fall against the float32 arm's, the loss curve, and the bytes per trained parameter of weights,
gradients and AdamW state.

    python benchmarks/bf16_weights.py            # writes benchmarks/results/bf16_weights.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

BLOCK = 32
ARMS = {
    "float32": {"dtype": "float32", "master_weights": "float32"},
    "bfloat16, float32 master weights": {"dtype": "bfloat16", "master_weights": "float32"},
    "bfloat16, pure (master_weights none)": {"dtype": "bfloat16", "master_weights": "none"},
}
# Weights, gradients and AdamW's two moments, bytes per trained parameter.
BYTES_PER_PARAMETER = {
    "float32": 16,
    "bfloat16, float32 master weights": 16,
    "bfloat16, pure (master_weights none)": 8,
}


def _corpus(blocks: int, offset: int):
    from pydoc_data.topics import topics

    from datasets import Dataset

    data = "\n".join(topics[k] for k in sorted(topics)).encode()[offset * BLOCK :]
    rows = [list(data[i * BLOCK : (i + 1) * BLOCK]) for i in range(blocks)]
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def _config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _args(out, **overrides):
    from hf_noloco.config import NoLoCoConfig

    settings = dict(
        output_dir=out,
        pipeline_stages=2,
        outer_optimizer="local",
        per_device_train_batch_size=8,
        microbatch_size=2,
        per_device_eval_batch_size=8,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    return NoLoCoConfig(**settings)


def pretrain(folder: str, steps: int) -> None:
    """Rank-collective: the float32 "pretrained" checkpoint the arms fine-tune."""
    from hf_noloco.trainer import NoLoCoTrainer

    args = _args(folder + "-run", learning_rate=3e-3, max_steps=steps)
    trainer = NoLoCoTrainer(_config(), args, train_dataset=_corpus(8 * steps, 0))
    trainer.train()
    trainer.save_model(folder)
    trainer.end()


def fine_tune(folder: str, arm: str, steps: int) -> dict:
    """Rank-collective: one arm's fine-tune; returns this rank's measurements."""
    import torch

    from hf_noloco.trainer import NoLoCoTrainer

    options = ARMS[arm]
    args = _args(
        tempfile.mkdtemp(),
        learning_rate=2e-5,
        max_steps=steps,
        model_init_kwargs={"dtype": options["dtype"]},
        master_weights=options["master_weights"],
    )
    evaluation = _corpus(64, 4000)
    trainer = NoLoCoTrainer(folder, args, train_dataset=_corpus(8 * steps, 2000), eval_dataset=evaluation)
    matrices = {
        n: p.detach().to(torch.bfloat16).clone() for n, p in trainer.model.named_parameters() if p.dim() == 2
    }
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    moved = sum(
        int((p.detach().to(torch.bfloat16) != matrices[n]).sum())
        for n, p in trainer.model.named_parameters()
        if n in matrices
    )
    total = sum(t.numel() for t in matrices.values())
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    dtype = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
    trainer.end()
    return {
        "moved": moved,
        "total": total,
        "before": before,
        "after": after,
        "losses": losses,
        "dtype": dtype,
    }


def run(steps: int = 20, warmup_steps: int = 60) -> dict:
    from benchmarks._common import machine
    from hf_noloco.launch.local_launch import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "pretrained")
        run_distributed(pretrain, 2, folder, warmup_steps, timeout_s=300)
        arms = {}
        for arm in ARMS:
            ranks = run_distributed(fine_tune, 2, folder, arm, steps, timeout_s=300)
            moved, total = sum(r["moved"] for r in ranks), sum(r["total"] for r in ranks)
            arms[arm] = {
                "fraction_of_matrix_elements_moved": moved / total,
                "eval_loss_before": ranks[0]["before"],
                "eval_loss_after": ranks[0]["after"],
                "eval_loss_fall": ranks[0]["before"] - ranks[0]["after"],
                "train_loss": ranks[0]["losses"],
                "trained_weights_dtype": ranks[0]["dtype"],
                "bytes_per_trained_parameter": BYTES_PER_PARAMETER[arm],
            }
    reference = arms["float32"]["eval_loss_fall"]
    for arm in arms.values():
        arm["fall_against_float32"] = arm["eval_loss_fall"] / reference if reference else float("nan")
    return {
        "machine": machine(),
        "steps": steps,
        "pretrain_steps": warmup_steps,
        "learning_rate": 2e-5,
        "arms": arms,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup_steps", type=int, default=60)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bf16_weights.json"))
    args = parser.parse_args(argv)
    result = run(args.steps, args.warmup_steps)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"{'arm':40s} {'moved':>7s} {'loss before':>12s} {'after':>9s} {'fall':>9s} {'vs fp32':>8s} "
        f"{'B/param':>8s}"
    )
    for name, arm in result["arms"].items():
        print(
            f"{name:40s} {arm['fraction_of_matrix_elements_moved']:7.1%} {arm['eval_loss_before']:12.5f} "
            f"{arm['eval_loss_after']:9.5f} {arm['eval_loss_fall']:9.5f} {arm['fall_against_float32']:8.2f} "
            f"{arm['bytes_per_trained_parameter']:8d}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
