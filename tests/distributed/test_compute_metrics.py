"""``compute_metrics`` and ``preprocess_logits_for_metrics`` as the Trainer takes them, on 2 stages x 2
replicas: an ``evaluate`` metric of the argmax predictions equals the same metric of transformers' own forward
of the exported model over the same rows; without a preprocess the metric sees every row's whole logits; a
``compute_metrics`` that raises is one error on every rank (none left waiting)."""

import os

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.runs import byte_config, byte_corpus, make_args

METRIC = os.path.join(ROOT, "tests", "helpers", "token_accuracy_metric.py")
EVAL_ROWS = 12


def _shifted(predictions: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Position t's prediction against label t + 1, where it is scored (the usual causal-LM metric)."""
    predictions, labels = predictions[:, :-1], labels[:, 1:]
    scored = labels != -100
    return predictions[scored], labels[scored]


def _evaluate(out):
    import evaluate

    from hf_noloco.trainer import NoLoCoTrainer

    accuracy = evaluate.load(METRIC)

    def token_accuracy(prediction):
        predictions, labels = _shifted(prediction.predictions, prediction.label_ids)
        return accuracy.compute(predictions=predictions, references=labels)

    def logit_totals(prediction):
        logits = prediction.predictions
        return {
            "rows": logits.shape[0],
            "positions": logits.shape[1],
            "vocabulary": logits.shape[2],
            "logit_sum": float(logits.astype(np.float64).sum()),
        }

    def broken(prediction):
        raise ValueError("a metric that fails")

    args = make_args(out, outer_optimizer="ddp", max_steps=3, eval_strategy="no", logging_steps=3)
    trainer = NoLoCoTrainer(
        byte_config(layers=2),
        args,
        train_dataset=byte_corpus(64),
        eval_dataset=byte_corpus(EVAL_ROWS, 300),
        compute_metrics=token_accuracy,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(dim=-1),
    )
    trainer.train()
    with_preprocess = trainer.evaluate()
    trainer.compute_metrics, trainer.preprocess_logits_for_metrics = logit_totals, None
    whole_logits = trainer.evaluate(metric_key_prefix="test")
    trainer.compute_metrics = broken
    try:
        trainer.evaluate()
        failure = None
    except RuntimeError as exc:
        failure = str(exc)
    logged = [h for h in trainer.state.log_history if "eval_accuracy" in h]
    trainer.save_model(os.path.join(out, "export"))
    trainer.end()
    return with_preprocess, whole_logits, failure, logged


def test_compute_metrics_sees_what_the_unsplit_model_predicts(tmp_path):
    results = run_distributed(_evaluate, 4, str(tmp_path), timeout_s=300)
    with_preprocess, whole_logits, failure, logged = results[0]

    def timeless(metrics):
        return {k: v for k, v in metrics.items() if not k.endswith("_runtime")}

    for other in results[1:]:  # every rank returns the same metrics, and every rank raised the failure
        assert timeless(other[0]) == timeless(with_preprocess) and timeless(other[1]) == timeless(
            whole_logits
        )
        assert other[2] and "a metric that fails" in other[2]
    assert failure and "compute_metrics failed on rank 1 (stage 1, replica 0)" in failure
    assert logged and logged[0]["eval_accuracy"] == with_preprocess["eval_accuracy"]

    # The reference: transformers' forward of the export (data parallel keeps the replicas equal) over the
    # same rows, each replica's shard together.
    model = LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    rows = torch.tensor(byte_corpus(EVAL_ROWS, 300)["input_ids"])
    with torch.no_grad():
        logits = model(rows).logits
    predictions, labels = _shifted(logits.argmax(-1).numpy(), rows.numpy())
    reference = float((predictions == labels).mean())
    assert 0.0 < reference < 1.0
    assert with_preprocess["eval_accuracy"] == pytest.approx(reference, abs=1.5 / labels.size)
    assert with_preprocess["eval_loss"] > 0 and "eval_perplexity" in with_preprocess
    assert (whole_logits["test_rows"], whole_logits["test_positions"]) == tuple(rows.shape)
    assert whole_logits["test_vocabulary"] == model.config.vocab_size
    assert whole_logits["test_logit_sum"] == pytest.approx(float(logits.double().sum()), rel=1e-4, abs=1e-2)
