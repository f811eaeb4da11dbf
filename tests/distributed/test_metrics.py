"""Perplexity and replica divergence: the metric against a direct computation, the estimate against it."""

import functools
import math

import pytest
import torch

from hf_noloco.components.metrics import perplexity, replica_divergence
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.launch.local_launch import run_distributed
from hf_noloco.outer.gossip import gossip_groups
from hf_noloco.outer.optimizer import OuterOptimizer
from hf_noloco.outer.settings import OuterSettings

WORLD, SEED, DRAWS = 4, 3, 40


def test_perplexity():
    assert perplexity(math.log(7.0) * 10, 10) == pytest.approx(7.0)
    assert perplexity(torch.tensor(0.0), torch.tensor(5)) == 1.0
    assert perplexity(1e6, 1) == float("inf")  # overflow guarded
    assert math.isnan(perplexity(float("nan"), 3))
    with pytest.raises(ValueError, match="positive token count"):
        perplexity(1.0, 0)


def _weights(stage, replica):
    """Stage tensors of different sizes per stage; replicas differ by a replica-dependent amount."""
    g = torch.Generator().manual_seed(100 * stage + replica)
    scale = 0.1 * (replica + 1)
    return [torch.randn(3 + stage, 4, generator=g) * scale + stage, torch.randn(6, generator=g) * scale]


class _Tied(torch.nn.Module):
    def __init__(self, stage, replica):
        super().__init__()
        w, b = _weights(stage, replica)
        self.a = torch.nn.Linear(4, 3 + stage, bias=False)
        self.b = torch.nn.Linear(4, 3 + stage, bias=False)
        self.b.weight = self.a.weight  # tied: must count once
        self.v = torch.nn.Parameter(b)
        with torch.no_grad():
            self.a.weight.copy_(w)


def _metrics_job():
    out = {}
    for pp in (1, 2):
        mesh = PipelineMesh.build(pp)
        model = _Tied(mesh.stage, mesh.replica)
        metric = replica_divergence(model, mesh)
        params = [model.a.weight, model.v]
        opt = OuterOptimizer(
            torch.optim.SGD(params, lr=0.1), params, mesh, OuterSettings("noloco", 1, routing_seed=SEED)
        )
        estimates = []
        for _ in range(DRAWS):  # the same weights each time, new partners each outer step
            with torch.no_grad():
                for p, w in zip(params, _weights(mesh.stage, mesh.replica)):
                    p.copy_(w)
            opt.reset_outer_state()
            opt.outer_step()
            estimates.append(opt.last_divergence_estimate)
        out[pp] = {"stage": mesh.stage, "replica": mesh.replica, "metric": metric, "estimates": estimates}
    return out


@functools.cache
def _results():
    return run_distributed(_metrics_job, WORLD)


def _direct(num_replicas, stages):
    """sqrt( sum_params sum_replicas (theta_r - mean_r theta)^2 / (numel * dp) ), per stage and overall."""
    sq, numel = {}, {}
    for s in stages:
        theta = torch.stack(
            [torch.cat([w.reshape(-1) for w in _weights(s, r)]).double() for r in range(num_replicas)]
        )
        sq[s] = ((theta - theta.mean(0)) ** 2).sum().item()
        numel[s] = theta.shape[1]
    per_stage = {s: math.sqrt(sq[s] / (numel[s] * num_replicas)) for s in stages}
    whole = math.sqrt(sum(sq.values()) / (sum(numel.values()) * num_replicas))
    return per_stage, whole


@pytest.mark.parametrize("pp", [1, 2])
def test_divergence_metric_matches_direct_computation(pp):
    results = [r[pp] for r in _results()]
    per_stage, whole = _direct(WORLD // pp, range(pp))
    for out in results:
        m = out["metric"]
        assert set(m) == {"replica_divergence"} | {f"replica_divergence/stage_{s}" for s in range(pp)}
        assert m["replica_divergence"] == pytest.approx(whole, rel=1e-5)
        for s in range(pp):
            assert m[f"replica_divergence/stage_{s}"] == pytest.approx(per_stage[s], rel=1e-5)
        assert m == results[0]["metric"]  # the same dict on every rank


@pytest.mark.parametrize("pp", [1, 2])
def test_divergence_estimate_tracks_metric(pp):
    results = [r[pp] for r in _results()]
    num_replicas = WORLD // pp
    per_stage, _ = _direct(num_replicas, range(pp))
    for s in range(pp):
        stage_results = [o for o in results if o["stage"] == s]
        if num_replicas == 2:  # one partner, the only other replica: the estimate is the metric
            for o in stage_results:
                assert all(e == pytest.approx(per_stage[s], rel=1e-5) for e in o["estimates"])
            continue
        # Each estimate is the plain formula on this replica's pair ...
        theta = [torch.cat([w.reshape(-1) for w in _weights(s, r)]).double() for r in range(num_replicas)]
        numel = theta[0].numel()
        for o in stage_results:
            r = o["replica"]
            for k, est in enumerate(o["estimates"]):
                j = next(q for g in gossip_groups(num_replicas, 2, SEED, k) if r in g for q in g if q != r)
                sq = ((theta[r] - theta[j]) ** 2).sum().item()
                assert est == pytest.approx(
                    math.sqrt(sq * (num_replicas - 1) / (2 * num_replicas) / numel), rel=1e-5
                )
        # ... and its square is unbiased for the metric's square: over replicas and draws, the mean agrees.
        mean_sq = sum(e**2 for o in stage_results for e in o["estimates"]) / (len(stage_results) * DRAWS)
        assert mean_sq == pytest.approx(per_stage[s] ** 2, rel=0.15)


REAL, STEPS, ROWS = 24, 4, 8  # real tokens of each 32-token row, steps, rows per replica and step


def _padded_run(out_dir):
    from hf_noloco.trainer import NoLoCoTrainer
    from tests.helpers.runs import byte_config, byte_corpus, make_args

    rows = byte_corpus(64)
    mask = [[1] * REAL + [0] * (len(ids) - REAL) for ids in rows["input_ids"]]
    labels = [[t if m else -100 for t, m in zip(ids, ms)] for ids, ms in zip(rows["input_ids"], mask)]
    rows = rows.remove_columns("labels").add_column("labels", labels).add_column("attention_mask", mask)
    args = make_args(
        out_dir,
        max_steps=STEPS,
        logging_steps=2,
        eval_strategy="no",
        per_device_train_batch_size=ROWS,
        peak_tflops=1.0,
    )
    trainer = NoLoCoTrainer(byte_config(), args, train_dataset=rows)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = (logs, trainer.state.total_flos)
    trainer.end()
    return result


def test_logs_count_real_tokens_and_give_flops_and_mfu(tmp_path):
    from hf_noloco.estimate.flops import training_flops_per_token
    from tests.helpers.runs import BLOCK, byte_config

    per_token = training_flops_per_token(byte_config(), BLOCK)
    results = run_distributed(_padded_run, 4, str(tmp_path), timeout_s=120)  # pp 2 x dp 2
    for logs, total_flos in results:  # every rank logs the same sums
        assert [h["step"] for h in logs] == [2, 4]
        for h in logs:
            seen = h["step"] * 2 * ROWS  # rows over both replicas
            assert h["tokens_seen"] == seen * REAL  # the padding is not counted
            assert h["trained_tokens_seen"] == seen * (REAL - 1)  # the first real token has no target
            assert h["trained_tokens_per_second"] == pytest.approx(h["tokens_per_second"] * (REAL - 1) / REAL)
            # MFU: the real tokens' FLOPs per second, per device (4), over 1 TFLOPS.
            assert h["mfu"] == pytest.approx(h["tokens_per_second"] * per_token / 4 / 1e12, rel=1e-6)
        # total_flos: every token computed, padding included (the MFU above counts only the real ones).
        assert total_flos == pytest.approx(STEPS * 2 * ROWS * BLOCK * per_token, rel=1e-9)
