"""The start-up proof covers every input form the run feeds its stages (unpadded, padded and packed rows, the
evaluation path, the run's dtype), at the run's attention implementation and past every length setting: a
stage that agrees with Hugging Face's forward on some forms only is refused, naming the form it fails on."""

import pytest
import torch
from transformers import AutoConfig

import hf_noloco.engine.fidelity as fidelity
from hf_noloco.engine.fidelity import (
    KEPT_LENGTH,
    PROOF_TOKENS,
    forms_of_rows,
    shrunken_config,
    split_problem,
)
from hf_noloco.engine.partition import stage_layer_ranges
from hf_noloco.engine.stage import ForwardExtras, PipelineStage
from tests.helpers.tiny_models import family_config

RANGES = [(0, 2), (2, 4)]
UNPADDED = "unpadded rows (no attention mask, no position ids)"
PACKED = "packed rows (position ids restarting at each sequence, no attention mask)"


def _patch_masks(monkeypatch, wrong):
    """Stages whose masks are replaced by none (the attention then sees every token) where ``wrong(stage,
    hidden, attention_mask, position_ids)`` says so, and are the real ones elsewhere."""
    real = PipelineStage._masks

    def masks(self, hidden, attention_mask, position_ids):
        built = real(self, hidden, attention_mask, position_ids)
        return dict.fromkeys(built) if wrong(self, hidden, attention_mask, position_ids) else built

    monkeypatch.setattr(PipelineStage, "_masks", masks)


def test_a_stage_that_agrees_only_when_a_mask_is_given_is_refused_on_unpadded_rows(monkeypatch):
    config = family_config("llama", 4)
    # Stages that build the causal masks from a given attention mask only (the way a family whose model
    # always materialises its mask differs from one that lets the attention implementation skip it).
    _patch_masks(monkeypatch, lambda stage, hidden, mask, positions: mask is None)
    # The inputs the proof used to give (a padding mask) agree exactly ...
    assert split_problem(config, RANGES, forms=["padded"]) is None
    # ... and the rows a wrapped dataset feeds the stages are refused, naming the form.
    problem = split_problem(config, RANGES)
    assert problem.startswith(f"llama: the stages do not reproduce the model's forward on {UNPADDED}"), (
        problem
    )
    assert "logits differ" in problem


def test_a_stage_that_loses_packed_sequence_boundaries_is_refused_on_packed_rows(monkeypatch):
    config = family_config("qwen2", 4)
    _patch_masks(monkeypatch, lambda stage, hidden, mask, positions: positions is not None)
    assert f"on {PACKED}" in split_problem(config, RANGES)
    # A run that never packs cannot feed that form: proving the forms it uses passes.
    forms = {forms_of_rows(["input_ids", "labels"]), forms_of_rows(["input_ids", "attention_mask"])}
    assert forms == {"unpadded", "padded"}
    assert forms_of_rows(["input_ids", "attention_mask", "position_ids"]) == "packed"
    assert split_problem(config, RANGES, forms=[*forms, "evaluation"]) is None
    with pytest.raises(ValueError, match="Unknown input forms"):
        split_problem(config, RANGES, forms=["wrapped"])


def test_a_stage_that_differs_only_in_evaluation_is_refused_on_the_evaluation_path(monkeypatch):
    config = family_config("mistral", 4)
    real = PipelineStage.forward

    def forward(self, inputs, *args, **kwargs):
        out = real(self, inputs, *args, **kwargs)
        return out * 1.001 if self.is_last and not self.training else out

    monkeypatch.setattr(PipelineStage, "forward", forward)
    problem = split_problem(config, RANGES)
    assert f"on the evaluation path (eval mode, no gradients), on {UNPADDED}" in problem, problem
    assert split_problem(config, RANGES, forms=["unpadded", "padded", "packed"]) is None


def test_a_stage_that_differs_only_in_the_runs_dtype_is_refused_naming_it(monkeypatch):
    config = family_config("llama", 4)
    real = ForwardExtras.logits
    monkeypatch.setattr(
        ForwardExtras, "logits", lambda self, x: real(self, x) * (1.05 if x.dtype == torch.bfloat16 else 1)
    )
    assert split_problem(config, RANGES) is None  # float32 weights: the path it differs on is not taken
    assert f"on {UNPADDED} in bfloat16" in split_problem(config, RANGES, dtype=torch.bfloat16)


def test_doge_whose_model_always_materialises_its_causal_mask_is_refused_under_sdpa():
    """Doge's model builds its causal mask with ``allow_is_causal_skip=False`` (its dynamic mask is added onto
    it); the stages let sdpa skip a mask of ones, and Doge's attention then sees every token. The proof of
    padded rows alone agreed; unpadded rows under the run's sdpa are refused."""
    config = AutoConfig.for_model(
        "doge", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    problem = split_problem(config, RANGES, attn_implementation="sdpa")
    assert problem.startswith("doge: ") and f"on {UNPADDED}" in problem, problem
    assert split_problem(config, RANGES, attn_implementation="eager") is None  # eager materialises it


def test_a_length_setting_of_any_name_is_shrunk_below_the_proof_rows(monkeypatch):
    config = family_config("llama", 4)
    config.reach_of_a_new_window = 4096  # a length setting no list names
    small, _ = shrunken_config(config, RANGES)
    assert KEPT_LENGTH < small.reach_of_a_new_window < PROOF_TOKENS
    # Stages that go wrong only on sequences longer than it: past the proof's rows until it is shrunk.
    _patch_masks(monkeypatch, lambda stage, hidden, *_: hidden.shape[1] > stage.config.reach_of_a_new_window)
    problem = split_problem(config, RANGES)
    assert f"on {UNPADDED}" in problem and "reach_of_a_new_window" in problem, problem
    monkeypatch.setattr(fidelity, "_shrink_lengths", lambda *args: None)
    assert split_problem(config, RANGES) is None  # what the proof found before the length rule


def test_the_length_rule_shrinks_windows_and_rotary_thresholds_in_order_and_keeps_widths_ids_and_layers():
    mistral = AutoConfig.for_model("mistral", sliding_window=4096, max_position_embeddings=32768)
    small, _ = shrunken_config(mistral, stage_layer_ranges(32, 4))
    assert KEPT_LENGTH < small.sliding_window < small.max_position_embeddings < PROOF_TOKENS
    llama3 = AutoConfig.for_model(
        "llama", max_position_embeddings=131072, bos_token_id=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    small, _ = shrunken_config(llama3, stage_layer_ranges(32, 4))
    rope = small.rope_parameters
    assert (
        KEPT_LENGTH < rope["original_max_position_embeddings"] < small.max_position_embeddings < PROOF_TOKENS
    )
    assert rope["factor"] == 8.0 and small.bos_token_id == 1  # floats and identifiers are not lengths
    qwen2 = AutoConfig.for_model("qwen2", num_hidden_layers=28, max_window_layers=28, use_sliding_window=True)
    assert shrunken_config(qwen2, stage_layer_ranges(28, 2))[0].max_window_layers == 28  # it counts layers
    deepseek = AutoConfig.for_model("deepseek_v3", num_hidden_layers=4, kv_lora_rank=512)
    assert shrunken_config(deepseek, RANGES)[0].kv_lora_rank == 512  # a width: it changes the weights' shapes
