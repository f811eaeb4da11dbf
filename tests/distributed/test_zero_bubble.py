"""ZB-H1: the backward split into input and weight gradients gives the whole backward's gradients bit for
bit (every family, tied embeddings, the chunked loss); the zb-h1 schedule's losses and gradients are 1F1B's
bit for bit on real gloo processes (every routing, pp 2 and 3, tied embeddings, activation checkpointing,
LoRA), at 1F1B's peak of held activations."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_noloco.engine.losses import next_token_losses
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.partition import split_model
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.routing import Router
from hf_noloco.engine.schedule import held_limit
from hf_noloco.engine.split_backward import backward_input
from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.tiny_models import FAMILIES, family_config, make_batch, shard, tiny_model

ROWS_PER_REPLICA, SEQ, MICRO, ROUTINGS = 6, 10, 2, ("fixed", "sample", "step")


def _stage_gradients(family, tied, split, chunk):
    """Three stages of one model composed in this process, backward through each, whole or split (the Ws
    run last, after every B, as far from their B as a schedule ever puts them)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family, layers=3, tied=tied)).float()
    stages = [split_model(model, s, 3) for s in range(3)]
    batch = make_batch(2, 8, seed=1)
    x, inputs, outputs = batch["input_ids"], [], []
    for stage in stages:
        if not stage.is_first:
            x = x.detach().requires_grad_()
        inputs.append(x)
        x = stage(x, attention_mask=batch["attention_mask"], logits=False)
        if stage.is_last:
            x = next_token_losses(x, batch["labels"], stage.lm_head, chunk, stage.extras).sum()
        outputs.append(x)
    grad, weights, sent = None, [], []
    for s in (2, 1, 0):
        if split and s > 0:
            grad, w = backward_input(outputs[s], grad, inputs[s], stages[s].parameters())
            weights.append(w)
        else:
            torch.autograd.backward(outputs[s], grad)
            grad = inputs[s].grad
        sent.append(grad)
    for w in weights:
        w()
    grads = {f"{s}.{n}": p.grad for s, stage in enumerate(stages) for n, p in stage.named_parameters()}
    return grads, sent[:2]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_split_backward_is_the_whole_backward_bit_for_bit(family):
    tied = family in ("llama", "qwen3", "gemma")  # the tied matrix takes gradients on two stages
    chunk = 5 if family == "llama" else None  # the chunked loss: one custom node computes both gradients
    whole, whole_sent = _stage_gradients(family, tied, False, chunk)
    split, split_sent = _stage_gradients(family, tied, True, chunk)
    assert whole.keys() == split.keys()
    for name, grad in whole.items():
        assert (grad is None) == (split[name] is None), name  # None: unused (an MoE expert no row chose)
        assert grad is None or torch.equal(grad, split[name]), name
    assert sum(g is not None for g in whole.values()) > len(whole) // 2
    for a, b in zip(whole_sent, split_sent):
        assert torch.equal(a, b)


def _both_schedules(pp, layers, boundaries, variants):
    """Each rank: a step under 1f1b, then under zb-h1, from the same weights, per (variant, routing)."""
    mesh = PipelineMesh.build(pp)
    out = {}
    for variant in variants:
        if variant == "tied":
            torch.manual_seed(5)
            model = AutoModelForCausalLM.from_config(family_config("qwen3", layers, tied=True)).float()
        else:
            model = tiny_model("llama", layers, seed=5)
        stage = split_model(model, mesh.stage, pp, boundaries)
        if variant == "checkpointing":
            stage.activation_checkpointing_enable()
        if variant == "lora":
            from hf_noloco.adapters.settings import lora_config
            from hf_noloco.adapters.stage import add_adapters

            add_adapters(stage, lora_config(4, 8, 0.0, ["q_proj", "v_proj", "down_proj"]))
            with torch.no_grad():  # LoRA's B starts at zero: moved, every adapter's gradient is nonzero
                for name, p in stage.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        stage.train()
        batch = shard(
            make_batch(ROWS_PER_REPLICA * mesh.num_replicas, SEQ, seed=6), mesh.replica, mesh.num_replicas
        )
        for routing in ROUTINGS:
            for schedule in ("1f1b", "zb-h1"):
                stage.zero_grad(set_to_none=True)
                router = Router(mesh.num_replicas, routing, seed=11)
                engine = PipelineEngine(stage, mesh, router, MICRO, p2p_timeout=30, schedule=schedule)
                engine.samples_seen, engine.step_index = 8, 3
                result = engine.train_step(batch)
                out[variant, routing, schedule] = dict(
                    loss=result.loss,
                    grads={n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None},
                    peak=engine.peak_microbatches_held,
                )
    return mesh.stage, out


@pytest.mark.parametrize(
    "pp, layers, boundaries, variants",
    [
        (2, 4, None, ["plain", "tied", "checkpointing", "lora"]),
        (3, 5, [1, 4], ["plain", "lora"]),  # uneven 1/3/1
    ],
)
def test_zb_h1_trains_exactly_as_1f1b_at_1f1bs_peak_of_activations(pp, layers, boundaries, variants):
    results = run_distributed(_both_schedules, 2 * pp, pp, layers, boundaries, variants, timeout_s=150)
    num_micro = ROWS_PER_REPLICA // MICRO
    for variant in variants:
        peaks = {}
        for stage, out in results:
            for routing in ROUTINGS:
                a, b = out[variant, routing, "1f1b"], out[variant, routing, "zb-h1"]
                where = (variant, routing, stage)
                assert (a["loss"] is None) == (stage < pp - 1) and (b["loss"] is None) == (a["loss"] is None)
                assert a["loss"] is None or torch.equal(a["loss"], b["loss"]), where
                assert a["grads"].keys() == b["grads"].keys() and a["grads"], where
                for name, grad in a["grads"].items():
                    assert torch.equal(grad, b["grads"][name]), (where, name)
                assert b["peak"] <= held_limit("zb-h1", num_micro, pp, stage), where
                peaks.setdefault(stage, set()).add((a["peak"], b["peak"]))
        # The first stage holds what 1F1B holds; later ones hold deferred Ws (not under checkpointing, which
        # runs each whole backward at B time).
        assert peaks[0] == {(held_limit("1f1b", num_micro, pp, 0),) * 2}
        deferred = any(b > a for pairs in peaks.values() for a, b in pairs)
        assert deferred == (variant != "checkpointing"), (variant, peaks)
