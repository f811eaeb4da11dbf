"""Splitting a model into stages: the stages composed in one process are the unsplit model."""

import copy
import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from hf_noloco.engine.loading import build_stage, load_stage_weights
from hf_noloco.engine.losses import next_token_losses, target_token_count
from hf_noloco.engine.partition import (
    compute_balanced_boundaries,
    split_model,
    stage_compute_costs,
    stage_layer_ranges,
)
from tests.helpers.tiny_models import make_batch, tiny_config, tiny_model


def test_even_split_gives_earlier_stages_the_remainder():
    assert stage_layer_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert stage_layer_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_layer_ranges(6, 2, [1]) == [(0, 1), (1, 6)]


def _stage_costs(costs, boundaries, last_stage_cost):
    starts = [0, *boundaries]
    ends = [*boundaries, len(costs)]
    return [
        sum(costs[a:b]) + (last_stage_cost if s == len(starts) - 1 else 0)
        for s, (a, b) in enumerate(zip(starts, ends))
    ]


def test_compute_balance_without_extra_cost_is_the_even_split():
    for layers in range(1, 13):
        for stages in range(1, layers + 1):
            even = [start for start, _ in stage_layer_ranges(layers, stages)][1:]
            assert compute_balanced_boundaries([7] * layers, stages) == even, (layers, stages)


def test_compute_balance_minimises_the_costliest_stage():
    # Against every possible split, enumerated: the smallest maximum, and among those the most even.
    rng = random.Random(0)
    for _ in range(200):
        layers = rng.randint(1, 8)
        stages = rng.randint(1, layers)
        costs = [rng.randint(1, 20) for _ in range(layers)]
        extra = rng.randint(0, 40)
        splits = [list(b) for b in itertools.combinations(range(1, layers), stages - 1)]
        best = min(
            (max(_stage_costs(costs, b, extra)), sum(c * c for c in _stage_costs(costs, b, extra)))
            for b in splits
        )
        got = compute_balanced_boundaries(costs, stages, extra)
        assert got in splits
        assert (
            max(_stage_costs(costs, got, extra)),
            sum(c * c for c in _stage_costs(costs, got, extra)),
        ) == best


def test_compute_balance_moves_layers_off_the_last_stage():
    # 4 layers and an lm_head worth 1.3 layers (vocab 4096, hidden 256): 3/1, not 2/2.
    assert compute_balanced_boundaries([791040] * 4, 2, 1048576) == [3]
    # Llama-3-8B's proportions (layer 218M, lm_head 525M parameters) over 4 stages: 9/9/8/6.
    assert compute_balanced_boundaries([218] * 32, 4, 525) == [9, 18, 26]


def test_stage_compute_costs_count_each_layers_and_the_heads_weights():
    model = tiny_model("llama", 3)
    layer_costs, head_cost = stage_compute_costs(model)
    assert layer_costs == [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert head_cost == model.config.vocab_size * model.config.hidden_size


def test_split_model_with_compute_balance():
    config = tiny_config("llama", 4)
    config.vocab_size = 1024  # lm_head: 32768 weights, 3.5 layers of 9280: the last stage keeps one layer
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    stages = [split_model(model, s, 2, stage_balance="compute") for s in range(2)]
    assert [stage.layer_range for stage in stages] == stages[0].all_layer_ranges == [(0, 3), (3, 4)]
    assert split_model(model, 0, 2).all_layer_ranges == [(0, 2), (2, 4)]
    assert split_model(model, 0, 2, [1], stage_balance="compute").all_layer_ranges == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="stage_balance must be one of layers, compute"):
        split_model(model, 0, 2, stage_balance="flops")


@pytest.mark.parametrize(
    "layers, stages, boundaries, message",
    [
        (3, 4, None, "more than the model's 3 decoder layers"),
        (6, 3, [2], "must list the first layer"),
        (6, 3, [3, 3], "strictly increasing"),
        (6, 2, [6], "below the layer count"),
        (6, 2, [0], "strictly increasing"),
    ],
)
def test_bad_splits_are_refused(layers, stages, boundaries, message):
    with pytest.raises(ValueError, match=message):
        stage_layer_ranges(layers, stages, boundaries)


@pytest.mark.parametrize(
    "family, layers, stages, boundaries",
    [
        ("llama", 4, 2, None),
        ("llama", 5, 3, [1, 4]),  # uneven: 1/3/1
        ("mistral", 4, 3, None),  # sliding window on every layer
        ("qwen2", 5, 2, [3]),  # sliding and full layers mixed
        ("qwen3", 3, 3, None),
    ],
)
def test_stages_compose_to_the_unsplit_model(family, layers, stages, boundaries):
    model = tiny_model(family, layers, seed=1)
    batch = make_batch(3, 12, seed=2)
    reference = model(**batch)
    reference.loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    parts = [split_model(model, s, stages, boundaries) for s in range(stages)]
    names = [n for part in parts for n in part.state_dict()]
    assert sorted(names) == sorted(model.state_dict())  # the stages are an exact partition of the weights

    hidden = batch["input_ids"]
    for part in parts:
        hidden = part(hidden, attention_mask=batch["attention_mask"])
    torch.testing.assert_close(hidden, reference.logits, rtol=0, atol=1e-6)
    loss = next_token_losses(hidden, batch["labels"]).sum() / target_token_count(batch["labels"])
    torch.testing.assert_close(loss, reference.loss, rtol=0, atol=1e-6)
    loss.backward()
    for part in parts:
        for name, param in part.named_parameters():
            torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def _tied_model(family, layers, seed=1):
    config = tiny_config(family, layers)
    config.tie_word_embeddings = True
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize(
    "family, layers, stages, boundaries",
    [
        ("llama", 4, 2, None),
        ("llama", 5, 3, [1, 4]),  # uneven 1/3/1
        ("qwen2", 4, 2, [3]),  # uneven 3/1
        ("qwen2", 6, 3, None),
        ("qwen3", 4, 2, None),
        ("qwen3", 5, 3, [2, 3]),  # uneven 2/1/2
    ],
)
def test_tied_stages_as_separate_copies_compose_to_the_tied_model(family, layers, stages, boundaries):
    """Each stage copied (as in its own process): the first holds the embeddings, the last lm_head, two
    copies of one tensor; their gradients summed are the tied model's gradient."""
    model = _tied_model(family, layers)
    batch = make_batch(3, 12, seed=2)
    reference = model(**batch)
    reference.loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    parts = [copy.deepcopy(split_model(model, s, stages, boundaries)) for s in range(stages)]
    first, last = parts[0], parts[-1]
    assert first.tied_weight is first.model.embed_tokens.weight and last.tied_weight is last.lm_head.weight
    assert first.tied_weight is not last.tied_weight and torch.equal(first.tied_weight, last.tied_weight)
    assert last.mirrored_names == {"lm_head.weight"} and first.mirrored_names == set()
    assert all(p.tied_weight is None for p in parts[1:-1])
    hidden = batch["input_ids"]
    for part in parts:
        hidden = part(hidden, attention_mask=batch["attention_mask"])
    torch.testing.assert_close(hidden, reference.logits, rtol=0, atol=1e-6)
    loss = next_token_losses(hidden, batch["labels"]).sum() / target_token_count(batch["labels"])
    torch.testing.assert_close(loss, reference.loss, rtol=0, atol=1e-6)
    loss.backward()
    tied = "model.embed_tokens.weight"
    torch.testing.assert_close(first.tied_weight.grad + last.tied_weight.grad, expected_grads[tied])
    assert not torch.allclose(first.tied_weight.grad, expected_grads[tied])  # neither end alone is it
    for part in parts:
        for name, param in part.named_parameters():
            if param is not part.tied_weight:
                torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # In one process, without copies, the stages share the tensor: they are the tied model as it is.
    shared = [split_model(model, s, stages, boundaries) for s in range(stages)]
    assert shared[0].tied_weight is shared[-1].tied_weight


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tied_stages_are_built_equal_and_one_stage_keeps_one_tensor(tmp_path, family):
    config = tiny_config(family, 4)
    config.tie_word_embeddings = True
    whole = build_stage(config, 0, 1, seed=5)
    assert whole.lm_head.weight is whole.model.embed_tokens.weight  # one tensor, not two trained apart
    assert whole.tied_weight is None and whole.mirrored_names == set()
    for stages in (2, 3):
        first, last = build_stage(config, 0, stages, seed=5), build_stage(config, stages - 1, stages, seed=5)
        assert torch.equal(first.tied_weight, whole.model.embed_tokens.weight)
        assert torch.equal(last.tied_weight, whole.model.embed_tokens.weight)
    # From a tied checkpoint (which stores the matrix once, as the embeddings): lm_head reads it too.
    model = _tied_model(family, 4, seed=4)
    model.save_pretrained(tmp_path)
    last = build_stage(config, 1, 2, checkpoint=tmp_path)
    torch.testing.assert_close(last.lm_head.weight, model.model.embed_tokens.weight, rtol=0, atol=0)


@pytest.mark.parametrize("rows, seq_len, chunk", [(3, 12, 5), (2, 8, 16), (4, 6, 6), (1, 9, 1)])
def test_chunked_loss_equals_the_loss_on_full_logits(rows, seq_len, chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(rows, seq_len, 16, requires_grad=True)
    labels = torch.randint(0, 50, (rows, seq_len))
    labels[0, -3:] = -100
    plain = next_token_losses(head(hidden), labels)
    weights = torch.rand(rows, seq_len)  # any upstream gradient, not just a sum
    (plain * weights).sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    chunked = next_token_losses(hidden, labels, head, chunk_tokens=chunk)
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    (chunked * weights).sum().backward()
    torch.testing.assert_close(hidden.grad, grads[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(head.weight.grad, grads[1], rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # evaluation: the forward alone
        torch.testing.assert_close(
            next_token_losses(hidden, labels, head, chunk), plain, rtol=1e-6, atol=1e-6
        )
    assert chunked[0, -4:].eq(0).all()  # targets of -100 (and the last position) score 0


@pytest.mark.parametrize("precision", ["bfloat16", "autocast"])
def test_chunked_loss_in_bf16_is_the_plain_loss_within_bf16_rounding(precision):
    torch.manual_seed(1)
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    head = torch.nn.Linear(64, 300, bias=False, dtype=dtype)
    hidden = torch.randn(2, 40, 64, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 300, (2, 40))
    results = []
    for chunk in (None, 16):
        hidden.grad, head.weight.grad = None, None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            losses = next_token_losses(hidden, labels, head, chunk)
        assert losses.dtype == torch.float32
        losses.sum().backward()
        results.append((losses.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    (plain, *plain_grads), (chunked, *chunked_grads) = results
    torch.testing.assert_close(chunked, plain, rtol=1e-3, atol=1e-3)
    for a, b in zip(chunked_grads, plain_grads):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=1e-2)


def _stage_grads(stage, batch, **checkpointing):
    stage.zero_grad(set_to_none=True)
    if checkpointing:
        stage.activation_checkpointing_enable(**checkpointing)
    else:
        stage.activation_checkpointing_disable()
    out = stage(batch["input_ids"], attention_mask=batch["attention_mask"], logits=False)
    loss = next_token_losses(out, batch["labels"], stage.lm_head, 7).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in stage.named_parameters()}


def _counting(forward, calls):
    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    return counted


@pytest.mark.parametrize(
    "checkpointing",
    [
        {},
        {"every_n_layers": 2},
        {"offload": True},
        {"activation_checkpointing_kwargs": {"preserve_rng_state": False}},
    ],
)
def test_activation_checkpointing_gives_the_same_loss_and_gradients(checkpointing):
    stage = split_model(tiny_model("qwen2", 4, seed=3), 0, 1)
    batch = make_batch(3, 12, seed=4)
    loss, grads = _stage_grads(stage, batch)
    recomputed = []
    for layer in stage.model.layers.values():  # counts layer forwards, the backward's recomputations included
        layer.forward = _counting(layer.forward, recomputed)
    ckpt_loss, ckpt_grads = _stage_grads(stage, batch, **(checkpointing or {"every_n_layers": 1}))
    every = checkpointing.get("every_n_layers", 1)
    assert len(recomputed) == 4 + 4 // every  # each checkpointed layer ran forward twice
    assert torch.equal(loss, ckpt_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, ckpt_grads[name]), name
    with torch.no_grad():  # no backward to recompute for: layers run once
        recomputed.clear()
        stage(batch["input_ids"])
        assert len(recomputed) == 4
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        stage.activation_checkpointing_enable({"use_reentrant": True})


def test_non_llama_architecture_is_refused_with_the_expected_layout():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"not a Llama-family causal LM: it lacks .*model\.embed_tokens"):
        split_model(model, 0, 2)


def test_build_stage_materialises_only_its_slice_and_loads_checkpoint(tmp_path):
    model = tiny_model("llama", 4, seed=3)
    model.save_pretrained(tmp_path)
    stage = build_stage(model.config, 1, 2, checkpoint=tmp_path)
    assert sorted(stage.state_dict()) == sorted(split_model(model, 1, 2).state_dict())
    for name, tensor in stage.state_dict().items():
        torch.testing.assert_close(tensor, model.state_dict()[name], rtol=0, atol=0, msg=name)
    assert not hasattr(stage.model, "embed_tokens")

    fresh = build_stage(model.config, 0, 2)  # from scratch: the model's own initialisation
    emb = fresh.model.embed_tokens.weight
    assert emb.device.type == "cpu" and abs(emb.std().item() - model.config.initializer_range) < 0.005
    assert torch.equal(fresh.model.layers["0"].input_layernorm.weight, torch.ones(32))


@pytest.mark.parametrize("stages, balance", [(2, "layers"), (3, "layers"), (2, "compute")])
def test_fresh_initialisation_does_not_depend_on_the_split(stages, balance):
    config = tiny_config("qwen2", 5)
    whole = build_stage(config, 0, 1, seed=11).state_dict()
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    pieces = {}
    for s in range(stages):
        pieces.update(build_stage(config, s, stages, stage_balance=balance, seed=11).state_dict())
    assert torch.equal(torch.random.get_rng_state(), before)  # the global random state is left alone
    assert sorted(pieces) == sorted(whole)
    for name, tensor in whole.items():
        assert torch.equal(pieces[name], tensor), name
    other = build_stage(config, 0, 1, seed=12).state_dict()
    assert not torch.equal(
        other["model.layers.0.mlp.up_proj.weight"], whole["model.layers.0.mlp.up_proj.weight"]
    )
    # the modules do not share one draw: different layers get different weights
    assert not torch.equal(
        whole["model.layers.0.mlp.up_proj.weight"], whole["model.layers.1.mlp.up_proj.weight"]
    )


def test_loading_a_checkpoint_missing_a_tensor_names_it(tmp_path):
    from safetensors.torch import save_file

    model = tiny_model("llama", 2)
    state = {k: v for k, v in model.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    save_file(state, str(tmp_path / "model.safetensors"))
    stage = split_model(tiny_model("llama", 2), 1, 2)
    with pytest.raises(ValueError, match="holds no tensor model.layers.1.mlp.up_proj.weight"):
        load_stage_weights(stage, tmp_path)
