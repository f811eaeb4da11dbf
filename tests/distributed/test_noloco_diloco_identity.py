"""An exact identity of the method: with two replicas per stage, a NoLoCo pair is the whole replica group, so
with gamma = beta and the same alpha and H, NoLoCo's outer step is DiLoCo's

    delta <- alpha delta + beta (mean(theta) - phi)  ==  alpha delta + beta mean(theta - phi)

(both replicas hold the same phi and delta). Trained end to end on 2 replicas x 2 stages, the two methods
must give the same losses and weights up to float rounding (NoLoCo averages by point-to-point exchange,
DiLoCo by an all-reduce of pseudo-gradients: the roundings differ). With gamma != beta the gamma term,
gamma (mean(phi) - phi_i), is exactly zero, so that code path (slow weights sent too) must agree as well.

The control: the same comparison between DiLoCo at alpha 0.5 and 0.3 shows differences far above the
tolerance, so the tolerance is tight enough to see a change of outer momentum.
"""

import pytest

from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.runs import byte_config, byte_corpus, make_args

STEPS, H = 9, 3  # three outer steps: momentum enters from the second
ARMS = {
    "diloco": dict(outer_optimizer="diloco", outer_momentum=0.5, outer_lr=0.7),
    "noloco": dict(outer_optimizer="noloco", outer_momentum=0.5, outer_lr=0.7, outer_averaging=0.7),
    "noloco, gamma 0.3": dict(
        outer_optimizer="noloco", outer_momentum=0.5, outer_lr=0.7, outer_averaging=0.3
    ),
    "diloco, alpha 0.3": dict(outer_optimizer="diloco", outer_momentum=0.3, outer_lr=0.7),
}


def _train_each_arm(out):
    from hf_noloco.trainer import NoLoCoTrainer

    data = byte_corpus(160)
    results = {}
    for name, outer in ARMS.items():
        args = make_args(
            f"{out}/{name}",
            max_steps=STEPS,
            inner_steps=H,
            logging_steps=1,
            eval_strategy="no",
            routing="sample",
            lr_scheduler_type="cosine",
            warmup_steps=2,
            seed=5,
            **outer,
        )
        trainer = NoLoCoTrainer(byte_config(), args, train_dataset=data)
        start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "step" in h][:STEPS]
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        results[name] = (losses, weights, start, trainer.outer.outer_step_count, trainer.mesh.num_replicas)
    trainer.end()
    return results


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_noloco_equals_diloco_with_two_replicas(tmp_path):
    tolerance = 1e-5  # absolute, on weights of order 0.02-1 and losses of order 5 (rounding here: ~5e-7)
    for results in run_distributed(_train_each_arm, 4, str(tmp_path), timeout_s=180):
        reference_losses, reference, start, outer_steps, replicas = results["diloco"]
        assert replicas == 2 and outer_steps == STEPS // H and len(reference_losses) == STEPS
        assert _max_diff(reference, start) > 1e-3  # it trained
        for name in ("noloco", "noloco, gamma 0.3"):
            losses, weights, _, steps, _ = results[name]
            assert steps == outer_steps
            assert _max_diff(weights, reference) < tolerance, name
            assert losses == pytest.approx(reference_losses, rel=0, abs=tolerance), name
        # The control: another outer momentum moves the weights and losses by far more than the tolerance.
        losses, weights, _, _, _ = results["diloco, alpha 0.3"]
        assert _max_diff(weights, reference) > 10 * tolerance
        assert max(abs(a - b) for a, b in zip(losses, reference_losses)) > 10 * tolerance
