"""Small, fast training runs shared by the trainer tests: byte-level text (no tokenizer to train), a tiny
Llama config, and the NoLoCoConfig of a 2-stage run."""

from datasets import Dataset
from transformers import LlamaConfig

from hf_noloco.config import NoLoCoConfig

BLOCK = 32


def byte_corpus(blocks: int, offset: int = 0) -> Dataset:
    """Real English text (CPython's pydoc topics) as byte tokens: no tokenizer to train."""
    from pydoc_data.topics import topics

    data = "\n".join(topics[k] for k in sorted(topics)).encode()[offset * BLOCK :]
    rows = [list(data[i * BLOCK : (i + 1) * BLOCK]) for i in range(blocks)]
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def byte_config(layers=4, vocab_size=256, tied=False):
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def make_args(out, **overrides) -> NoLoCoConfig:
    settings = dict(
        output_dir=str(out),
        pipeline_stages=2,
        per_device_train_batch_size=8,
        microbatch_size=2,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=0,
        lr_scheduler_type="constant",
        max_steps=40,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=20,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        inner_steps=5,
        seed=3,
    )
    settings.update(overrides)
    return NoLoCoConfig(**settings)
