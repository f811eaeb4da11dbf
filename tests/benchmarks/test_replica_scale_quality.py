"""The vmapped replica study (benchmarks/_replica_stack.py) against independent references: each replica's
rows against the package's own per-replica loaders (Accelerate's seedable sampler and sharding), and the
stacked training against separate per-replica models, each with its own torch.optim.AdamW, its own clipping
(torch.nn.utils.clip_grad_norm_), the learning-rate schedule and the outer updates written out here."""

import copy
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, default_data_collator

from hf_noloco.components.loaders import ReplicaLoaders
from hf_noloco.engine.loading import build_stage
from hf_noloco.outer.gossip import gossip_groups
from tests.helpers.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from _replica_stack import ReplicaStack, replica_rows
from replica_scale_quality import sharded_eval_rows


def _loader_args(seed):
    return SimpleNamespace(
        dataloader_num_workers=0,
        dataloader_drop_last=False,
        dataloader_pin_memory=False,
        dataloader_persistent_workers=False,
        dataloader_prefetch_factor=None,
        dataloader_multiprocessing_context=None,
        dataloader_in_order=True,
        data_seed=seed,
        seed=seed,
    )


def _rows_seen(replicas, batch, num_rows, seed, training):
    """Row indices each replica's loader (the package's ReplicaLoaders, as the trainer builds them) yields."""
    dataset = [{"input_ids": torch.tensor([i])} for i in range(num_rows)]
    seen = []
    for r in range(replicas):
        mesh = SimpleNamespace(device=torch.device("cpu"), num_replicas=replicas, replica=r)
        loader = ReplicaLoaders(mesh, _loader_args(seed), default_data_collator).loader(
            dataset, batch, training
        )
        seen.append([b["input_ids"].flatten().tolist() for b in loader])
    return seen


@pytest.mark.parametrize("replicas,batch", [(2, 3), (3, 2), (4, 1)])
def test_each_replicas_rows_are_its_loaders(replicas, batch):
    num_rows, seed = 29, 7
    seen = _rows_seen(replicas, batch, num_rows, seed, training=True)
    steps = num_rows // (replicas * batch)  # the whole global batches of the epoch
    rows = replica_rows(num_rows, replicas, batch, seed, steps)
    for r in range(replicas):
        assert [rows[t, r].tolist() for t in range(steps)] == seen[r][:steps]
    # A second epoch is the next seed's permutation.
    longer = replica_rows(num_rows, replicas, batch, seed, steps + 1)
    g = torch.Generator()
    g.manual_seed(seed + 1)
    assert (
        longer[steps].flatten().tolist() == torch.randperm(num_rows, generator=g)[: replicas * batch].tolist()
    )


@pytest.mark.parametrize("replicas", [2, 4])
def test_the_factorials_evaluation_shards_are_its_loaders(replicas):
    seen = _rows_seen(replicas, 4, 16, 0, training=False)
    rows = sharded_eval_rows(16, 4, replicas)
    assert rows.tolist() == [sum(batches, []) for batches in seen]
    assert sharded_eval_rows(16, 4, 3) is None  # uneven shards are refused, not pooled wrongly


def _cosine_min_lr(step, lr, warmup, total, min_rate=0.1):
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / (total - warmup)
    return lr * (min_rate + (1 - min_rate) * 0.5 * (1 + math.cos(math.pi * progress)))


ARMS = [
    {"method": "diloco", "H": 2, "alpha": 0.3, "beta": 0.7, "gamma": None, "group": None},
    {"method": "noloco", "H": 2, "alpha": 0.3, "beta": 0.7, "gamma": 0.7, "group": 2},
    {"method": "noloco", "H": 3, "alpha": 0.5, "beta": 0.6, "gamma": 0.9, "group": 2},
    {"method": "local", "H": None},
]


def test_the_stack_is_separate_replicas_with_their_own_adamw_and_outer_steps():
    torch.manual_seed(0)
    R, rows, block, steps, lr, warmup, seed = 4, 2, 8, 6, 3e-3, 2, 3
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=block,
        tie_word_embeddings=False,
    )
    stage = build_stage(config, 0, 1, seed=seed, attn_implementation="eager")
    stack = ReplicaStack(stage, ARMS, R, seed, lr, 0.01, warmup, steps, max_grad_norm=0.5)
    ids = torch.randint(0, 64, (steps, R, rows, block))
    labels = ids.clone()
    labels[..., :2] = -100  # ignored targets: the loss divides by the counted ones

    # The reference: len(ARMS) x R separate models, each with its own AdamW (decay off for the norms).
    models = [[copy.deepcopy(stage) for _ in range(R)] for _ in ARMS]
    optimizers = [
        [
            torch.optim.AdamW(
                [
                    {"params": [p for n, p in m.named_parameters() if "norm" not in n], "weight_decay": 0.01},
                    {"params": [p for n, p in m.named_parameters() if "norm" in n], "weight_decay": 0.0},
                ],
                lr=lr,
                betas=(0.9, 0.999),
                eps=1e-8,
            )
            for m in arm_models
        ]
        for arm_models in models
    ]
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])
    phi = [[flat(m) for m in arm_models] for arm_models in models]
    delta = [[torch.zeros_like(v) for v in arm_phi] for arm_phi in phi]
    outer_steps = [0] * len(ARMS)

    def set_flat(m, v):
        start = 0
        for p in m.parameters():
            p.data.copy_(v[start : start + p.numel()].view_as(p))
            start += p.numel()

    for t in range(steps):
        stack.train_step(ids[t], labels[t])
        for a, arm in enumerate(ARMS):
            for r, (m, opt) in enumerate(zip(models[a], optimizers[a])):
                for group in opt.param_groups:
                    group["lr"] = _cosine_min_lr(t, lr, warmup, steps)
                logits = m(ids[t, r])
                loss = F.cross_entropy(
                    logits[:, :-1].reshape(-1, 64), labels[t, r][:, 1:].reshape(-1), ignore_index=-100
                )
                loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
            if arm["H"] is None or (t + 1) % arm["H"]:
                continue
            theta = [flat(m) for m in models[a]]
            if arm["method"] == "diloco":  # delta = alpha delta + beta mean_i(theta_i - phi); phi += delta
                mean = sum(th - ph for th, ph in zip(theta, phi[a])) / R
                for r in range(R):
                    delta[a][r] = arm["alpha"] * delta[a][r] + arm["beta"] * mean
            else:  # delta_i = alpha delta_i + beta mean_G(theta - phi) + gamma (mean_G(phi) - phi_i)
                for group in gossip_groups(R, 2, seed, outer_steps[a]):
                    pseudo = sum(theta[j] - phi[a][j] for j in group) / len(group)
                    phi_mean = sum(phi[a][j] for j in group) / len(group)
                    for i in group:
                        delta[a][i] = (
                            arm["alpha"] * delta[a][i]
                            + arm["beta"] * pseudo
                            + arm["gamma"] * (phi_mean - phi[a][i])
                        )
            for r in range(R):
                phi[a][r] = phi[a][r] + delta[a][r]
                set_flat(models[a][r], phi[a][r])
            outer_steps[a] += 1

    moved = 0.0
    for a in range(len(ARMS)):
        for r in range(R):
            got = torch.cat([stack.view(n, a)[r].flatten() for n in stack.names])
            want = flat(models[a][r])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
            moved = max(moved, (want - flat(stage)).abs().max().item())
    assert moved > 1e-3  # the weights did move: the comparison is not of the initial weights
    # NoLoCo's replicas differ (pairs, not all), DiLoCo's are one model after its last outer step (step 6).
    assert stack.divergence(0) < 1e-6 < stack.divergence(1)
