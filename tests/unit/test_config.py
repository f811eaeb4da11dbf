"""NoLoCoConfig refuses bad values itself, for Python users too (not only through the command line)."""

import pytest

from hf_noloco.config import NoLoCoConfig, check_config
from hf_noloco.engine.shape import routing_group_size


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
        ({"routing_domain": "rack"}, "routing_domain must be one of global, node, got 'rack'"),
        ({"routing_group_size": 2}, r"routing_group_size=2 only applies to routing_domain='node'"),
        (
            {"outer_optimizer": "local", "routing_domain": "node", "routing_group_size": 0},
            "routing_group_size must be a positive integer",
        ),
        ({"outer_optimizer": "local", "outer_overlap_steps": 1}, "needs an outer step to overlap"),
        ({"capacity_routing": True, "routing": "fixed"}, "capacity_routing needs routing='sample' or 'step'"),
        ({"capacity_rebalance_steps": 0}, "capacity_rebalance_steps must be a positive integer"),
        ({"capacity_floor": 1.5}, r"capacity_floor must be in \[0, 1\), got 1.5"),
        ({"boundary_dtype": "int3"}, "boundary_dtype must be one of float32, bfloat16, .*, got 'int3'"),
        ({"boundary_grad_dtype": "float16"}, "boundary_grad_dtype must be one of .*, got 'float16'"),
        ({"boundary_block_size": 0, "boundary_dtype": "int8"}, "boundary_block_size must be a positive"),
        ({"boundary_block_size": 64}, "boundary_block_size=64 sets the scale groups of a scaled boundary"),
        ({"boundary_grad_stochastic_rounding": True}, "rounds a scaled gradient format.*got None"),
        (
            {
                "boundary_dtype": "int4",
                "boundary_grad_dtype": "bfloat16",
                "boundary_grad_stochastic_rounding": True,
            },
            "set boundary_grad_dtype to one of float8_e4m3, float8_e5m2, int8, int4 \\(got 'bfloat16'\\)",
        ),
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


# A value each unhonoured option may be given, other than the one the trainer honours.
_OTHER_VALUES = {
    "use_liger_kernel": True,
    "liger_kernel_config": {"rope": True},
    "neftune_noise_alpha": 5.0,
    "label_smoothing_factor": 0.1,
    "bf16_full_eval": True,
    "fp16_full_eval": True,
    "auto_find_batch_size": True,
    "include_num_input_tokens_seen": "all",
    "save_only_model": True,
    "save_on_each_node": True,
    "eval_accumulation_steps": 2,
    "eval_use_gather_object": True,
    "eval_do_concat_batches": False,
    "batch_eval_metrics": True,
    "include_for_metrics": ["inputs"],
    "label_names": ["labels"],
    "train_sampling_strategy": "sequential",
    "length_column_name": "n_tokens",
    "ddp_find_unused_parameters": True,
    "ddp_bucket_cap_mb": 25,
    "ddp_broadcast_buffers": True,
    "ddp_static_graph": True,
    "fsdp": "full_shard",
    "fsdp_config": {"min_num_params": 1},
    "deepspeed": "ds_config.json",
    "parallelism_config": "tp",
    "debug": "underflow_overflow",
    "use_cache": True,
    "do_predict": True,
}

# Every other TrainingArguments field, and what honours it: the Trainer's own loop, callbacks and
# integrations (which NoLoCoTrainer keeps), or NoLoCoTrainer itself. A field transformers adds later fails
# test_every_training_argument_is_honoured_or_refused until someone reads what it does.
HONOURED = {
    # the Trainer's loop, scheduler, optimizer factory, callbacks and logging
    "output_dir", "per_device_train_batch_size", "num_train_epochs", "max_steps", "learning_rate",
    "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "optim", "optim_args", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "optim_target_modules", "max_grad_norm", "logging_strategy",
    "logging_steps", "logging_first_step", "log_on_each_node", "logging_nan_inf_filter", "log_level",
    "log_level_replica", "disable_tqdm", "report_to", "run_name", "project", "trackio_space_id",
    "trackio_bucket_id", "trackio_static_space_id", "eval_strategy", "eval_steps", "eval_delay",
    "eval_on_start", "save_strategy", "save_steps", "save_total_limit", "ignore_data_skip",
    "restore_callback_states_from_checkpoint", "full_determinism", "seed", "skip_memory_metrics",
    "metric_for_best_model", "greater_is_better", "prediction_loss_only", "resume_from_checkpoint",
    # TrainingArguments/Accelerate set-up: devices, process group, precision flags
    "use_cpu", "local_rank", "ddp_backend", "ddp_timeout", "tf32", "accelerator_config",
    # NoLoCoTrainer: checked in config.py and honoured by the engine, the data loader or the export
    "per_device_eval_batch_size", "gradient_accumulation_steps", "average_tokens_across_devices", "bf16",
    "fp16", "activation_checkpointing", "activation_checkpointing_kwargs", "gradient_checkpointing",
    "gradient_checkpointing_kwargs", "torch_compile", "torch_compile_backend", "torch_compile_mode",
    "torch_empty_cache_steps", "data_seed", "dataloader_drop_last", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "dataloader_multiprocessing_context", "dataloader_in_order", "remove_unused_columns", "push_to_hub",
    "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_revision", "load_best_model_at_end",
    "hub_always_push", "enable_jit_checkpoint",
    # script-level flags that the Trainer itself never reads (transformers documents them so)
    "do_train", "do_eval",
}  # fmt: skip


def test_every_training_argument_is_honoured_or_refused():
    import dataclasses

    from transformers import TrainingArguments

    from hf_noloco.config import UNHONOURED

    fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    assert set(UNHONOURED) == set(_OTHER_VALUES)
    assert fields - HONOURED - set(UNHONOURED) == set()
    assert not HONOURED & set(UNHONOURED)


@pytest.mark.parametrize("name", sorted(_OTHER_VALUES))
def test_an_option_the_trainer_would_ignore_is_refused_naming_it(tmp_path, name):
    with pytest.raises(ValueError, match=rf"^{name}=.* is not supported by NoLoCoTrainer: "):
        NoLoCoConfig(
            output_dir=str(tmp_path), report_to="none", outer_optimizer="local", **{name: _OTHER_VALUES[name]}
        )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"hub_strategy": "sometimes"},
            "hub_strategy must be one of end, every_save, checkpoint, all_checkpoints",
        ),
        ({"accelerator_config": {"dispatch_batches": True}}, "accelerator_config dispatch_batches=True"),
        ({"model_init_kwargs": {"dtype": "float16"}}, "no loss scaling"),
        ({"model_init_kwargs": '{"revision": ""}'}, "model_revision must be"),
        ({"model_init_kwargs": {"trust_remote_code": "yes"}}, "trust_remote_code must be true or false"),
        ({"export_dtype": "int8"}, "export_dtype must be one of float32, bfloat16"),
        ({"loss_chunk_tokens": -3}, "loss_chunk_tokens must be a positive integer"),
        (
            {"activation_checkpointing": True, "activation_checkpointing_kwargs": '{"use_reentrant": true}'},
            "use_reentrant",
        ),
    ],
)
def test_memory_and_model_options_are_checked(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        NoLoCoConfig(output_dir=str(tmp_path), report_to="none", outer_optimizer="local", **overrides)


def test_model_options_are_read(tmp_path):
    config = NoLoCoConfig(
        output_dir=str(tmp_path),
        report_to="none",
        outer_optimizer="local",
        gradient_checkpointing=True,  # the older name of activation_checkpointing
        model_init_kwargs='{"dtype": "torch.bfloat16", "attn_implementation": "eager"}',
    )
    assert config.activation_checkpointing is True
    assert config.model_init_kwargs == {"dtype": "bfloat16", "attn_implementation": "eager"}
    assert config.loss_chunk_tokens == 1024 and config.hub_strategy == "end"


def test_outer_overlap_steps_reach_the_outer_settings(tmp_path):
    config = NoLoCoConfig(
        output_dir=str(tmp_path),
        report_to="none",
        outer_optimizer="diloco",
        inner_steps=10,
        outer_overlap_steps=5,
        max_steps=10,
    )
    assert config.outer_settings.outer_overlap_steps == 5
    with pytest.raises(ValueError, match=r"outer_overlap_steps \(tau\) must be in \[0, inner_steps=10\]"):
        NoLoCoConfig(
            output_dir=str(tmp_path),
            report_to="none",
            outer_optimizer="diloco",
            inner_steps=10,
            outer_overlap_steps=11,
        )


def test_routing_group_size_from_the_launch():
    # 2 nodes x 8 processes, pp = 2: 8 replicas, 4 of them (whole columns) on each node
    assert routing_group_size("node", None, 8, 2, procs_per_node=8) == 4
    assert routing_group_size("global", None, 8, 2, procs_per_node=8) == 8
    assert routing_group_size("node", 2, 8, 2, procs_per_node=8) == 2  # explicit wins
    assert routing_group_size("node", None, 4, 2, procs_per_node=8) == 4  # one node: the same as global
    assert routing_group_size("node", None, 2, 2, procs_per_node=2) == 1  # one column per node: fixed
    with pytest.raises(ValueError, match="pipeline_stages=4 does not divide the 6 processes per node"):
        routing_group_size("node", None, 3, 4, procs_per_node=6)
    with pytest.raises(ValueError, match="routing_group_size=3 does not divide the 8 replicas"):
        routing_group_size("node", 3, 8, 2, procs_per_node=8)


def test_node_routing_is_checked_against_the_launch(tmp_path, monkeypatch):
    """check_config runs before the process group is joined, on every rank, with the launch's environment."""
    config = NoLoCoConfig(
        output_dir=str(tmp_path), report_to="none", outer_optimizer="local", routing_domain="node"
    )
    assert config.routing_group_size == 1  # resolved once, in __post_init__
    # The launch-derived group size is resolved at construction: cleared to check another launch.
    config.outer_optimizer, config.pipeline_stages, config.routing_group_size = "noloco", 4, None
    monkeypatch.setenv("WORLD_SIZE", "12")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="pipeline_stages=4 does not divide the 6 processes per node"):
        check_config(config)
    config.pipeline_stages = 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_config(config)
    assert routing_group_size("node", None, 6, 2) == 2  # what __post_init__ resolves on this launch


def test_more_processes_than_gpus_on_a_machine_is_refused_before_any_device_is_touched(tmp_path, monkeypatch):
    """The 4-process CPU launch config on a machine with 2 GPUs: ranks 2 and 3 would have no device."""
    import torch

    config = NoLoCoConfig(output_dir=str(tmp_path), report_to="none", outer_optimizer="local")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    config.use_cpu = False
    with pytest.raises(
        ValueError, match="4 processes on this machine but 2 GPUs: launch at most 2 per machine"
    ):
        check_config(config)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_config(config)  # one GPU per process
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    config.use_cpu = True  # what the message proposes
    check_config(config)


def test_boundary_options_reach_the_config_and_a_bad_block_size_fails_at_the_engine(tmp_path):
    """The four boundary options are fields (default: today's wire); a block size the hidden size refuses
    fails where the model is known, in one line naming both (the same rule the engine calls)."""
    from hf_noloco.engine.boundary_codec import packet_layout

    config = NoLoCoConfig(
        output_dir=str(tmp_path),
        report_to="none",
        outer_optimizer="local",
        boundary_dtype="int4",
        boundary_grad_dtype="float8_e5m2",
        boundary_block_size=64,
        boundary_grad_stochastic_rounding=True,
    )
    assert (config.boundary_dtype, config.boundary_grad_dtype) == ("int4", "float8_e5m2")
    assert config.boundary_block_size == 64 and config.boundary_grad_stochastic_rounding
    default = NoLoCoConfig(output_dir=str(tmp_path), report_to="none", outer_optimizer="local")
    assert default.boundary_dtype is None and default.boundary_grad_dtype is None
    with pytest.raises(ValueError, match="block_size 64 does not divide hidden size 96"):
        packet_layout("int4", 96, 64)
