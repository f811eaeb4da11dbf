"""NoLoCoTrainer end to end on real gloo processes: learning, wandb, export, push, resume, fine-tuning."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from hf_noloco.data.arguments import DataArguments
from hf_noloco.engine.partition import split_model
from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.fake_hub import FakeHub
from tests.helpers.paths import ROOT
from tests.helpers.runs import BLOCK, byte_config, byte_corpus, make_args
from tests.helpers.tiny_models import tiny_model
from tests.helpers.wandb_records import history_rows, metric_summaries, run_config


def _train_wandb_export_push(out, endpoint):
    import huggingface_hub.constants

    from hf_noloco.trainer import NoLoCoTrainer

    huggingface_hub.constants.ENDPOINT = endpoint
    args = make_args(
        out,
        report_to="wandb",
        eval_on_start=True,
        divergence_steps=10,
        push_to_hub=True,
        inner_steps=3,
        hub_model_id="fake-user/tiny-noloco",
        hub_token="hf_fake_token_123",
        hub_strategy="checkpoint",  # each save: the export and last-checkpoint/, as the Trainer pushes them
        hub_always_push=True,  # each save pushed: the order of the commits below is fixed
        save_strategy="steps",
        save_steps=20,
    )
    trainer = NoLoCoTrainer(
        byte_config(),
        args,
        train_dataset=byte_corpus(256),
        eval_dataset=byte_corpus(32, 300),
        data_args=DataArguments(dataset_name="pydoc-topics", max_length=BLOCK),
    )
    trainer.train()
    trainer.evaluate()
    final = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    url = trainer.push_to_hub()
    history = trainer.state.log_history
    trainer.end()
    return final, history, url


def test_noloco_run_learns_logs_exports_and_pushes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    out = tmp_path / "run"
    with FakeHub() as hub:
        results = run_distributed(_train_wandb_export_push, 4, str(out), hub.endpoint, timeout_s=180)
    finals = [r[0] for r in results]
    history, url = results[0][1], results[0][2]

    # Learning: pooled eval perplexity falls well below its value at step 0.
    evals = [h["eval_perplexity"] for h in history if "eval_perplexity" in h]
    assert evals[-1] < 0.5 * evals[0], evals
    # NoLoCo metrics reached the logs and the offline wandb run.
    assert any("replica_divergence" in h for h in history if "loss" in h)
    assert any("replica_divergence_estimate" in h for h in history)
    rows = history_rows(str(tmp_path / "wandb-home"))
    keys = set().union(*rows)
    assert {"eval/perplexity", "train/replica_divergence", "train/loss"} <= keys
    assert any(r.get("train/replica_divergence", 0) > 0 for r in rows)  # replicas do differ between syncs
    config = run_config(str(tmp_path / "wandb-home"))
    noloco = config["noloco"]
    assert (noloco["num_replicas"], noloco["pipeline_stages"], noloco["routing"]) == (2, 2, "sample")
    assert (noloco["inner_steps"], noloco["outer_lr"], noloco["outer_momentum"]) == (3, 0.7, 0.5)
    assert config["data"]["dataset_name"] == "pydoc-topics" and config["data"]["max_length"] == BLOCK
    assert (
        noloco["optimizer"] == "adamw_torch_fused" and config["num_hidden_layers"] == 4
    )  # the model config (the Trainer's own callback)
    summaries = metric_summaries(str(tmp_path / "wandb-home"))
    assert "min" in summaries["eval/perplexity"] and "last" in summaries["train/replica_divergence*"]

    # Export: one ordinary checkpoint whose weights are the mean of each stage's replicas (rank = replica*2 +
    # stage).
    model = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        stage = 0 if name in finals[0] else 1
        mean = (finals[stage][name] + finals[2 + stage][name]) / 2
        torch.testing.assert_close(tensor, mean, rtol=0, atol=1e-6, msg=name)
    # Its logits equal the consensus stages composed by hand.
    ids = torch.tensor([list(b"The quick brown fox jumps over the lazy dog.")])
    hidden = ids
    for s in range(2):
        hidden = split_model(model, s, 2)(hidden)
    torch.testing.assert_close(model(ids).logits, hidden, rtol=0, atol=1e-6)

    card = (out / "README.md").read_text()
    assert "trained from scratch" in card.lower() and "noloco" in card and "pydoc-topics" in card
    [card_ppl] = re.findall(r"Final evaluation perplexity \| ([0-9.]+)", card)
    assert float(card_ppl) == pytest.approx(evals[-1], rel=1e-3)
    assert "](training_curves.png)" in card  # linked relative to the repo root
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The token was checked and the repository made before training; each save pushed its export and then
    # its checkpoint (every file, to resume elsewhere); the end pushed the final export.
    commits = [i for i, path in enumerate(hub.paths) if path.endswith("/commit/main")]
    assert hub.paths.index("/api/whoami-v2") < hub.paths.index("/api/repos/create") < commits[0]
    *saves, commit = hub.commits
    assert [c["header"]["summary"] for c in saves] == [
        "Training in progress, step 20",
        "Training in progress, step 20, checkpoint",
        "Training in progress, step 40",
        "Training in progress, step 40, checkpoint",
    ]
    for export in saves[0::2]:
        assert {"README.md", "config.json", "model.safetensors"} <= set(export["files"])
        assert not any(name.startswith("checkpoint-") or name.endswith(".bin") for name in export["files"])
    folder = out / "checkpoint-40"
    expected = {f"last-checkpoint/{p.relative_to(folder)}" for p in folder.rglob("*") if p.is_file()}
    assert set(saves[3]["files"]) == expected and len(expected) > 10
    weights = "last-checkpoint/stage-1-replica-1/model.safetensors"
    assert (
        saves[3]["files"][weights]
        == (out / "checkpoint-40" / "stage-1-replica-1/model.safetensors").read_bytes()
    )
    assert commit["repo_id"] == "fake-user/tiny-noloco" and url.startswith(hub.endpoint)
    assert commit["header"]["summary"] == "End of training"
    assert {"README.md", "config.json", "model.safetensors", "training_curves.png"} <= set(commit["files"])


def _hub_refusals(out, endpoint):
    import huggingface_hub.constants

    from hf_noloco.trainer import NoLoCoTrainer

    huggingface_hub.constants.ENDPOINT = endpoint
    errors = {}
    for token in ("hf_unknown_token_456", "hf_read_token_789"):
        hub = dict(push_to_hub=True, hub_model_id="fake-user/tiny", hub_token=token)
        args = make_args(out, pipeline_stages=1, eval_strategy="no", **hub)
        try:
            NoLoCoTrainer(byte_config(), args, train_dataset=byte_corpus(64))
        except ValueError as exc:
            errors[token] = str(exc)
    return errors


def test_a_refused_token_stops_every_rank_before_training(tmp_path, monkeypatch):
    """The Hub's verdict on the token, asked by one rank, is every rank's error, before any step."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with FakeHub(token_roles={"hf_read_token_789": "read"}) as hub:
        results = run_distributed(_hub_refusals, 2, str(tmp_path), hub.endpoint, timeout_s=120)
    for errors in results:
        assert "refused by the Hub (HTTP 401)" in errors["hf_unknown_token_456"]
        assert "read-only" in errors["hf_read_token_789"]
        assert not any("hf_" in message.replace("hf_noloco", "") for message in errors.values())
    assert not hub.repos  # no repository was created for a token that cannot write
    assert hub.paths.count("/api/whoami-v2") == 2  # one rank asked, once per attempt


def _straight_then_resumed(out, tied):
    from hf_noloco.trainer import NoLoCoTrainer

    data = byte_corpus(256)
    runs = []
    for resume in (None, os.path.join(out, "checkpoint-6")):
        args = make_args(
            out,
            max_steps=12,
            logging_steps=1,
            eval_strategy="no",
            save_strategy="steps",
            save_steps=6,
            inner_steps=4,
            outer_optimizer="noloco",
            routing="sample",
            lr_scheduler_type="cosine",
            warmup_steps=2,
            stage_balance="compute",
        )
        # A 1024-word lm_head weighs 2.4 layers: the compute-balanced split is 3/1, not 2/2.
        trainer = NoLoCoTrainer(byte_config(vocab_size=1024, tied=tied), args, train_dataset=data)
        assert trainer.model.all_layer_ranges == [(0, 3), (3, 4)]
        trainer.train(resume_from_checkpoint=resume)
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        runs.append(
            (
                losses,
                {k: v.clone() for k, v in trainer.model.state_dict().items()},
                trainer.outer.outer_step_count,
            )
        )
    # Another split resumes (tests/distributed/test_mesh_change.py); another outer optimizer does not.
    args = make_args(out, max_steps=12, inner_steps=4, eval_strategy="no", outer_optimizer="diloco")
    with pytest.raises(ValueError, match=r"saved with outer_optimizer=noloco, this run has diloco"):
        NoLoCoTrainer(byte_config(vocab_size=1024, tied=tied), args, train_dataset=data).train(
            resume_from_checkpoint=os.path.join(out, "checkpoint-6")
        )
    trainer.end()
    return runs


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_resume_continues_exactly(tmp_path, tied):
    runs = run_distributed(_straight_then_resumed, 4, str(tmp_path / "run"), tied, timeout_s=180)
    for straight, resumed in runs:
        losses, weights, outer_steps = straight
        resumed_losses, resumed_weights, resumed_outer_steps = resumed
        assert outer_steps == resumed_outer_steps == 3  # outer steps at 4, 8 and 12 straddle the resume
        assert sorted(resumed_losses) == list(range(1, 13))  # steps 1-6 come back with the trainer state
        assert all(resumed_losses[s] == losses[s] for s in range(1, 13))
        for name in weights:
            assert torch.equal(weights[name], resumed_weights[name]), name
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-12", "checkpoint-6"]


def _requeued(out):
    """The same call twice with resume_from_checkpoint="auto", as a requeued job makes it: the first starts
    in an empty output_dir, the second resumes its newest checkpoint."""
    from transformers import TrainerCallback

    from hf_noloco.trainer import NoLoCoTrainer

    class Steps(TrainerCallback):
        def __init__(self):
            self.trained = []

        def on_step_end(self, args, state, control, **kwargs):
            self.trained.append(state.global_step)

    runs = []
    for max_steps in (4, 6):
        args = make_args(
            out,
            max_steps=max_steps,
            logging_steps=1,
            eval_strategy="no",
            save_strategy="steps",
            save_steps=2,
            outer_optimizer="local",
        )
        steps = Steps()
        trainer = NoLoCoTrainer(byte_config(), args, train_dataset=byte_corpus(64), callbacks=[steps])
        trainer.train(resume_from_checkpoint="auto")
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        runs.append((steps.trained, losses))
    trainer.end()
    return runs


def test_resume_auto_starts_a_fresh_run_and_resumes_a_requeued_one(tmp_path):
    for (first_steps, first), (second_steps, second) in run_distributed(
        _requeued, 2, str(tmp_path / "run"), timeout_s=120
    ):
        assert first_steps == [1, 2, 3, 4] and second_steps == [5, 6]  # only the steps not yet trained
        assert all(second[s] == first[s] for s in range(1, 5)) and sorted(second) == list(range(1, 7))
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def _offloaded_outer_state(out):
    from hf_noloco.outer.optimizer import OuterOptimizer
    from hf_noloco.trainer import NoLoCoTrainer

    round_trips = []
    state_dict = OuterOptimizer.state_dict
    OuterOptimizer.state_dict = lambda self: round_trips.append(1) or state_dict(self)

    def placement(trainer):
        return {
            (t.device.type, t.is_pinned())
            for t in trainer.outer.outer_state.phi_flat + trainer.outer.outer_state.delta_flat
        }

    args = dict(
        pipeline_stages=1,
        offload_outer_state=True,
        max_steps=2,
        eval_strategy="no",
        inner_steps=1,
        save_strategy="steps",
        save_steps=2,
    )
    trainer = NoLoCoTrainer(byte_config(), make_args(out, **args), train_dataset=byte_corpus(64))
    trainer.create_optimizer()
    trainer.accelerator.prepare(trainer.optimizer)  # as the Trainer prepares it when training starts
    found = {"created": placement(trainer), "round_trips_at_prepare": len(round_trips)}
    trainer.train()
    resumed = NoLoCoTrainer(
        byte_config(), make_args(out, **{**args, "max_steps": 3}), train_dataset=byte_corpus(64)
    )
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    found["resumed"] = placement(resumed)
    resumed.end()
    return found


def test_offloaded_outer_state_stays_on_the_cpu_pinned(tmp_path):
    """offload_outer_state keeps phi and delta in CPU memory (pinned when a GPU is there to copy them to):
    Accelerate's prepared optimizer must not round-trip them through the accelerator, nor must a resume."""
    for found in run_distributed(_offloaded_outer_state, 2, str(tmp_path), timeout_s=120):
        where = {("cpu", torch.cuda.is_available())}
        assert found["created"] == where and found["resumed"] == where
        assert found["round_trips_at_prepare"] == 0


def _finetune(path, eval_rows):
    from hf_noloco.trainer import NoLoCoTrainer

    eval_set = Dataset.from_dict({"input_ids": eval_rows, "labels": eval_rows})
    args = make_args(
        os.path.join(path, "out"),
        max_steps=10,
        eval_strategy="no",
        learning_rate=1e-2,
        outer_optimizer="diloco",
    )
    rows = [[(i * 7 + j) % 96 for j in range(BLOCK)] for i in range(64)]
    trainer = NoLoCoTrainer(
        path,
        args,
        train_dataset=Dataset.from_dict({"input_ids": rows, "labels": rows}),
        eval_dataset=eval_set,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate(Dataset.from_dict({"input_ids": rows[:16], "labels": rows[:16]}))["eval_loss"]
    trainer.end()
    return before, after


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_finetuning_starts_from_the_checkpoint(tmp_path, family):
    model = tiny_model(family, layers=4, seed=9)
    model.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    eval_rows = torch.randint(0, 96, (16, BLOCK), generator=g)
    with torch.no_grad():
        reference = model(input_ids=eval_rows, labels=eval_rows).loss.item()  # every row has BLOCK-1 targets
    results = run_distributed(_finetune, 4, str(tmp_path), eval_rows.tolist(), timeout_s=180)
    for before, after in results:
        assert before == pytest.approx(reference, rel=1e-5)
        assert after < 0.8 * reference  # and it trains from there (the rows are a learnable pattern)


def _bad_trainer_inputs(folder):
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_noloco.trainer import NoLoCoTrainer

    errors = {}
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        os.path.join(folder, "gpt2")
    )
    attempts = {
        "not_llama": lambda: NoLoCoTrainer(
            os.path.join(folder, "gpt2"), make_args(folder, pipeline_stages=1, outer_optimizer="local")
        ),
        "too_small": lambda: NoLoCoTrainer(
            byte_config(),
            make_args(folder, pipeline_stages=1, outer_optimizer="local", eval_strategy="no"),
            train_dataset=byte_corpus(5),
        ),
        "push_without_repo": lambda: NoLoCoTrainer(
            byte_config(),
            make_args(
                folder,
                pipeline_stages=1,
                outer_optimizer="local",
                push_to_hub=True,
                hub_token="hf_x",
                eval_strategy="no",
            ),
        ),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except ValueError as exc:
            errors[name] = str(exc)
    os.makedirs(os.path.join(folder, "old", "checkpoint-3"))
    trainer = NoLoCoTrainer(
        byte_config(),
        make_args(
            os.path.join(folder, "old"), pipeline_stages=1, outer_optimizer="local", eval_strategy="no"
        ),
        train_dataset=byte_corpus(16),
    )
    try:
        trainer.train()
    except ValueError as exc:
        errors["old_run"] = str(exc)
    # A checkpoint of a noloco run (on another mesh, which alone would be fine) cannot resume a local one.
    other = os.path.join(folder, "other", "checkpoint-4")
    os.makedirs(other)
    with open(os.path.join(other, "noloco_mesh.json"), "w") as f:
        json.dump(
            {
                "pipeline_stages": 2,
                "num_replicas": 2,
                "layer_ranges": [[0, 2], [2, 4]],
                "outer_optimizer": "noloco",
                "routing": "sample",
            },
            f,
        )
    try:
        trainer.train(resume_from_checkpoint=other)
    except ValueError as exc:
        errors["other_mesh"] = str(exc)
    return errors


def test_bad_trainer_inputs_fail_before_training(tmp_path):
    [errors] = run_distributed(_bad_trainer_inputs, 1, str(tmp_path), timeout_s=120)
    assert "not a Llama-family causal LM" in errors["not_llama"]
    assert "5 samples, fewer than one batch per replica" in errors["too_small"]
    assert "hub_model_id" in errors["push_without_repo"]
    assert "already holds checkpoints" in errors["old_run"]
    assert "saved with outer_optimizer=noloco, this run has local" in errors["other_mesh"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--no_such_option", "3"], "no_such_option"),
        (["--pipeline_stages", "3"], "not divisible by pipeline_stages=3"),
        (["--outer_optimizer", "gossip"], "invalid choice: 'gossip'"),
        (["--per_device_train_batch_size", "-2"], "per_device_train_batch_size must be a positive integer"),
        (["--inner_steps", "0"], "inner_steps"),
        (["--microbatch_size", "3"], "not a multiple of microbatch_size=3"),
    ],
)
def test_bad_recipe_overrides_are_refused(overrides, message, monkeypatch, capsys):
    from hf_noloco.launch.cli import parse_args

    monkeypatch.setenv("WORLD_SIZE", "4")  # as under a 4-process launch: errors must come before joining it
    with pytest.raises((ValueError, SystemExit)) as info:
        parse_args([os.path.join(ROOT, "recipes", "llama-tiny", "noloco.yaml"), *overrides])
    assert message in str(info.value) + capsys.readouterr().err


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    from hf_noloco.launch.cli import _tokenizer, parse_args

    tiny_model("llama", 2).save_pretrained(tmp_path)
    model_args, data_args, config = parse_args(
        [
            "--model_name_or_path",
            str(tmp_path),
            "--output_dir",
            str(tmp_path / "o"),
            "--outer_optimizer",
            "local",
        ]
    )
    with pytest.raises(ValueError, match="No tokenizer could be loaded"):
        _tokenizer(model_args, data_args, config)


def test_a_failing_rank_ends_the_whole_launch(tmp_path):
    """Launched as a user would: every rank fails before training, with the error shown; nothing hangs."""
    from pydoc_data.topics import topics

    corpus = tmp_path / "corpus.txt"  # a small local text: the check, not the built-in corpus, is tested
    corpus.write_text("\n\n".join(topics[k] for k in sorted(topics)[:12]))
    env = dict(
        os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_DATASETS_CACHE=str(tmp_path / "cache")
    )
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "recipes", "accelerate_configs", "cpu.yaml"),
        "--num_processes",
        "2",
        os.path.join(ROOT, "recipes", "train.py"),
        os.path.join(ROOT, "recipes", "llama-tiny", "noloco.yaml"),
        "--output_dir",
        str(tmp_path / "out"),
        "--dataset_name",
        str(corpus),
        "--tokenizer_vocab_size",
        "300",
        "--max_train_samples",
        "1",
        "--report_to",
        "none",
        "--pipeline_stages",
        "1",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    assert "fewer than one batch per replica" in proc.stdout + proc.stderr
