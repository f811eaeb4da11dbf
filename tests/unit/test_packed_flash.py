"""Packed rows under flash-attention: the sequence boundaries (``cu_seq_lens``, ``max_length``) are computed
once per microbatch, equal to what transformers computes from the positions in every decoder layer, and handed
to every layer, with no mask built (flash-attention's is ``None`` without padding). No flash kernels here: the
layers are stood in for by recorders of what they are given."""

import random

import torch
from torch import nn
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from hf_noloco.engine import stage as stage_module
from hf_noloco.engine.partition import split_model
from hf_noloco.engine.stage import packed_sequence_lengths
from tests.helpers.tiny_models import tiny_model


def _packed_positions(rows: int, seq: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        row = []
        while len(row) < seq:
            row += list(range(min(rng.randint(1, seq), seq - len(row))))
        out.append(row)
    return torch.tensor(out)


def test_the_boundaries_are_transformers_own():
    for seed in range(20):
        positions = _packed_positions(rows=1 + seed % 4, seq=16, seed=seed)
        cu, longest = packed_sequence_lengths(positions)
        (ref_cu, ref_k), (ref_max, _) = prepare_fa_kwargs_from_position_ids(positions.reshape(1, -1))
        assert torch.equal(cu, ref_cu) and torch.equal(cu, ref_k) and cu.dtype == torch.int32
        assert isinstance(longest, int) and longest == int(ref_max)


class _Recorder(nn.Module):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def forward(self, hidden, **kwargs):
        self.calls.append(kwargs)
        return hidden


def test_every_layer_gets_the_boundaries_and_no_mask_is_built(monkeypatch):
    stage = split_model(tiny_model("llama", 3, seed=0), 0, 1)
    stage.config._attn_implementation = "flash_attention_2"
    calls = []
    for key in list(stage.model.layers):
        stage.model.layers[key] = _Recorder(calls)
    built = []
    monkeypatch.setattr(stage, "_masks", lambda *args: built.append(args))
    positions = _packed_positions(rows=2, seq=12, seed=3)
    ids = torch.randint(0, 64, (2, 12))
    for varlen in (None, packed_sequence_lengths(positions)):  # computed in the stage, or given
        calls.clear()
        stage(ids, position_ids=positions, logits=False, varlen=varlen)
        cu, longest = packed_sequence_lengths(positions)
        assert len(calls) == 3 and not built
        for kwargs in calls:
            assert kwargs["attention_mask"] is None
            assert (
                torch.equal(kwargs["cu_seq_lens_q"], cu)
                and kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]
            )
            assert kwargs["max_length_q"] == kwargs["max_length_k"] == longest
    assert stage_module._is_flash(stage.config)
