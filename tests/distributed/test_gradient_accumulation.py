"""gradient_accumulation_steps with its Trainer meaning: one optimizer step per per_device_train_batch_size x
gradient_accumulation_steps rows, run as one pipeline step. With one replica the accumulated batch is the
larger batch's rows in the same order, so accumulation 4 of batch 2 trains exactly as batch 8."""

import pytest
import torch

from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.runs import byte_config, byte_corpus, make_args


def _train(out, stages, batch, accumulation):
    from hf_noloco.trainer import NoLoCoTrainer

    args = make_args(
        out,
        pipeline_stages=stages,
        outer_optimizer="local",
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        microbatch_size=2,
        max_steps=4,
        logging_steps=1,
        eval_strategy="no",
    )
    trainer = NoLoCoTrainer(byte_config(layers=2), args, train_dataset=byte_corpus(64))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    record = trainer.parts.record.settings()
    trainer.end()
    return losses, weights, record, trainer.get_total_train_batch_size(args)


@pytest.mark.parametrize("stages", [1, 2])
def test_accumulating_four_batches_of_two_trains_as_one_batch_of_eight(tmp_path, stages):
    big = run_distributed(_train, stages, str(tmp_path / "big"), stages, 8, 1, timeout_s=120)
    accumulated = run_distributed(_train, stages, str(tmp_path / "acc"), stages, 2, 4, timeout_s=120)
    for (losses, weights, _, _), (acc_losses, acc_weights, record, total) in zip(big, accumulated):
        assert len(acc_losses) == 4 and acc_losses == losses  # the logged loss of each optimizer step
        for name, value in weights.items():
            assert torch.equal(value, acc_weights[name]), name
        assert record["global_batch_size"] == 8 == total and record["gradient_accumulation_steps"] == 4
