"""Tiny Llama-family configs and batches shared by the tests."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

VOCAB = 96


def tiny_config(family: str = "llama", layers: int = 4, hidden: int = 32):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=6)  # smaller than the sequences: the window matters
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=8)
    raise ValueError(family)


def tiny_model(family: str = "llama", layers: int = 4, seed: int = 0, hidden: int = 32):
    torch.manual_seed(seed)
    config = tiny_config(family, layers, hidden)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).float()


def make_batch(rows: int, seq_len: int, seed: int, padded: bool = True) -> dict[str, torch.Tensor]:
    """Random tokens; with ``padded``, some rows end in padding (mask 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (rows, seq_len), generator=g)
    attention_mask = torch.ones(rows, seq_len, dtype=torch.long)
    if padded:
        lengths = torch.randint(seq_len // 2, seq_len + 1, (rows,), generator=g)
        for i, n in enumerate(lengths.tolist()):
            attention_mask[i, n:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def shard(batch: dict, replica: int, num_replicas: int) -> dict:
    rows = batch["input_ids"].shape[0] // num_replicas
    return {k: v[replica * rows : (replica + 1) * rows] for k, v in batch.items()}
