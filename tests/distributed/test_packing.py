"""Packed rows (best-fit-decreasing bins with position ids restarting at each sequence) train the function of
the unpacked rows: a packed batch's loss and gradients through the pipeline, at 1 and 2 stages, equal HF's own
model run on each sequence alone, for text, conversations and prompt/completion pairs."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from hf_noloco.data.encoding import IGNORE_INDEX, make_encoder, set_pad_token
from hf_noloco.data.packing import encode_dataset, pack_bins
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.partition import split_model
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.routing import Router
from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.chat_fixtures import chat_tokenizer, conversations, sentence
from tests.helpers.tiny_models import tiny_config

MAX_LENGTH, ROWS, MICRO = 128, 4, 2
DOCS = 80
FORMATS = ("text", "messages", "prompt_completion")


def _documents(fmt: str) -> Dataset:
    if fmt == "text":
        return Dataset.from_dict({"text": [sentence(i, 2 + (i * 7) % 13) for i in range(DOCS)]})
    if fmt == "messages":
        return Dataset.from_dict({"messages": conversations(DOCS)})
    prompts = [sentence(i, 2 + i % 9) for i in range(DOCS)]
    completions = [sentence(i + 3, 1 + (i * 5) % 8) for i in range(DOCS)]
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def _packed_batch(tokenizer, fmt: str) -> tuple[dict, list[list[int]]]:
    """The first ROWS packed rows of ``fmt``'s documents, and every encoded sequence (to check the rows
    against)."""
    docs = _documents(fmt)
    encoder, layout = make_encoder(
        tokenizer,
        docs.column_names,
        packing=True,
        packing_strategy="bfd",
        assistant_only_loss=fmt == "messages",
        max_length=MAX_LENGTH,
    )
    assert layout == "bfd"
    encoded = encode_dataset(docs, encoder)
    rows = pack_bins(encoded, MAX_LENGTH, set_pad_token(tokenizer))
    assert len(rows) >= ROWS
    # The rows holding the most sequences (BFD's first bins hold the longest, often alone).
    starts = [
        sum(p == 0 and m for p, m in zip(*pm)) for pm in zip(rows["position_ids"], rows["attention_mask"])
    ]
    chosen = sorted(range(len(rows)), key=lambda i: -starts[i])[:ROWS]
    picked = rows.select(chosen)
    batch = {k: torch.tensor(picked[k]) for k in ("input_ids", "labels", "attention_mask", "position_ids")}
    return batch, encoded["input_ids"]


def _segments(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The sequences of packed rows, read from where their position ids restart (padding left out)."""
    out = []
    for ids, labels, mask, positions in zip(
        batch["input_ids"], batch["labels"], batch["attention_mask"], batch["position_ids"]
    ):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
        for a, b in zip(starts, starts[1:]):
            if mask[a]:
                out.append((ids[a:b], labels[a:b]))
    return out


def _model(vocab_size: int, attn: str):
    torch.manual_seed(3)
    config = tiny_config("llama", 4)
    config.vocab_size = vocab_size
    config._attn_implementation = attn
    return AutoModelForCausalLM.from_config(config).float()


def _reference(batch: dict, vocab_size: int) -> tuple[float, dict]:
    """HF's model on each sequence alone: the mean loss over all their target tokens, and its gradients."""
    model = _model(vocab_size, "eager")
    total, targets = 0.0, 0
    for ids, labels in _segments(batch):
        logits = model(input_ids=ids[None]).logits[0, :-1].float()
        target = labels[1:]
        total = total + torch.nn.functional.cross_entropy(
            logits, target, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        targets += int((target != IGNORE_INDEX).sum())
    loss = total / targets
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _run_packed(pp: int, batches: dict, vocab_size: int, flatten: bool):
    mesh = PipelineMesh.build(pp)
    out = {}
    for fmt, batch in batches.items():
        stage = split_model(_model(vocab_size, "sdpa"), mesh.stage, pp)
        stage._flatten_packed = flatten  # True: the layout flash-attention's kernels need
        engine = PipelineEngine(stage, mesh, Router(1, "fixed", seed=0), MICRO, p2p_timeout=30)
        result = engine.train_step(batch)
        out[fmt] = (
            None if result.loss is None else result.loss.item(),
            {n: p.grad.clone() for n, p in stage.named_parameters()},
        )
    return mesh.stage, out


@pytest.mark.parametrize("pp, flatten", [(1, False), (2, False), (2, True)], ids=["pp1", "pp2", "pp2-flat"])
def test_packed_rows_train_the_unpacked_sequences(pp, flatten):
    tokenizer = chat_tokenizer()
    vocab_size = len(tokenizer)
    batches, encoded = {}, {}
    for fmt in FORMATS:
        batches[fmt], encoded[fmt] = _packed_batch(tokenizer, fmt)
    results = run_distributed(_run_packed, pp, pp, batches, vocab_size, flatten, timeout_s=120)
    for fmt in FORMATS:
        segments = _segments(batches[fmt])
        # The rows hold whole encoded sequences, several per row: what makes the comparison mean something.
        assert len(segments) >= 2 * ROWS
        assert all(ids.tolist() in encoded[fmt] for ids, _ in segments)
        loss, grads = _reference(batches[fmt], vocab_size)
        for stage, out in results:
            got_loss, got_grads = out[fmt]
            if stage == pp - 1:
                assert got_loss == pytest.approx(loss, rel=1e-5), fmt
            for name, grad in got_grads.items():
                torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-6, msg=f"{fmt} {name}")


def _run_padded_pair(batch: dict, vocab_size: int):
    """Attention crossing sequences would change the loss: the same packed rows without their position ids
    (one sequence per row) must give another loss."""
    mesh = PipelineMesh.build(1)
    losses = []
    for keys in (("input_ids", "labels", "position_ids"), ("input_ids", "labels")):
        stage = split_model(_model(vocab_size, "sdpa"), mesh.stage, 1)
        engine = PipelineEngine(stage, mesh, Router(1, "fixed", seed=0), MICRO, p2p_timeout=30)
        losses.append(engine.train_step({k: batch[k] for k in keys}).loss.item())
    return losses


def test_without_position_ids_attention_would_cross_sequences():
    tokenizer = chat_tokenizer()
    batch, _ = _packed_batch(tokenizer, "text")
    [(packed, crossing)] = run_distributed(_run_padded_pair, 1, batch, len(tokenizer), timeout_s=60)
    assert packed == pytest.approx(_reference(batch, len(tokenizer))[0], rel=1e-5)
    assert abs(packed - crossing) > 1e-3
