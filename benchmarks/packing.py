"""Chat fine-tuning, padded against packed: what best-fit-decreasing packing saves.

The fixture: conversations whose turn lengths follow a log-normal spread (median ~30 words a turn, a long
tail; 1 to 4 exchanges, some with a system turn), written from the words of CPython's pydoc topics, rendered
with a ChatML template by a byte-level BPE tokenizer trained on them. Both arms read the same rows
(``assistant_only_loss``, rows cut at ``max_length`` counted alike): ``padded`` gives each conversation a
row of ``max_length`` tokens, ``packed`` (``packing: true``, ``packing_strategy: bfd``) packs whole
conversations into rows with position ids restarting at each, so attention never crosses two of them and
the loss is the unpacked rows' (tests/distributed/test_packing.py proves it).

Each arm fine-tunes a tiny Llama (hidden 128, 4 layers) for ``--steps`` steps with the real NoLoCoTrainer,
two NoLoCo replicas on two gloo processes (as the chat recipe's replicas of the whole model), and reports,
from the trainer's own logs: trained (loss-bearing) tokens per second, non-padding tokens per second, the
rows and optimizer steps an epoch takes, and so the time an epoch takes. One run, both arms back to back.

    python benchmarks/packing.py            # writes benchmarks/results/packing.json
    python benchmarks/packing.py --quick    # a few steps: checks the machinery
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import RESULTS_DIR, machine  # noqa: E402

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MAX_LENGTH = 512
BATCH, MICRO = 8, 2  # rows per replica and step, rows per microbatch
ARMS = {"padded": {"packing": False}, "packed": {"packing": True, "packing_strategy": "bfd"}}


def _words() -> list[str]:
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    return [w for w in text.split() if w.isalpha() and len(w) < 12]


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` conversations with log-normal turn lengths (the fixture; see the module's docstring)."""
    rng = random.Random(seed)
    words = _words()

    def turn() -> str:
        length = max(2, min(400, int(rng.lognormvariate(3.4, 0.8))))
        start = rng.randrange(len(words) - length)
        return " ".join(words[start : start + length])

    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": turn()}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 4)):
            messages += [{"role": "user", "content": turn()}, {"role": "assistant", "content": turn()}]
        out.append(messages)
    return out


def _tokenizer(convs: list[list[dict]], folder: str):
    from hf_noloco.data.corpus import train_bpe_tokenizer

    texts = [m["content"] for c in convs[:500] for m in c]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=2048, output_dir=None)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    return tokenizer


def _rows(path: str, tokenizer, arm: str):
    from hf_noloco.data.datasets import prepare_datasets
    from hf_noloco.data.packing import trained_tokens

    train, _ = prepare_datasets(
        path, tokenizer, MAX_LENGTH, assistant_only_loss=True, evaluation=False, **ARMS[arm]
    )
    mask = sum(sum(row) for row in train["attention_mask"])
    return train, {
        "rows": len(train),
        "trained_tokens": trained_tokens(train),
        "non_padding_tokens": mask,
        "padding_share": 1 - mask / (len(train) * MAX_LENGTH),
    }


def _fine_tune(arm: str, train, vocab_size: int, steps: int, out_dir: str) -> dict | None:
    """Rank-collective: one arm's run; rank 0 returns its measurements from the trainer's logs."""
    import torch.distributed as dist
    import transformers
    from transformers import LlamaConfig
    from transformers.trainer_callback import PrinterCallback

    from hf_noloco.config import NoLoCoConfig
    from hf_noloco.trainer import NoLoCoTrainer

    args = NoLoCoConfig(
        output_dir=out_dir,
        pipeline_stages=1,
        inner_steps=10,
        outer_optimizer="noloco",
        per_device_train_batch_size=BATCH,
        microbatch_size=MICRO,
        learning_rate=1e-3,
        max_steps=steps,
        logging_steps=steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LENGTH,
        tie_word_embeddings=False,
    )
    transformers.logging.set_verbosity_error()
    trainer = NoLoCoTrainer(config, args, train_dataset=train)
    trainer.remove_callback(PrinterCallback)
    dist.barrier()
    output = trainer.train()
    log = next(h for h in trainer.state.log_history if "trained_tokens_seen" in h)
    rank = dist.get_rank()
    trainer.end()
    if rank != 0:
        return None
    seconds = output.metrics["train_runtime"]
    return {
        "steps": steps,
        "train_seconds": seconds,
        "seconds_per_step": seconds / steps,
        "trained_tokens_per_second": log["trained_tokens_seen"] / seconds,
        "non_padding_tokens_per_second": log["tokens_seen"] / seconds,
        "final_loss": log["loss"],
    }


def run(conversations_count: int, steps: int) -> dict:
    import datasets

    from hf_noloco.launch.local_launch import run_distributed

    datasets.disable_progress_bars()
    os.environ.setdefault("WANDB_MODE", "disabled")
    convs = conversations(conversations_count)
    result = {"max_length": MAX_LENGTH, "batch": BATCH, "conversations": len(convs), "arms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chat.jsonl")
        with open(path, "w") as f:
            for messages in convs:
                f.write(json.dumps({"messages": messages}) + "\n")
        tokenizer = _tokenizer(convs, os.path.join(tmp, "tokenizer"))
        lengths = sorted(
            len(tokenizer(tokenizer.apply_chat_template(c, tokenize=False)).input_ids) for c in convs
        )
        result["conversation_tokens"] = {
            "median": lengths[len(lengths) // 2],
            "p90": lengths[int(0.9 * len(lengths))],
            "max": lengths[-1],
            "over_max_length": sum(n > MAX_LENGTH for n in lengths) / len(lengths),
        }
        for arm in ARMS:
            train, stats = _rows(path, tokenizer, arm)
            ranks = run_distributed(
                _fine_tune, 2, arm, train, len(tokenizer), steps, os.path.join(tmp, arm), timeout_s=900
            )
            measured = ranks[0]
            stats["steps_per_epoch"] = -(-stats["rows"] // (2 * BATCH))  # two replicas
            stats["epoch_seconds"] = stats["steps_per_epoch"] * measured["seconds_per_step"]
            result["arms"][arm] = {**stats, **measured}
    padded, packed = result["arms"]["padded"], result["arms"]["packed"]
    result["summary"] = {
        "trained_tokens_per_second_ratio": packed["trained_tokens_per_second"]
        / padded["trained_tokens_per_second"],
        "steps_per_epoch_ratio": packed["steps_per_epoch"] / padded["steps_per_epoch"],
        "epoch_time_ratio": packed["epoch_seconds"] / padded["epoch_seconds"],
    }
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps: checks the machinery")
    parser.add_argument("--output", default=None)
    options = parser.parse_args(argv)
    count, steps = (120, 3) if options.quick else (1200, 30)
    result = {"machine": machine(), **run(count, steps)}
    name = "packing_quick.json" if options.quick else "packing.json"
    output = options.output or os.path.join(RESULTS_DIR, name)
    with open(output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'arm':8} {'rows':>6} {'padding':>8} {'steps/epoch':>12} {'trained tok/s':>14} {'epoch s':>9}")
    for arm, row in result["arms"].items():
        print(
            f"{arm:8} {row['rows']:6d} {row['padding_share']:8.1%} {row['steps_per_epoch']:12d} "
            f"{row['trained_tokens_per_second']:14.0f} {row['epoch_seconds']:9.1f}"
        )
    summary = result["summary"]
    print(
        f"packed / padded: trained tokens/s x{summary['trained_tokens_per_second_ratio']:.2f}, steps per "
        f"epoch x{summary['steps_per_epoch_ratio']:.2f}, epoch time x{summary['epoch_time_ratio']:.2f}"
    )
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
