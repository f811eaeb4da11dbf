"""Tiny Llama-family configs and batches shared by the tests."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

VOCAB = 96
# The model_config of the tiny recipes the command-line tests write (a recipe's `model_config:` key).
RECIPE_MODEL = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


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


# Every family the stages are proven for (the list docs/architecture.md gives), each with the settings that
# make its forward differ from Llama's set away from their neutral values, so that a stage that ignored one
# would compute something else.
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 6},
    "qwen2": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2},
    "qwen3": {"head_dim": 8},
    "smollm3": {"no_rope_layer_interval": 2},
    "gemma": {"head_dim": 8},
    "gemma2": {
        "head_dim": 8,
        "sliding_window": 6,
        "final_logit_softcapping": 3.0,
        "attn_logit_softcapping": 5.0,
    },
    "gemma3_text": {
        "head_dim": 8,
        "sliding_window": 6,
        "final_logit_softcapping": 3.0,
        "query_pre_attn_scalar": 12,
    },
    "phi3": {},
    "olmo2": {},
    "granite": {
        "embedding_multiplier": 3.0,
        "logits_scaling": 4.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
    },
    "cohere": {"logit_scale": 0.3, "use_qk_norm": False},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
}


def family_config(family: str, layers: int = 4, tied: bool = False):
    """A tiny config of ``family`` with its distinctive settings (:data:`FAMILIES`)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        family,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,  # within the tiny vocabulary (some families default to an id beyond it)
        **{k: v for k, v in FAMILIES[family].items() if k != "pad_token_id"},
    )
    config._attn_implementation = "eager"
    return config
