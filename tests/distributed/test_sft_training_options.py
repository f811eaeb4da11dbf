"""TRL's training-side options on a 2-stage pipeline: activation_offloading trains exactly as without it, the
logs carry TRL's mean_token_accuracy, entropy and num_tokens (training and evaluation), and loss_type="dft"
trains another loss than nll from the same start."""

import torch

from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.runs import byte_config, byte_corpus, make_args


def _train(out, options):
    from hf_noloco.trainer import NoLoCoTrainer

    args = make_args(out, outer_optimizer="local", max_steps=4, logging_steps=2, eval_steps=4, **options)
    trainer = NoLoCoTrainer(
        byte_config(layers=2), args, train_dataset=byte_corpus(64), eval_dataset=byte_corpus(16, 200)
    )
    trainer.train()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    history = trainer.state.log_history
    trainer.end()
    return weights, history


def test_offloading_logging_and_the_dft_loss(tmp_path):
    plain = run_distributed(_train, 2, str(tmp_path / "plain"), {}, timeout_s=120)
    offload = {"activation_offloading": True}
    offloaded = run_distributed(_train, 2, str(tmp_path / "offloaded"), offload, timeout_s=120)
    dft = run_distributed(_train, 2, str(tmp_path / "dft"), {"loss_type": "dft"}, timeout_s=120)
    for (weights, history), (offloaded_weights, offloaded_history) in zip(plain, offloaded):
        for name, value in weights.items():
            assert torch.equal(value, offloaded_weights[name]), name
        assert [h.get("loss") for h in history] == [h.get("loss") for h in offloaded_history]
    history = plain[0][1]
    train_logs = [h for h in history if "loss" in h]
    assert all(0 <= h["mean_token_accuracy"] <= 1 and h["entropy"] > 0 for h in train_logs)
    assert train_logs[-1]["num_tokens"] == train_logs[-1]["tokens_seen"] > train_logs[0]["num_tokens"]
    evaluation = next(h for h in history if "eval_loss" in h)
    assert 0 <= evaluation["eval_mean_token_accuracy"] <= 1 and evaluation["eval_entropy"] > 0
    # A random byte-level model's predictions are spread over the vocabulary: about log(256) nats.
    assert 3.0 < train_logs[0]["entropy"] < 5.6
    dft_losses = [h["loss"] for h in dft[0][1] if "loss" in h]
    assert dft_losses != [h["loss"] for h in train_logs] and all(loss < 0.1 for loss in dft_losses)
