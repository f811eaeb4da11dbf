"""What the training logs count: non-padding and trained tokens, the FLOPs estimate against the model's own
weights, and the MFU it gives."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hf_noloco.components.metrics import Throughput
from hf_noloco.estimate.flops import matmul_weights, peak_flops, training_flops_per_token
from tests.helpers.tiny_models import make_batch, tiny_config


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_flops_count_the_weights_a_token_is_multiplied_by(family):
    config = tiny_config(family, layers=3)
    model = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert matmul_weights(config) == linear
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * 3 * config.num_attention_heads * head_dim * 64
    assert training_flops_per_token(config, 64) == 6 * linear + attention


def test_known_devices_have_their_dense_bf16_peak():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("Some Accelerator") is None and peak_flops(None) is None


def _two_ranks(stats: torch.Tensor) -> int:
    stats.mul_(2)  # a second rank that counted the same
    return 2


def test_padding_is_not_counted_and_mfu_divides_the_peak():
    config = tiny_config("llama", layers=2)
    batch = make_batch(rows=6, seq_len=10, seed=1, padded=True)
    real = int(batch["attention_mask"].sum())
    trained = int((batch["labels"][:, 1:] != -100).sum())
    assert real < batch["input_ids"].numel()  # the batch has padding to leave out
    throughput = Throughput(config, counts=True, peak_flops=1e9)
    per_token = training_flops_per_token(config, 10)
    assert throughput.count(batch) == batch["input_ids"].numel() * per_token  # total_flos: all computed
    entries = throughput.log_entries(_two_ranks, "cpu")
    assert entries["tokens_seen"] == 2 * real and entries["trained_tokens_seen"] == 2 * trained
    rate = entries["tokens_per_second"]
    assert entries["trained_tokens_per_second"] == pytest.approx(rate * trained / real)
    # MFU: the non-padding tokens' FLOPs per second of both ranks, per rank, over the peak.
    seconds = 2 * real / rate
    assert entries["mfu"] == pytest.approx(2 * real * per_token / seconds / 2 / 1e9, rel=1e-6)
    # The next log counts only what came after.
    assert throughput.log_entries(_two_ranks, "cpu")["tokens_seen"] == 2 * real


def test_other_stages_count_nothing_and_no_peak_means_no_mfu():
    config = tiny_config("llama", layers=2)
    batch = make_batch(rows=2, seq_len=8, seed=2, padded=False)
    middle = Throughput(config, counts=False)
    assert middle.count(batch) == 0.0
    entries = middle.log_entries(_two_ranks, "cpu")
    assert entries["tokens_seen"] == 0 and "mfu" not in entries
    # Without a mask every token counts; without labels every position past the first is trained.
    first = Throughput(config, counts=True)
    first.count({"input_ids": batch["input_ids"]})
    entries = first.log_entries(lambda t: 1, "cpu")
    assert entries["tokens_seen"] == 16 and entries["trained_tokens_seen"] == 14


def test_counts_survive_a_checkpoint_and_an_old_one_loads():
    config = tiny_config("llama", layers=2)
    throughput = Throughput(config)
    throughput.count(make_batch(rows=2, seq_len=8, seed=3))
    throughput.log_entries(lambda t: 1, "cpu")
    throughput.count(make_batch(rows=2, seq_len=8, seed=4))  # counted, not yet logged
    resumed = Throughput(config)
    resumed.load_state_dict(throughput.state_dict())
    assert (
        resumed.log_entries(lambda t: 1, "cpu")["tokens_seen"]
        == throughput.log_entries(lambda t: 1, "cpu")["tokens_seen"]
    )
    old = Throughput(config)
    old.load_state_dict(1234)  # a checkpoint that recorded tokens_seen alone
    assert old.tokens_seen == 1234 and old.trained_tokens_seen == 0
