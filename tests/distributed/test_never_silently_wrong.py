"""What must never be silently wrong, on real gloo processes: a refused model stops every rank before
training, tied weights held by one stage checkpoint and resume bit for bit and export tied, DiLoCo's tied
copies stay identical even when the two stages' all-reduces sum in different orders, a batch is
per_device_train_batch_size rows however the process was started, and bf16 weights train through float32
masters."""

import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig

from hf_noloco.engine.comm import exchange, wait_sends
from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.runs import byte_config, byte_corpus, make_args


def _refused(out):
    from hf_noloco.trainer import NoLoCoTrainer

    config = AutoConfig.for_model(
        "mixtral", vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, output_router_logits=True,
    )  # fmt: skip
    try:
        NoLoCoTrainer(config, make_args(out, outer_optimizer="local"), train_dataset=byte_corpus(64))
    except ValueError as exc:
        return str(exc)
    return None


def test_a_model_the_stages_do_not_reproduce_is_refused_on_every_rank_before_training(tmp_path):
    errors = run_distributed(_refused, 2, str(tmp_path), timeout_s=120)
    assert errors[0] == errors[1] and errors[0].startswith("mixtral: output_router_logits is not reproduced")
    assert "verify_split=False" in errors[0]
    assert not os.path.exists(tmp_path / "checkpoint-1")


def _tied_one_stage(out):
    from hf_noloco.trainer import NoLoCoTrainer

    args = dict(pipeline_stages=1, max_steps=8, eval_strategy="no", save_strategy="steps", save_steps=4)
    args.update(inner_steps=3, logging_steps=1)
    runs = []
    for resume in (None, os.path.join(out, "checkpoint-4")):
        trainer = NoLoCoTrainer(
            byte_config(tied=True), make_args(out, **args), train_dataset=byte_corpus(128)
        )
        assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight
        trainer.train(resume_from_checkpoint=resume)
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        runs.append((losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}))
        assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight  # still one tensor
    trainer.save_model(os.path.join(out, "export"))
    trainer.end()
    return runs


def test_tied_weights_in_one_stage_checkpoint_resume_exactly_and_export_tied(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    for (losses, weights), (resumed_losses, resumed_weights) in run_distributed(
        _tied_one_stage, 2, str(tmp_path), timeout_s=180
    ):
        assert all(resumed_losses[s] == losses[s] for s in range(1, 9))
        for name in weights:
            assert torch.equal(weights[name], resumed_weights[name]), name
    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) >= {"model.embed_tokens.weight"} and "lm_head.weight" not in set(f.keys())
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert (
        exported.config.tie_word_embeddings and exported.lm_head.weight is exported.model.embed_tokens.weight
    )


def _diloco_tied_with_skewed_sums(out, share):
    from hf_noloco.outer import diloco as outer_module
    from hf_noloco.trainer import NoLoCoTrainer

    real = dist.all_reduce

    def skewed(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """Over a stage's 3 replicas, a sum whose rounding depends on the stage: the last stage's group sums
        in the other order, as two NCCL communicators may (ring against tree)."""
        if group is None or dist.get_world_size(group) != 3:
            return real(tensor, op=op, group=group, async_op=async_op)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        order = parts if dist.get_rank() % 2 == 0 else parts[::-1]
        total = order[0].clone()
        for part in order[1:]:
            total += part
        tensor.copy_(total)
        return real(torch.zeros(1), group=group, async_op=True) if async_op else None

    outer_module.dist.all_reduce = skewed
    if not share:
        outer_module.DiLoCoAllReduce.after_update = lambda self: None
    args = make_args(out, outer_optimizer="diloco", inner_steps=2, max_steps=6, eval_strategy="no")
    trainer = NoLoCoTrainer(byte_config(tied=True), args, train_dataset=byte_corpus(256))
    trainer.train()
    copy = trainer.parts.tied.weight.detach().clone()
    theirs = torch.empty_like(copy)
    wait_sends(exchange([(copy, trainer.parts.tied.peer)], [(theirs, trainer.parts.tied.peer)], 60.0), 60.0)
    outer_module.dist.all_reduce = real
    trainer.end()
    return torch.equal(copy, theirs)


@pytest.mark.parametrize("share", [True, False], ids=["shared-by-the-first-stage", "without-sharing"])
def test_diloco_tied_copies_stay_identical_when_the_groups_sum_differently(tmp_path, share):
    """dp 3 x pp 2: 3 terms per sum, so the order matters in float32. Without the sharing the copies drift."""
    same = run_distributed(_diloco_tied_with_skewed_sums, 6, str(tmp_path), share, timeout_s=240)
    assert all(same) if share else not all(same)


def _rows_per_batch(out):
    from hf_noloco.trainer import NoLoCoTrainer

    args = make_args(out, pipeline_stages=1, outer_optimizer="local", max_steps=1, eval_strategy="no")
    args._n_gpu = 2  # a plain `python` launch on a machine with 2 GPUs
    trainer = NoLoCoTrainer(byte_config(), args, train_dataset=byte_corpus(64), eval_dataset=byte_corpus(64))
    train = next(iter(trainer.get_train_dataloader()))["input_ids"].shape[0]
    evaluation = next(iter(trainer.get_eval_dataloader()))["input_ids"].shape[0]
    trainer.end()
    return train, evaluation, args.per_device_train_batch_size, trainer._train_batch_size


def test_a_batch_is_per_device_train_batch_size_rows_however_the_process_was_started(tmp_path):
    [(train, evaluation, per_device, trainers_own)] = run_distributed(_rows_per_batch, 1, str(tmp_path))
    assert train == evaluation == per_device == 8 and trainers_own == 16  # the Trainer's would be twice


def _bf16_masters(out):
    from hf_noloco.trainer import NoLoCoTrainer

    bf16 = dict(model_init_kwargs={"dtype": "bfloat16"}, outer_optimizer="local", eval_strategy="no")
    args = make_args(out, max_steps=2, **bf16)
    trainer = NoLoCoTrainer(byte_config(), args, train_dataset=byte_corpus(64))
    trainer.train()
    dtypes = {p.dtype for p in trainer.model.parameters()}
    pure = NoLoCoTrainer(byte_config(), make_args(out, master_weights="none", **bf16))
    found = (dtypes, args.bf16, {p.dtype for p in pure.model.parameters()}, pure.args.bf16)
    pure.end()
    return found


def test_bf16_weights_train_through_float32_masters_unless_pure_bf16_is_asked(tmp_path):
    for masters, autocast, pure, pure_autocast in run_distributed(
        _bf16_masters, 2, str(tmp_path), timeout_s=120
    ):
        assert masters == {torch.float32} and autocast  # float32 masters, bf16 compute
        assert pure == {torch.bfloat16} and not pure_autocast
