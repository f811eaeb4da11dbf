"""Each component of the trainer built from stand-in parts, in one process: a one-stage, one-replica mesh (no
process groups: nothing communicates), a real tiny stage and engine where a component computes with them, and
stand-ins for the replica-loss policy and the pipeline where the component only calls them."""

import math
import os

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import TrainerState

from hf_noloco.components.checkpointer import RunCheckpointer
from hf_noloco.components.evaluation import Evaluation, evaluation_metrics
from hf_noloco.components.exporter import Exporter
from hf_noloco.components.inputs import check_dataset_size, check_trainer_inputs
from hf_noloco.components.loaders import ReplicaLoaders
from hf_noloco.components.metrics import Throughput
from hf_noloco.components.run_parts import _autocast
from hf_noloco.components.run_record import RunRecord
from hf_noloco.components.run_state import RunState
from hf_noloco.components.training_logs import TrainingLogs
from hf_noloco.components.training_step import TrainingStep
from hf_noloco.config import NoLoCoConfig
from hf_noloco.engine.loading import BuiltStage, build_stage
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.pipeline import PipelineEngine, StepResult
from hf_noloco.engine.routing import Router
from hf_noloco.engine.tied import TiedEmbeddings
from hf_noloco.outer.optimizer import OuterOptimizer
from tests.helpers.tiny_models import make_batch, tiny_config


class Policy:
    """The replica-loss policy's surface, as "stop" answers it, with a switch that makes work fail as a lost
    replica would under "continue" (its fallback is returned)."""

    continues = False

    def __init__(self, interrupt: bool = False):
        self.interrupt, self.barriers = interrupt, 0

    @property
    def offline(self) -> bool:
        return False

    def tolerate(self, what, work, fallback, step):
        return fallback() if self.interrupt else work()

    def live_sum(self, tensor, what, step) -> int:
        return 1

    def barrier(self) -> None:
        self.barriers += 1

    checkpoint_barrier = None


@pytest.fixture
def args(tmp_path):
    return NoLoCoConfig(
        output_dir=str(tmp_path / "run"),
        outer_optimizer="local",
        per_device_train_batch_size=4,
        microbatch_size=2,
        report_to="none",
        max_steps=5,
    )


@pytest.fixture
def mesh():
    return PipelineMesh(0, 1, 1, 1, None, None, torch.device("cpu"))


def _parts(args, mesh, seed=0):
    stage = build_stage(tiny_config("llama", layers=2), 0, 1, seed=seed)
    engine = PipelineEngine(stage, mesh, Router(1, "fixed", 0), args.microbatch_size)
    run = RunState(trainer_state=TrainerState())
    inner = torch.optim.SGD(stage.parameters(), lr=0.1)
    run.optimizer = OuterOptimizer(inner, list(stage.parameters()), mesh, args.outer_settings)
    run.lr_scheduler = LambdaLR(run.optimizer, lambda step: 1.0)
    return stage, engine, run


def _checkpointer(args, mesh, stage, engine, run, written):
    tied = TiedEmbeddings(stage, mesh)
    loaders = ReplicaLoaders(mesh, args, None)
    throughput = Throughput(stage.config, True, None)
    decay = lambda module: [n for n, _ in module.named_parameters()]
    return RunCheckpointer(
        args, mesh, stage, engine, tied, loaders, throughput, run, None, written.append, decay
    )


def test_the_run_state_finds_the_outer_optimizer_inside_accelerates_wrapper(args, mesh):
    _, _, run = _parts(args, mesh)
    outer = run.optimizer

    class Wrapped:  # what Accelerate's AcceleratedOptimizer holds: the optimizer it wraps
        optimizer = outer

    run.optimizer = Wrapped()
    assert run.outer is outer
    assert RunState().outer is None and RunState().step == 0
    run.trainer_state.global_step = 7
    assert run.step == 7


def test_a_training_step_reports_the_column_norm_and_skips_or_refuses_non_finite_steps(args, mesh):
    stage, engine, run = _parts(args, mesh)
    tied = TiedEmbeddings(stage, mesh)
    step = TrainingStep(args, mesh, stage, engine, tied, run)
    batch = make_batch(rows=4, seq_len=8, seed=1)
    loss = step.run_step(batch, 1)
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    assert grads and torch.isfinite(loss)
    expected = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    assert step.column_grad_norm().item() == pytest.approx(expected.item(), rel=1e-5)
    # clip() scales every gradient by max_grad_norm / norm, the column's norm.
    reference = [g.clone() for g in grads]
    norm = step.clip()
    scale = min(1.0, args.max_grad_norm / (norm.item() + 1e-6))
    assert scale < 1.0  # a random model's first gradients are larger than max_grad_norm=1
    assert all(torch.allclose(g, r * scale) for g, r in zip(grads, reference))

    # A NaN in the loss: "error" refuses, naming the step and stage; "skip" drops the gradients.
    poisoned = lambda inputs: StepResult(loss=torch.tensor(float("nan")))
    engine.train_step = poisoned
    with pytest.raises(FloatingPointError, match="Step 2: a non-finite loss"):
        step.run_step(batch, 2)
    args.nonfinite = "skip"
    step.run_step(batch, 3)
    assert all(p.grad is None for p in stage.parameters())

    # A step a lost replica interrupted: the counters advance as if it had run, and it is counted.
    counters = step.counters()
    assert step.skip(counters, batch).item() == 0.0
    assert step.counters() == (counters[0] + 1, counters[1] + 4) and step.skipped_since_log == 1


def test_training_logs_compute_the_divergence_only_when_it_is_due(args, mesh):
    stage, _, run = _parts(args, mesh)
    args.divergence_steps = 3
    logs = TrainingLogs(
        args, mesh, stage, run, Throughput(None, counts=False), ReplicaLoaders(mesh, args, None), Policy()
    )
    run.trainer_state.global_step = 2
    assert "replica_divergence" not in logs.training_entries()
    run.trainer_state.global_step = 3
    entries = logs.training_entries()
    assert entries["replica_divergence"] == 0.0  # one replica: no distance to the mean
    assert "tokens_per_second" in entries and logs.last_divergence_step == 3
    assert "replica_divergence" not in logs.training_entries()  # not due again before step 6
    assert logs.stream_epoch() is None  # a dataset has an epoch of its own
    assert logs.training_loss(torch.tensor(6.0), window=3, skipped=1) == pytest.approx(3.0)


def test_an_evaluation_pools_the_loss_and_an_interrupted_one_returns_nothing(args, mesh):
    stage, _, run = _parts(args, mesh)

    class Engine:  # eval_totals' answer: cross-entropy, target tokens, right predictions, summed entropy
        def eval_totals(self, batch, on_logits=None):
            return torch.tensor(
                [batch["loss_sum"], batch["tokens"], batch["right"], 0.5], dtype=torch.float64
            )

    logs = TrainingLogs(
        args, mesh, stage, run, Throughput(None, counts=False), ReplicaLoaders(mesh, args, None), Policy()
    )
    batches = [{"loss_sum": 6.0, "tokens": 3, "right": 1}, {"loss_sum": 2.0, "tokens": 1, "right": 1}]
    seen, results = [], []
    evaluation = Evaluation(args, mesh, stage, Engine(), logs, Policy())
    metrics = evaluation.run(batches, "eval", lambda: seen.append(1), results.append)
    assert metrics["eval_loss"] == 2.0 and metrics["eval_perplexity"] == pytest.approx(math.exp(2.0))
    assert metrics["eval_tokens"] == 4 and "replica_divergence" in metrics  # divergence_steps unset
    assert metrics["eval_mean_token_accuracy"] == 0.5 and metrics["eval_entropy"] == 0.25
    assert len(seen) == 2 and results == [metrics] and stage.training
    assert (
        Evaluation(args, mesh, stage, Engine(), logs, Policy(interrupt=True)).run(batches, "eval", list, list)
        == {}
    )
    empty = evaluation_metrics("x", [0.0, 0, 0, 0.0], 1.0)  # no tokens: no division by zero, no accuracy
    assert empty["x_loss"] == 0.0 and "x_mean_token_accuracy" not in empty


def test_the_run_record_says_what_was_run_and_what_the_export_is(args, mesh):
    stage, engine, run = _parts(args, mesh)
    source = BuiltStage(stage, base_model="org/model")
    record = RunRecord(args, mesh, engine, stage, source, run, False, None, None, None)
    settings = record.settings()
    assert settings["outer_optimizer"] == "local" and settings["pipeline_stages"] == 1
    assert settings["layer_ranges"] == ["0-1"] and settings["global_batch_size"] == 4
    assert settings["weights_dtype"] == "float32" and settings["master_weights"] is None
    assert settings["inner_steps"] is None and settings["max_steps"] == 5
    assert record.export_kind == "model" and record.adapter_summary is None


def test_the_checkpointer_sends_a_joiner_what_resumes_it_exactly(args, mesh, tmp_path):
    donor_stage, donor_engine, donor_run = _parts(args, mesh, seed=1)
    donor_engine.step_index, donor_engine.samples_seen = 5, 40
    donor_run.trainer_state.global_step = 5
    written = []
    donor = _checkpointer(args, mesh, donor_stage, donor_engine, donor_run, written)
    state, step = donor.join_state()
    assert step == 5 and written == []  # random states stay each rank's own

    stage, engine, run = _parts(args, mesh, seed=2)
    joiner = _checkpointer(args, mesh, stage, engine, run, [])
    folder, step = joiner.write_join_state(state)
    assert step == 5 and os.path.isdir(folder)
    joiner.load_model_state(folder)
    joiner.load_optimizer_state(folder)
    for (name, theirs), mine in zip(donor_stage.state_dict().items(), stage.state_dict().values()):
        assert torch.equal(theirs, mine), name
    assert (engine.step_index, engine.samples_seen) == (5, 40)
    assert joiner.mesh_record() == donor.mesh_record()
    assert joiner.mesh_record()["model"]["num_hidden_layers"] == 2


def test_a_fresh_start_into_a_run_folder_with_checkpoints_is_refused(args, mesh):
    stage, engine, run = _parts(args, mesh)
    checkpointer = _checkpointer(args, mesh, stage, engine, run, [])
    assert checkpointer.resume_request(None, None) == (None, False, False)
    assert checkpointer.resume_folder(None, False, False, None) is None
    os.makedirs(os.path.join(args.output_dir, "checkpoint-3"))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        checkpointer.resume_request(None, None)
    assert checkpointer.resume_request("auto", None) == ("auto", True, True)
    assert checkpointer.resume_request(None, "joined") == (None, False, False)  # a joiner's copy wins


def test_the_exporter_writes_the_card_and_pushes_nothing_under_hub_strategy_end(args, mesh, tmp_path):
    stage, engine, run = _parts(args, mesh)
    run.trainer_state.log_history = [{"loss": 3.0, "step": 1}, {"eval_perplexity": 12.5, "step": 2}]
    source = BuiltStage(stage)
    record = RunRecord(args, mesh, engine, stage, source, run, False)
    throughput = Throughput(None, counts=False)
    exporter = Exporter(args, mesh, stage, source, None, Policy(), throughput, record, run)
    out = tmp_path / "card"
    out.mkdir()
    exporter.write_model_card(str(out))
    card = (out / "README.md").read_text()
    assert "12.5" in card and "local" in card
    exporter.push_checkpoint(str(tmp_path / "checkpoint-2"))  # "end": nothing to upload at a save
    assert exporter.push_in_progress is None


def test_the_trainer_refuses_what_it_cannot_honour_before_joining_anything(args, tmp_path):
    with pytest.raises(ValueError, match="model_init is not supported"):
        check_trainer_inputs("model", args, None, None, {"model_init": len})
    check_trainer_inputs("model", args, None, None, {"compute_metrics": len})  # taken: evaluate() runs it
    with pytest.raises(ValueError, match="fewer than one batch per replica"):
        check_dataset_size(list(range(3)), 4)
    check_dataset_size(list(range(4)), 4)


def test_autocast_follows_bf16(args):
    assert _autocast(args)() is not None and not torch.is_autocast_enabled("cpu")
    args.bf16 = True
    with _autocast(args)():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_a_failed_background_upload_is_raised_at_the_next_save_and_at_the_end(args, mesh, tmp_path):
    from concurrent.futures import Future

    from transformers.utils.hub import PushInProgress

    class Response:
        status_code = 403

    class HubError(OSError):
        response = Response()

    stage, engine, run = _parts(args, mesh)
    source = BuiltStage(stage)
    record = RunRecord(args, mesh, engine, stage, source, run, False)
    throughput = Throughput(None, counts=False)
    exporter = Exporter(args, mesh, stage, source, None, Policy(), throughput, record, run)
    args.push_to_hub, args.hub_strategy, exporter.repo_id = True, "every_save", "me/model"

    def failed():
        job = Future()
        job.set_exception(HubError("403 Forbidden for url https://huggingface.co/...?token=hf_secret"))
        return PushInProgress([job])

    exporter.push_in_progress, exporter._pushed_step = failed(), 4
    with pytest.raises(RuntimeError, match=r"upload of step 4 to the Hub repository me/model failed") as info:
        exporter.push_checkpoint(str(tmp_path / "checkpoint-8"))
    assert "HTTP 403" in str(info.value) and "hf_secret" not in str(info.value)
    exporter.push_in_progress = failed()
    with pytest.raises(RuntimeError, match="HubError \\(HTTP 403\\)"):
        exporter.finish_uploads()
    exporter.finish_uploads()  # nothing left to wait for
