"""The memory model (hf_noloco.estimate.memory) against what autograd saves, and against the committed CPU
measurements of benchmarks/memory.py."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig

from hf_noloco.engine.loading import build_stage
from hf_noloco.estimate.memory import (
    _layer_bytes_per_token,
    _shapes,
    estimate_peak_memory,
    estimate_stage_memory,
)
from tests.helpers.paths import ROOT

RESULTS = os.path.join(ROOT, "benchmarks", "results", "memory.json")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _config(model_type, hidden, intermediate, heads, kv_heads, head_dim, layers=4):
    return AutoConfig.for_model(
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=layers,
        vocab_size=256,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def _saved_bytes(stage, x, autocast: bool) -> int:
    """Bytes of the distinct tensors autograd saves in a forward of ``stage`` (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        stage(x)
    return sum(seen.values())


@pytest.mark.parametrize(
    "model_type, hidden, intermediate, heads, kv_heads, head_dim",
    [
        ("llama", 256, 704, 4, 2, 64),
        ("llama", 192, 512, 6, 6, 32),  # no grouped-query attention
        ("qwen3", 128, 384, 4, 1, 64),  # q/k norms; heads x head_dim (256) differs from hidden (128)
    ],
)
@pytest.mark.parametrize("mode", ["float32", "bfloat16", "autocast"])
def test_layer_coefficients_are_what_autograd_saves(
    model_type, hidden, intermediate, heads, kv_heads, head_dim, mode
):
    config = _config(model_type, hidden, intermediate, heads, kv_heads, head_dim)
    dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    stage = build_stage(config, 1, 3, [1, 3], dtype=dtype, seed=0, attn_implementation="sdpa")  # 2 layers
    rows, seq = 2, 48
    x = torch.randn(rows, seq, hidden, dtype=dtype, requires_grad=True)
    measured = _saved_bytes(stage, x, autocast=mode == "autocast")
    act = 2 if mode == "bfloat16" else 4
    matrices = sum(m.weight.numel() for m in stage.modules() if isinstance(m, torch.nn.Linear))
    copies = 2 * matrices if mode == "autocast" else 0  # autocast's bf16 copies of the weight matrices
    rotary = 2 * seq * head_dim * act  # cos and sin
    expected = 2 * rows * seq * _layer_bytes_per_token(_shapes(config), mode) + copies + rotary
    assert measured == expected


def test_estimates_follow_the_options():
    config = _config("llama", 2048, 8192, 32, 8, 64, layers=16)
    config.vocab_size = 128256
    base = dict(seq_len=4096, microbatch_size=1, num_microbatches=8, outer_optimizer="noloco")
    plain = estimate_stage_memory(config, 4, 1, **base)
    ckpt = estimate_stage_memory(config, 4, 1, activation_checkpointing=True, **base)
    bf16 = estimate_stage_memory(config, 4, 1, dtype="bfloat16", master_weights="none", **base)
    masters = estimate_stage_memory(config, 4, 1, dtype="bfloat16", **base)  # master_weights="float32"
    autocast = estimate_stage_memory(config, 4, 1, bf16_autocast=True, **base)
    offload = estimate_stage_memory(config, 4, 1, offload_outer_state=True, **base)
    gpipe = estimate_stage_memory(config, 4, 1, schedule="gpipe", **base)
    assert ckpt.activations < plain.activations / 10 and ckpt.weights == plain.weights
    assert bf16.weights * 2 == plain.weights and bf16.outer == plain.outer == 8 * plain.parameters
    # float32 masters under bf16 autocast: the weights, gradients and AdamW state of float32 training
    assert (
        masters == autocast
        and masters.weights + masters.gradients + masters.optimizer == 16 * masters.parameters
    )
    assert offload.outer == 0 and offload.peak < plain.peak
    assert gpipe.activations == plain.activations_per_microbatch * 8 and plain.activations == 3 * (
        plain.activations_per_microbatch
    )  # 1F1B: stage 1 of 4 holds 4 - 1 = 3 microbatches
    last_plain = estimate_stage_memory(config, 4, 3, loss_chunk_tokens=None, **base)
    last_chunked = estimate_stage_memory(config, 4, 3, loss_chunk_tokens=1024, **base)
    logits = 4096 * 128256 * 4  # one microbatch's float32 logits
    assert last_plain.peak - last_chunked.peak >= 2 * logits  # 3 x logits held, against 4 x a quarter
    assert estimate_peak_memory(config, 4, **base).peak == max(
        estimate_stage_memory(config, 4, s, **base).peak for s in range(4)
    )


def test_committed_measurements_agree_with_the_model():
    """Every committed measurement is within 15% of what the current model predicts for it."""
    import memory as bench  # benchmarks/memory.py

    with open(RESULTS) as f:
        results = json.load(f)
    by_name = {r["case"]["name"]: r for r in results["cases"]}
    assert set(by_name) == {c["name"] for c in bench.CASES}  # every case was measured
    for name, record in by_name.items():
        assert "measured" in record, (name, record.get("skipped") or record.get("error"))
        predicted = bench.predict(record["case"])
        measured = record["measured"]
        assert abs(predicted["peak"] / measured["peak"] - 1) <= 0.15, name
        assert (
            abs((predicted["activations"] + predicted["backward_extra"]) / measured["activations"] - 1)
            <= 0.15
        ), name
    # Activation checkpointing: the activations fall by the predicted factor.
    pairs = [
        ("1b-s1-fp32", "1b-s1-fp32-ckpt"),
        ("1b-pp4-s1-bf16", "1b-pp4-s1-bf16-ckpt"),
        ("8b-s1-bf16-seq4096", "8b-s1-bf16-seq4096-ckpt"),
    ]
    for pair in pairs:
        plain, ckpt = (by_name[n] for n in pair)
        measured = plain["measured"]["activations"] / ckpt["measured"]["activations"]
        predicted = [bench.predict(by_name[n]["case"]) for n in pair]
        factor = (predicted[0]["activations"] + predicted[0]["backward_extra"]) / (
            predicted[1]["activations"] + predicted[1]["backward_extra"]
        )
        # (a one-layer stage rebuilds as much as it saved: its factor is the smallest)
        assert measured > 1.5 and abs(measured / factor - 1) <= 0.15, (pair, measured, factor)


def test_memory_benchmark_quick(tmp_path):
    out = tmp_path / "memory.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "memory.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    cases = json.loads(out.read_text())["cases"]
    assert [c["case"]["name"] for c in cases] == ["tiny-s1-fp32", "tiny-s0-bf16-ckpt"]
    for case in cases:
        measured = case["measured"]
        assert measured["peak"] > 0 and measured["static"] > 0 and case["predicted"]["peak"] > 0


def test_gpu_memory_check_runs_on_cpu_in_quick_mode():
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "gpu_memory_check.py"),
            "--device",
            "cpu",
            "--quick",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "tiny-pp1-bf16-ckpt",
        "tiny-pp2-s1-fp32-outer",
        "tiny-pp2-s1-fp32-zbh1",  # zb-h1's stage: its deferred weight gradients hold more
    ]
    assert all("tokens/s" in line for line in lines)
