"""Training FLOPs of a token, from the model's config, and the peak FLOPs of common accelerators: what the
logged MFU (model FLOPs utilisation) divides.

The count is the usual one (Kaplan et al. 2020; the PaLM paper's appendix B): a training token costs
``6 N`` FLOPs for the ``N`` weights it is multiplied by (2 forward, 4 backward; the embedding lookup is not a
multiplication, the output head is) plus ``12 L d_attn s`` for attention over a row of ``s`` tokens, where
``L`` is the number of layers and ``d_attn`` the query width. It counts no recomputation (activation
checkpointing costs compute the count leaves out, as MFU conventionally does), and with frozen weights (LoRA)
it still counts ``6 N``, as the Trainer's own estimate does, so it overstates what such a run computes.
"""

from __future__ import annotations

# Dense bf16 tensor-core peaks, in TFLOPS, from the vendors' data sheets; more specific names first.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
}


def matmul_weights(config) -> int:
    """Weights a token is multiplied by in a Llama-family decoder: every layer's attention and MLP
    projections, and the output head."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o; k and v
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    return config.num_hidden_layers * (attention + mlp) + hidden * config.vocab_size


def training_flops_per_token(config, seq_len: int) -> float:
    """FLOPs of one token's forward and backward in a row of ``seq_len`` tokens (see the module's
    docstring)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6.0 * matmul_weights(config) + 12.0 * config.num_hidden_layers * heads * head_dim * seq_len


def peak_flops(device_name: str | None) -> float | None:
    """The dense bf16 peak of a device named like ``torch.cuda.get_device_name()`` says (``"NVIDIA H100 80GB
    HBM3"``), in FLOPS; ``None`` for a device not in :data:`PEAK_BF16_TFLOPS`."""
    if not device_name:
        return None
    for name, tflops in PEAK_BF16_TFLOPS.items():
        if name in device_name:
            return tflops * 1e12
    return None
