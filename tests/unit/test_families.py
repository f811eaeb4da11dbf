"""Every family of the proven list, split at 1 to 3 stages (tied and untied): the composed stages give Hugging
Face's own logits, loss and every gradient, through the pipeline's own (chunked) loss; and the start-up proof
refuses what the stages do not reproduce, naming it."""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_noloco.engine.stage as stage_module
from hf_noloco.engine.fidelity import KEPT_LENGTH, PROOF_TOKENS, shrunken_config, split_problem
from hf_noloco.engine.losses import next_token_losses, target_token_count
from hf_noloco.engine.partition import split_model, stage_layer_ranges
from tests.helpers.tiny_models import FAMILIES, family_config, make_batch

CASES = [(family, stages, tied) for family in FAMILIES for stages, tied in [(1, True), (2, False), (3, True)]]


def _relative(a, b):
    return ((a - b).abs().max() / max(a.abs().max(), b.abs().max(), 1e-12)).item()


@pytest.mark.parametrize("family, stages, tied", CASES)
def test_stages_compute_the_models_logits_loss_and_gradients(family, stages, tied):
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(family_config(family, 5, tied)).eval()
    batch = make_batch(3, 14, seed=4)
    reference = model(**batch)
    reference.loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    parts = [split_model(model, s, stages) for s in range(stages)]
    hidden = batch["input_ids"]
    for part in parts:
        hidden = part(hidden, attention_mask=batch["attention_mask"], logits=part is not parts[-1])
    last = parts[-1]
    logits = last.extras.logits(last.lm_head(hidden))
    assert _relative(logits, reference.logits) < 1e-5, family
    losses = next_token_losses(hidden, batch["labels"], last.lm_head, chunk_tokens=5, extras=last.extras)
    loss = losses.sum() / target_token_count(batch["labels"])
    assert abs(loss.item() - reference.loss.item()) < 1e-5 * reference.loss.item()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert _relative(p.grad, expected[name]) < 1e-4, name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_start_up_proof_passes_every_proven_family_on_every_input_form(family):
    """Every form (unpadded, padded and packed rows, the evaluation path), under eager attention and under
    transformers' default (sdpa where the family has it, as a run that names none gets)."""
    config = family_config(family, 6, tied=family in ("gemma", "qwen3"))
    for stages, attention in ((1, "eager"), (3, None)):
        trial = copy.deepcopy(config)
        trial._attn_implementation = attention
        ranges = stage_layer_ranges(6, stages)
        assert split_problem(trial, ranges, loss_chunk_tokens=1024) is None, (stages, attention)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "gemma3_text", "granite"])
def test_the_start_up_proof_passes_flattened_packed_rows_and_bfloat16_weights(family):
    """A flash-attention run flattens packed rows (proven with a CPU implementation standing in for the
    kernels), and bfloat16 weights take the glue's low-precision path: the families whose glue differs most
    (sliding and full layers, rotary per layer type, soft-capping, multipliers)."""
    config = family_config(family, 6)
    ranges = stage_layer_ranges(6, 2)
    kwargs = dict(attn_implementation="flash_attention_2", dtype=torch.bfloat16)
    assert split_problem(config, ranges, loss_chunk_tokens=1024, **kwargs) is None


def test_what_the_stages_do_not_reproduce_is_refused_naming_it(monkeypatch):
    gemma2 = family_config("gemma2", 4)
    gemma2.final_logit_softcapping = 30.0
    mixtral = family_config("mixtral", 4)
    mixtral.output_router_logits = True
    assert "output_router_logits is not reproduced by the stages" in split_problem(mixtral, [(0, 2), (2, 4)])
    # A stage that forgot the soft-capping (the arithmetic of Gemma-2's ForCausalLM.forward):
    monkeypatch.setattr(stage_module.ForwardExtras, "of", classmethod(lambda cls, config: cls()))
    problem = split_problem(gemma2, [(0, 2), (2, 4)])
    assert problem.startswith("gemma2: final_logit_softcapping is not reproduced by the stages"), problem


def test_a_layer_type_the_stages_do_not_build_is_refused():
    config = family_config("qwen3", 2)
    model = AutoModelForCausalLM.from_config(config)
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="'linear_attention' are not reproduced by the stages"):
        split_model(model, 1, 2)
    # And the proof refuses it too, naming the layer type, before it runs either side.
    assert "'linear_attention' are not reproduced by the stages" in split_problem(config, [(0, 1), (1, 2)])


def test_the_shrunken_copy_keeps_each_stages_first_and_last_layer_and_their_settings():
    config = AutoConfig.for_model(
        "gemma3_text", num_hidden_layers=12, hidden_size=2048, head_dim=256, intermediate_size=8192
    )
    small, ranges = shrunken_config(config, [(0, 5), (5, 6), (6, 12)])
    assert ranges == [(0, 2), (2, 3), (3, 5)] and small.num_hidden_layers == 5
    assert small.layer_types == [config.layer_types[i] for i in (0, 4, 5, 6, 11)]
    assert (small.hidden_size, small.head_dim) == (64, 16)
    assert small.final_logit_softcapping == config.final_logit_softcapping
    # Its lengths are shrunk below the proof's rows, in their order (the window is the shorter).
    assert KEPT_LENGTH < small.sliding_window < small.max_position_embeddings < PROOF_TOKENS


@pytest.mark.parametrize("family", ["gemma", "gemma2"])
def test_a_checkpoint_with_computed_buffers_loads_and_exports_as_hf_does(tmp_path, family):
    """Gemma's embedding scale is a non-persistent buffer: no checkpoint holds it, so building a stage from
    the files and rebuilding the model for the export must compute it, as from_pretrained does."""
    from hf_noloco.engine.loading import build_stage
    from hf_noloco.io.full_checkpoint import build_model_from_state_dict

    config = family_config(family, 4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    batch = make_batch(2, 10, seed=1)
    stage = build_stage(reference.config, 0, 1, checkpoint=tmp_path).eval()
    logits = stage(batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(logits, reference(**batch).logits, rtol=1e-5, atol=1e-6)
    rebuilt = build_model_from_state_dict(reference.config, reference.state_dict())
    torch.testing.assert_close(rebuilt(**batch).logits, reference(**batch).logits, rtol=0, atol=0)


def test_a_mixture_of_experts_checkpoint_in_another_layout_is_refused_naming_the_tensor(tmp_path):
    from hf_noloco.engine.loading import build_stage

    config = family_config("mixtral", 2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds no tensor model\.layers\.0\..* saved in another layout"):
        build_stage(config, 0, 1, checkpoint=tmp_path)
