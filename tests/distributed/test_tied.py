"""Tied embeddings across pipeline stages, end to end on real gloo processes, against the unsplit tied model.

Each launch trains tiny tied Llama/Qwen2/Qwen3 models split over 2 or 3 stages (even and uneven) x 2 replicas
with every outer optimizer, through NoLoCoTrainer, recording each step's batch, loss and (first step)
gradients. The reference is written out here in one process: two replicas of the unsplit Hugging Face model
(one tensor for the tied weight), each trained on the batches its column saw, with AdamW, clipping by the
whole model's norm, and the outer steps' equations. Also checked: the two copies stay bit-identical, the
divergence metric counts the weight once, activation checkpointing changes nothing, the export reloads as a
tied model with the consensus logits, and a tied run resumes exactly.
"""

import os

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from hf_noloco.config import NoLoCoConfig
from hf_noloco.engine.loading import build_stage
from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.tiny_models import VOCAB, tiny_config

SEQ, ROWS, STEPS, H, LR, CLIP, SEED = 12, 4, 6, 3, 1e-2, 0.5, 7
METHODS = ("noloco", "diloco", "ddp", "local")
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def tied_config(family: str, layers: int):
    config = tiny_config(family, layers)
    config.tie_word_embeddings = True
    return config


def _dataset() -> Dataset:
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, VOCAB, (64, SEQ), generator=g).tolist()
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def _args(out, pp, boundaries, method, **overrides) -> NoLoCoConfig:
    settings = dict(
        output_dir=out,
        pipeline_stages=pp,
        stage_boundaries=boundaries,
        per_device_train_batch_size=ROWS,
        microbatch_size=2,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=CLIP,
        max_steps=STEPS,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        outer_optimizer=method,
        inner_steps=H if method in ("noloco", "diloco") else None,
        routing="fixed",  # each column is one model: the reference trains one unsplit replica per column
        seed=SEED,
    )
    settings.update(overrides)
    return NoLoCoConfig(**settings)


def _recording_trainer():
    from hf_noloco.trainer import NoLoCoTrainer

    class Recording(NoLoCoTrainer):
        """Records each step's batch and column loss, and the gradients of the first step (after the tied
        sum, before clipping)."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            step = {"input_ids": inputs["input_ids"].clone(), "labels": inputs["labels"].clone()}
            step["loss"] = loss.item()
            if not self.steps:
                step["grads"] = {n: p.grad.clone() for n, p in self.model.named_parameters()}
            self.steps.append(step)
            return loss

    return Recording


def _train(family, layers, pp, boundaries, out):
    from hf_noloco.components.metrics import replica_divergence

    Recording = _recording_trainer()
    config, data = tied_config(family, layers), _dataset()
    results = {}
    runs = [(m, {}) for m in METHODS] + [("local-ckpt", {"activation_checkpointing": True})]
    for name, extra in runs:
        method = name.split("-")[0]
        trainer = Recording(
            config, _args(os.path.join(out, name), pp, boundaries, method, **extra), train_dataset=data
        )
        trainer.steps = []
        trainer.train()
        results[name] = {
            "steps": trainer.steps,
            "weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "divergence": replica_divergence(trainer.model, trainer.mesh),
        }
        if name == "noloco":
            trainer.save_model(os.path.join(out, "export"))
    mesh = trainer.mesh
    trainer.end()
    return mesh.stage, mesh.replica, results


# ----------------------------------------------------------------------------------------------- reference


def _unsplit(config):
    """The unsplit HF model with the weights every split starts from (a fresh pp=1 build, seed SEED)."""
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(build_stage(config, 0, 1, seed=SEED).state_dict())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _reference(config, method, batches):
    """Two replicas of the unsplit tied model trained on ``batches[replica][step]``: AdamW, clipping by the
    whole model's norm, and the outer steps written out from the paper (gamma = beta, pairs)."""
    replicas = [_unsplit(config) for _ in range(2)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0) for m in replicas]
    phi = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in replicas]
    delta = [{n: torch.zeros_like(p) for n, p in m.named_parameters()} for m in replicas]
    losses, first_grads = [[], []], []
    for step in range(STEPS):
        for r, model in enumerate(replicas):
            loss = model(input_ids=batches[r][step]["input_ids"], labels=batches[r][step]["labels"]).loss
            loss.backward()
            losses[r].append(loss.item())
        if method == "ddp":
            for p0, p1 in zip(replicas[0].parameters(), replicas[1].parameters()):
                mean = (p0.grad + p1.grad) / 2
                p0.grad, p1.grad = mean.clone(), mean.clone()
        if step == 0:
            first_grads = [{n: p.grad.clone() for n, p in m.named_parameters()} for m in replicas]
        for model, optimizer in zip(replicas, optimizers):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # parameters(): the tied one once
            optimizer.step()
            optimizer.zero_grad()
        if method in ("noloco", "diloco") and (step + 1) % H == 0:
            alpha, beta = (0.5, 0.7) if method == "noloco" else (0.3, 0.7)
            with torch.no_grad():
                params = [dict(m.named_parameters()) for m in replicas]
                for n in params[0]:
                    # with two replicas the noloco pair is the whole group: mean_G(theta) = mean(theta)
                    mean_theta = (params[0][n] + params[1][n]) / 2
                    mean_phi = (phi[0][n] + phi[1][n]) / 2
                    for r in range(2):
                        if (
                            method == "noloco"
                        ):  # delta <- a delta + b mean(theta - phi) + g (mean phi - phi_i)
                            update = beta * (mean_theta - mean_phi) + beta * (mean_phi - phi[r][n])
                        else:  # delta <- a delta + b mean(theta - phi)
                            update = beta * (mean_theta - mean_phi)
                        delta[r][n] = alpha * delta[r][n] + update
                    for r in range(2):
                        phi[r][n] = phi[r][n] + delta[r][n]
                        params[r][n].copy_(phi[r][n])
    return replicas, losses, first_grads


# ------------------------------------------------------------------------------------------------- tests


def _by_rank(results):
    return {(stage, replica): res for stage, replica, res in results}


def _expected_name(name):
    return EMBED if name == HEAD else name  # the reference's tied tensor is registered once, as EMBED


@pytest.mark.parametrize(
    "family, layers, pp, boundaries",
    [
        ("llama", 4, 2, None),  # even 2/2
        ("qwen2", 5, 3, [1, 4]),  # uneven 1/3/1, sliding and full attention mixed
        ("qwen3", 5, 2, [3]),  # uneven 3/2
        ("qwen3", 6, 3, None),  # even 2/2/2
    ],
)
def test_tied_stages_train_like_the_unsplit_tied_model(tmp_path, family, layers, pp, boundaries):
    results = run_distributed(_train, 2 * pp, family, layers, pp, boundaries, str(tmp_path), timeout_s=300)
    ranks = _by_rank(results)
    config = tied_config(family, layers)
    last = pp - 1
    for name in (*METHODS, "local-ckpt"):
        method = name.split("-")[0]
        batches = [ranks[0, r][name]["steps"] for r in range(2)]
        for r in range(2):  # every stage of a column saw the column's batches
            for s in range(pp):
                for step, seen in enumerate(ranks[s, r][name]["steps"]):
                    assert torch.equal(seen["input_ids"], batches[r][step]["input_ids"])
        replicas, losses, first_grads = _reference(config, method, batches)
        for r in range(2):
            # The two copies of the tied weight are bit-identical after every kind of step.
            assert torch.equal(ranks[0, r][name]["weights"][EMBED], ranks[last, r][name]["weights"][HEAD])
            # The column's loss is the unsplit model's, at every step (outer steps at 3 and 6 included).
            got = [s["loss"] for s in ranks[last, r][name]["steps"]]
            assert got == pytest.approx(losses[r], rel=1e-5), (name, r)
            expected = dict(replicas[r].named_parameters())
            for s in range(pp):
                res = ranks[s, r][name]
                for n, grad in res["steps"][0]["grads"].items():  # the tied weight's: the sum of both ends
                    torch.testing.assert_close(
                        grad, first_grads[r][_expected_name(n)], rtol=1e-4, atol=1e-6, msg=f"{name} grad {n}"
                    )
                for n, w in res["weights"].items():
                    if n in expected or n == HEAD:
                        torch.testing.assert_close(
                            w, expected[_expected_name(n)].detach(), rtol=1e-4, atol=2e-5, msg=f"{name} {n}"
                        )
        if method != "local":
            continue  # an outer step just made the replicas equal up to rounding: nothing to measure
        # The divergence metric counts the tied weight once: recomputed from every rank's weights.
        sq, numel = 0.0, 0
        names = {}
        for s in range(pp):
            for n in ranks[s, 0][name]["weights"]:
                if n != HEAD or s != last:
                    names[n] = s
        for n, s in names.items():
            w = torch.stack([ranks[s, r][name]["weights"][n] for r in range(2)]).double()
            sq += (w - w.mean(0)).pow(2).sum().item()
            numel += w[0].numel()
        expected_divergence = (sq / (numel * 2)) ** 0.5
        assert ranks[0, 0][name]["divergence"]["replica_divergence"] == pytest.approx(
            expected_divergence, rel=1e-6
        )
    # Activation checkpointing: the same losses and weights, bit for bit.
    for key in ranks:
        plain, ckpt = ranks[key]["local"], ranks[key]["local-ckpt"]
        assert [s["loss"] for s in plain["steps"]] == [s["loss"] for s in ckpt["steps"]]
        for n, w in plain["weights"].items():
            assert torch.equal(w, ckpt["weights"][n]), n

    # The export: one tied tensor, tie_word_embeddings kept, the consensus logits.
    export = tmp_path / "export"
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    assert EMBED in stored and HEAD not in stored
    consensus = {}
    for s in range(pp):
        for n, w in ranks[s, 0]["noloco"]["weights"].items():
            if n == HEAD:
                continue
            consensus[n] = (w + ranks[s, 1]["noloco"]["weights"][n]) / 2
    reference = AutoModelForCausalLM.from_config(config)
    reference.load_state_dict({**consensus, HEAD: consensus[EMBED]})
    reference.tie_weights()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
