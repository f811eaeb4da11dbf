"""NoLoCoTrainer: the Hugging Face Trainer driving one pipeline-stage replica per process.

Each process builds only its own stage (from a Hub/local checkpoint, a config, or a model in memory), runs the
routed pipeline schedule in ``training_step`` and wraps the Trainer's optimizer in the outer optimizer.
Everything else is the Trainer's own machinery: schedulers, callbacks, logging, progress bar,
``max_steps``/epochs, ``save_total_limit``. This file holds the Trainer's hooks; the work is done by the run's
parts (:mod:`hf_noloco.components.run_parts`: the mesh, the engine, the outer optimizer, the replica-loss
policy, the checkpointer, the exporter...), built once before the Trainer's own set-up.

Failures: every wait of the training loop is bounded by ``p2p_timeout`` and every collective goes through
:mod:`hf_noloco.engine.comm`, so a lost peer is a :class:`~hf_noloco.engine.comm.PeerError`; the heartbeats of
:class:`~hf_noloco.resilience.watch.PeerWatch` name the peers that stopped, and the job's first failure.
"""

from __future__ import annotations

import itertools
import math
import os

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, default_data_collator

from hf_noloco.components.inputs import check_trainer_inputs, pipeline_datasets
from hf_noloco.components.loaders import one_step
from hf_noloco.components.run_parts import RunInputs, RunParts, build_run_parts
from hf_noloco.config import NoLoCoConfig
from hf_noloco.data.arguments import DataArguments
from hf_noloco.data.streaming import TokenStream
from hf_noloco.io.checkpoint_files import PREFIX_CHECKPOINT_DIR
from hf_noloco.resilience.membership import ReplicaDropped

BATCH_KEYS = ["input_ids", "labels", "attention_mask", "position_ids"]


class _StageHandle(nn.Module):
    """What the Trainer sees as its wrapped model: not the stage itself, so the Trainer never wraps the
    stage in DistributedDataParallel (which would broadcast rank 0's weights over every stage)."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage


def _run_attribute(name: str, doc: str) -> property:
    """A Trainer attribute (``state``, ``optimizer``, ``lr_scheduler``) kept in the run's
    :class:`~hf_noloco.components.run_state.RunState`, where the parts that read it find the current one."""
    getter = lambda self: getattr(self.parts.run, name)
    return property(getter, lambda self, value: setattr(self.parts.run, name, value), doc=doc)


class NoLoCoTrainer(Trainer):
    """Trains a Llama-family causal LM with NoLoCo (or DiLoCo, data parallel, no sync) over pipeline stages.

    Args:
        model: a Hub id or local folder (fine-tuning: only this process's stage is read from the safetensors
            files), a ``PretrainedConfig`` (pretraining from scratch) or a model instance (split in memory).
        args: a :class:`~hf_noloco.NoLoCoConfig`.
        train_dataset, eval_dataset: rows of token ids of one length (``prepare_datasets``' rows), streams,
            or raw rows that the trainer prepares itself as ``SFTTrainer`` does, by ``data_args``' options:
            text, conversations (``messages``), prompt/completion pairs, token ids of any length.
        data_args: the data's :class:`~hf_noloco.DataArguments`: how raw rows are prepared, and what the model
            card and the wandb run's config show.
        peft_config: a ``peft.LoraConfig`` (as TRL's ``SFTTrainer`` takes it): each stage gets LoRA adapters,
            only they train and cross the network, and the export is a PEFT adapter (or the merged model with
            ``merge_adapter``). ``model`` must then be a Hub id or folder. :func:`hf_noloco.lora_config`
            builds one from TRL's option names.
        compute_metrics, preprocess_logits_for_metrics: the Trainer's (see :meth:`evaluate`).
        Other arguments are the Trainer's. ``data_collator`` defaults to ``default_data_collator``. Streams
            (:class:`~hf_noloco.data.streaming.TokenStream`, ``max_steps`` needed) are read by each replica
            from its own shard, and a checkpoint records their position.
    """

    state = _run_attribute("trainer_state", "The Trainer's ``TrainerState``.")
    optimizer = _run_attribute("optimizer", "The outer optimizer (wrapping the Trainer's), once made.")
    lr_scheduler = _run_attribute("lr_scheduler", "The learning-rate scheduler, once made.")

    def __init__(
        self,
        model: str | PretrainedConfig | PreTrainedModel,
        args: NoLoCoConfig,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        data_collator=None,
        callbacks=None,
        optimizers=(None, None),
        data_args: DataArguments | None = None,
        peft_config=None,
        **kwargs,
    ):
        if not isinstance(args, NoLoCoConfig):
            raise TypeError(f"NoLoCoTrainer needs a NoLoCoConfig, got {type(args).__name__}.")
        check_trainer_inputs(model, args, train_dataset, peft_config, kwargs)
        train_dataset, eval_dataset = pipeline_datasets(
            train_dataset, eval_dataset, processing_class, data_args
        )
        collate = data_collator or default_data_collator
        inputs = RunInputs(
            train_dataset,
            eval_dataset,
            processing_class,
            collate_fn=collate,
            data_args=data_args,
            peft_config=peft_config,
            user_collator=data_collator is not None,
        )
        # The Trainer's private RNG writer is the only way to write its random states in its own format.
        self.parts: RunParts = build_run_parts(
            model, args, inputs, self._save_rng_state, self.get_decay_parameter_names
        )
        self.data_args, self.peft_config = data_args, self.parts.peft_config
        super().__init__(
            model=self.parts.stage,
            args=args,
            data_collator=collate,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        if isinstance(train_dataset, TokenStream):
            # The stream's recorded position replaces the Trainer's skipping of seen batches (a re-read).
            self.args.ignore_data_skip = True
        self.parts.preemption.take_over(self.callback_handler)
        for callback in (self.parts.record.callback(), self.parts.preemption):
            self.add_callback(callback)
        # Accelerate's prepared optimizer would round-trip the whole state (slow weights and momentum too)
        # through the accelerator, defeating offload_outer_state: each part already lives where it belongs.
        self.accelerator.device_placement = False

    @property
    def mesh(self):
        return self.parts.mesh

    @property
    def outer(self):
        """The outer optimizer (``None`` until ``train`` makes the optimizer)."""
        return self.parts.run.outer

    @property
    def push_in_progress(self):
        return self.parts.exporter.push_in_progress

    # ------------------------------------------------------------------------------------------- set-up

    def get_total_train_batch_size(self, args) -> int:
        # The stages of a replica share its batch: the global batch counts replicas, not processes.
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.mesh.num_replicas

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(BATCH_KEYS)

    def _wrap_model(self, model, training=True, dataloader=None):
        return model if isinstance(model, _StageHandle) else _StageHandle(self.model)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            super().create_optimizer(model)
        if self.outer is None:
            self.optimizer = self.parts.wrap_optimizer(self.optimizer)
        return self.optimizer

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("NoLoCoTrainer.train() needs a train_dataset.")
        # Rows per replica column: per_device_train_batch_size (not the Trainer's _train_batch_size x GPUs).
        dataset = self._columns(self.train_dataset, "training")
        return self.parts.loaders.loader(dataset, self.args.per_device_train_batch_size, True)

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset.")
        dataset = self._columns(dataset, "evaluation")
        return self.parts.loaders.loader(dataset, self.args.per_device_eval_batch_size, False)

    def _columns(self, dataset, description: str):
        keep = isinstance(dataset, TokenStream)
        return dataset if keep else self._remove_unused_columns(dataset, description)

    # ---------------------------------------------------------------------------------------- training

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """The Trainer's ``train``. ``resume_from_checkpoint`` is a checkpoint folder, ``True`` (the newest
        checkpoint in ``output_dir`` that verifies) or ``"auto"`` (that one if any, else a fresh start: one
        recipe for a job a scheduler may requeue); every file a rank reads is checked against the checkpoint's
        checksums on every rank before any rank trains.

        Workers that a launcher restarted after a worker of the job failed (``torchrun --max-restarts N``,
        ``accelerate launch --max_restarts N``) resume from the newest intact checkpoint in ``output_dir`` by
        themselves, or start over when the failed attempt saved none. A column that joined a live run resumes
        from the state its donor sent, whatever ``resume_from_checkpoint`` says."""
        parts, joined = self.parts, self.parts.live_replicas.resume_folder
        request = parts.checkpointer.resume_request(resume_from_checkpoint, joined)
        try:
            folder = parts.checkpointer.resume_folder(*request, joined)
            result = super().train(folder, trial, ignore_keys_for_eval, **kwargs)
            if self.outer is not None:  # an overlapped outer step still in flight: apply it now
                self.outer.finish_outer_step()
            return result
        except ReplicaDropped:
            self.close_watchers()
            raise
        except Exception as exc:  # re-raised, with the job's first failure added
            error = parts.replica_loss.diagnosis(exc)
            if error is exc:
                raise
            raise error from exc

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # One pipeline step per optimizer step (loaders.one_step). The Trainer's loop calls training_step once
        # per batch collected: the first ones are placeholders (None) that training_step passes over.
        batches = list(itertools.islice(epoch_iterator, num_batches))
        return ([None] * (len(batches) - 1) + [one_step(batches)] if len(batches) > 1 else batches), None

    def training_step(self, model, inputs, num_items_in_batch=None):
        if inputs is None:  # a placeholder of get_batch_samples: its rows are in the step's last batch
            return torch.zeros((), device=self.args.device)
        parts = self.parts
        parts.replica_loss.begin_step()
        step = self.state.global_step + 1
        parts.preemption.begin_step(step)
        counters = parts.step.counters()
        return parts.replica_loss.tolerate(
            f"step {step}",
            lambda: parts.step.run_step(inputs, step),
            lambda: parts.step.skip(counters, inputs),
            step,
        )

    def _clip_grad_norm(self, model):
        return self.parts.step.clip()

    def _get_grad_norm(self, model, grad_norm=None):
        return (grad_norm if grad_norm is not None else self.parts.step.column_grad_norm()).item()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds NoLoCo's metrics to training logs. Runs on every rank, so collectives are safe here."""
        if "loss" in logs:
            logs.update(self.parts.logs.training_entries())
        epoch = self.parts.logs.stream_epoch()
        if epoch is not None:
            self.state.epoch = epoch
        super().log(logs, start_time)

    def _maybe_log_save_evaluate(
        self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
    ):
        # The logged loss through our own bounded sum over the live ranks (components.training_logs says why).
        window = self.state.global_step - self._globalstep_last_logged
        if self.control.should_log and window > 0:
            loss = self.parts.logs.training_loss(tr_loss, window, self.parts.step.skipped_since_log)
            tr_loss -= tr_loss
            self.parts.step.skipped_since_log = 0
            logs = {"loss": loss}
            if grad_norm is not None:
                logs["grad_norm"] = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
            logs["learning_rate"] = learning_rate if learning_rate is not None else self._get_learning_rate()
            self._total_loss_scalar += loss * window if math.isfinite(loss) else 0.0
            self._globalstep_last_logged = self.state.global_step
            self.store_flos()
            self.log(logs, start_time)
            self.control.should_log = False
        super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate
        )

    def floating_point_ops(self, inputs) -> float:
        # The FLOPs of this rank's tokens (it counts them too); none for get_batch_samples' placeholders.
        return self.parts.throughput.count(inputs) if inputs is not None else 0.0

    def store_flos(self) -> None:
        flos = torch.tensor([float(self.current_flos)], dtype=torch.float64, device=self.args.device)
        self.parts.logs.live_sum(flos, "all-reduce of the floating-point operations")
        self.state.total_flos += flos.item()
        self.current_flos = 0

    # -------------------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Perplexity pooled over all live replicas' shards, each replica column evaluated as one model (fixed
        routing). Also the exact replica divergence, unless ``divergence_steps`` schedules it elsewhere, and
        ``compute_metrics``' metrics of every live replica's predictions (``EvalPrediction`` as the Trainer's:
        the logits, or what ``preprocess_logits_for_metrics`` makes of each microbatch's, and the labels,
        not shifted). Under ``on_replica_loss="continue"``, an interrupted evaluation returns ``{}``."""
        loader = self.get_eval_dataloader(eval_dataset)
        self.callback_handler.eval_dataloader = loader  # the progress bar's length (shown on rank 0)

        def on_batch():
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)

        def on_metrics(metrics: dict):
            self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)

        metric_fns = (self.compute_metrics, self.preprocess_logits_for_metrics)
        return self.parts.evaluation.run(loader, metric_key_prefix, on_batch, on_metrics, *metric_fns)

    def predict(self, *args, **kwargs):
        raise NotImplementedError("NoLoCoTrainer has no predict(): export the model and use it directly.")

    # ------------------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial):
        """Every rank writes its stage replica; the folder appears only once all are done (see
        :mod:`hf_noloco.io.checkpoint_files`)."""
        self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        self.parts.checkpointer.record_best(run_dir)
        for callback in self.callback_handler.callbacks + [self.control]:  # the Trainer's stateful callbacks
            if hasattr(callback, "state") and callable(callback.state):
                self.state.stateful_callbacks[type(callback).__name__] = callback.state()
        policy = self.parts.replica_loss
        save = lambda: self.parts.checkpointer.save(run_dir, policy.checkpoint_barrier)
        policy.tolerate(f"checkpoint-{step}", save, lambda: None, step)
        if self.args.push_to_hub:
            self._push_from_checkpoint(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}"))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        self.parts.checkpointer.load_model_state(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, folder):
        if folder is not None:
            self.parts.checkpointer.load_optimizer_state(folder)
            self.parts.live_replicas.resumed()  # a joined column's copy is read: it goes

    # ------------------------------------------------------------------------------------------ export

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Exports the consensus model (or ``export_replica``) as one ordinary HF checkpoint with a model card
        and training curves. Collective: every rank calls it. Under ``on_replica_loss="continue"`` the
        consensus is over the live replicas, and a replica lost during the export makes the others start it
        again (up to three times)."""
        output_dir = output_dir or self.args.output_dir
        export = lambda: self.parts.exporter.export(output_dir)
        self.parts.replica_loss.retry("the export", export, self.state.global_step)

    @property
    def tokens_seen(self) -> int:
        """Training tokens (not padding) processed so far over all live replicas, as of the last log."""
        return self.parts.throughput.tokens_seen

    @property
    def export_kind(self) -> str:
        """What ``save_model`` writes: ``"model"``, ``"adapter"`` (PEFT) or ``"merged"`` (adapters merged)."""
        return self.parts.record.export_kind

    @property
    def adapter_summary(self) -> str | None:
        return self.parts.record.adapter_summary

    def create_model_card(self, *args, **kwargs):
        if self.is_world_process_zero():
            self.parts.exporter.write_model_card(self.args.output_dir)

    def init_hf_repo(self, token=None, private=None):
        """Before training, on every rank: the token checked with the Hub and the repository created."""
        self.hub_model_id = self.parts.exporter.init_repository(token, private)

    def _push_from_checkpoint(self, checkpoint_folder):
        self.parts.exporter.push_checkpoint(checkpoint_folder)  # by hub_strategy: the export, the checkpoint

    def _finish_current_push(self):
        """Waits for the last background upload (the Trainer's own), then raises on every rank if it failed
        (collective when pushing)."""
        super()._finish_current_push()
        self.parts.exporter.finish_uploads()

    def push_to_hub(
        self, commit_message="End of training", blocking=True, token=None, revision=None, **kwargs
    ):
        """Exports to ``output_dir`` (collective) and uploads it from the leader rank."""
        self._finish_current_push()  # a save's upload still running reads output_dir
        self.save_model(self.args.output_dir)
        return self.parts.exporter.push_export(commit_message or "End of training", token, revision)

    def close_watchers(self) -> None:
        """Stops the heartbeat (and, under ``on_replica_loss="continue"``, the membership watch)."""
        self.parts.replica_loss.close()

    def end(self):
        """The Trainer's own ``end()`` (finish the trackers, destroy the process group) once every live rank
        is done, and the wandb run finished (the Trainer never does). Optional: at exit a process does it by
        itself, without waiting for the others. After a replica loss (``on_replica_loss="continue"``) this
        process ends here, with status 0 (``ReplicaLossPolicy.tear_down`` says why)."""
        if self.parts.ended:
            return
        self.parts.replica_loss.last_barrier()
        super().end()
        self.parts.end_at_exit()
