"""NoLoCoConfig refuses bad values itself, for Python users too (not only through the command line)."""

import pytest

from hf_noloco.config import NoLoCoConfig


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"learning_rate": -1e-3}, "learning_rate must be >= 0, got -0.001"),
        ({"adam_beta2": 1.0}, r"adam_beta2 must be in \[0, 1\), got 1.0"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*32\), got -1"),
        ({"max_steps": -1, "num_train_epochs": 0}, "Nothing to train: max_steps=-1 and num_train_epochs=0"),
        ({"logging_steps": -5}, "logging_steps must be positive"),
        ({"stage_balance": "flops"}, "stage_balance must be one of layers, compute, got 'flops'"),
        ({"pipeline_stages": 2, "stage_boundaries": [2], "stage_balance": "compute"}, "set only one"),
        ({"per_device_train_batch_size": 6, "microbatch_size": 4}, "not a multiple of microbatch_size=4"),
    ],
)
def test_bad_values_are_refused_naming_the_option(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        NoLoCoConfig(output_dir=str(tmp_path), report_to="none", **overrides)


def test_good_values_pass(tmp_path):
    config = NoLoCoConfig(
        output_dir=str(tmp_path),
        report_to="none",
        stage_balance="compute",
        learning_rate=0.0,
        max_steps=10,
        outer_optimizer="local",
    )  # one process: no partner to average with
    assert config.stage_balance == "compute" and config.stage_boundaries is None
