"""NoLoCoTrainer: the Hugging Face Trainer driving one pipeline-stage replica per process.

Each process builds only its own stage (from a Hub/local checkpoint, a config, or a model in memory), runs the
routed pipeline schedule in ``training_step`` and wraps the Trainer's optimizer in the outer optimizer.
Everything else is the Trainer's own machinery: schedulers, callbacks, logging, progress bar,
``max_steps``/epochs, ``save_total_limit``. This file holds the Trainer's hooks; the work is done by the parts
they delegate to: the engine (stage, pipeline, tied embeddings), the outer optimizer, the replica-loss policy
(:mod:`hf_noloco.resilience.policy`), and the components (loaders, column statistics, metrics, checkpoints,
the export).

Failures: every wait of the training loop is bounded by ``p2p_timeout`` and every collective goes through
:mod:`hf_noloco.engine.comm`, so a lost peer is a :class:`~hf_noloco.engine.comm.PeerError`; the heartbeats of
:class:`~hf_noloco.resilience.watch.PeerWatch` name the peers that stopped, and the job's first failure.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from accelerate.utils.memory import clear_device_cache
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, default_data_collator

from hf_noloco import adapters
from hf_noloco.components import exporter
from hf_noloco.components.checkpointer import RunCheckpointer
from hf_noloco.components.column_stats import clip_gradients_, column_stats, nonfinite_report
from hf_noloco.components.evaluation import evaluate_pipeline
from hf_noloco.components.inputs import check_dataset_size, check_trainer_inputs
from hf_noloco.components.live_replicas import LiveReplicas
from hf_noloco.components.loaders import ReplicaLoaders
from hf_noloco.components.metrics import Throughput, mean_training_loss, outer_log_entries, replica_divergence
from hf_noloco.components.run_record import RunConfigCallback, finish_wandb
from hf_noloco.config import NoLoCoConfig
from hf_noloco.data.streaming import TokenStream
from hf_noloco.engine.comm import PeerError, is_lost_peer
from hf_noloco.engine.fidelity import verify_split
from hf_noloco.engine.loading import keep_float32_masters, stage_from_source
from hf_noloco.engine.mesh import PipelineMesh, ensure_process_group
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.routing import Router
from hf_noloco.engine.tied import TiedEmbeddings
from hf_noloco.io import checkpoint
from hf_noloco.outer.compression import wire_bytes
from hf_noloco.outer.optimizer import OuterOptimizer, broadcast_replica_weights
from hf_noloco.resilience import elastic
from hf_noloco.resilience.joining import is_joining
from hf_noloco.resilience.membership import ReplicaDropped
from hf_noloco.resilience.policy import replica_loss_policy
from hf_noloco.resilience.preemption import Preemption

if TYPE_CHECKING:
    from hf_noloco.launch.arguments import DataArguments

logger = logging.getLogger(__name__)

BATCH_KEYS = ["input_ids", "labels", "attention_mask", "position_ids"]


class _StageHandle(nn.Module):
    """What the Trainer sees as its wrapped model: not the stage itself, so the Trainer never wraps the
    stage in DistributedDataParallel (which would broadcast rank 0's weights over every stage)."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage


class NoLoCoTrainer(Trainer):
    """Trains a Llama-family causal LM with NoLoCo (or DiLoCo, data parallel, no sync) over pipeline stages.

    Args:
        model: a Hub id or local folder (fine-tuning: only this process's stage is read from the safetensors
            files), a ``PretrainedConfig`` (pretraining from scratch) or a model instance (split in memory).
        args: a :class:`~hf_noloco.NoLoCoConfig`.
        data_args: the data's :class:`~hf_noloco.DataArguments`, shown in the model card and the wandb run's
            config.
        peft_config: a ``peft.LoraConfig`` (as TRL's ``SFTTrainer`` takes it): each stage gets LoRA adapters,
            only they train and cross the network, and the export is a PEFT adapter (or the merged model with
            ``merge_adapter``). ``model`` must then be a Hub id or folder. :func:`hf_noloco.lora_config`
            builds one from TRL's option names.
        Other arguments are the Trainer's. ``data_collator`` defaults to ``default_data_collator`` (packed
            blocks, padded rows). ``train_dataset`` / ``eval_dataset`` may be
            :class:`~hf_noloco.data.streaming.TokenStream` s (``max_steps`` needed): each replica then reads
            its own shard, and a checkpoint records its position. ``compute_metrics`` and
            ``preprocess_logits_for_metrics`` are refused: evaluation computes the loss and perplexity inside
            the pipeline, and no rank ever holds a batch's logits whole.
    """

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
        args._setup_devices  # noqa: B018 - joins the process group when launched (Accelerate)
        ensure_process_group(args.ddp_timeout)  # a plain `python script.py`: a one-process group
        # Set-up (loading a stage, the first broadcast) may be slow on some nodes: ddp_timeout until training.
        joining = is_joining()  # a column joining a live run: its state comes from a live replica
        self.mesh = PipelineMesh.build(args.pipeline_stages, args.device, args.ddp_timeout, joining)
        self.base_model = (
            model
            if isinstance(model, str)
            else getattr(getattr(model, "config", None), "_name_or_path", None)
        ) or None
        self.data_args = data_args
        built = stage_from_source(
            model,
            self.mesh.stage,
            self.mesh.num_stages,
            args.device,
            args.stage_boundaries,
            args.stage_balance,
            args.seed,
            args.model_init_kwargs,
            check=(lambda config: self._verify_split(config, args))
            if args.verify_split and not joining
            else None,
        )
        stage = built.stage
        self.base_model_folder = built.folder  # a fine-tuned checkpoint's files (its card, its license)
        self.base_generation_config = built.generation_config  # what the export carries
        # The LoraConfig with its target modules resolved, once the adapters exist.
        self.peft_config = adapters.add_adapters(stage, peft_config, seed=args.seed) if peft_config else None
        self.export_config = copy.deepcopy(stage.config)  # before the Trainer switches off use_cache
        self.weights_dtype = next(stage.parameters()).dtype  # what the model was asked in: the export's too
        if args.master_weights == "float32" and keep_float32_masters(stage):
            args.bf16, args.mixed_precision = True, "bf16"  # compute in bf16, as the weights' dtype asked
        if args.torch_compile:  # per decoder layer: the stage's own code (masks, routing) stays eager
            for layer in stage.model.layers.values():
                layer.compile(backend=args.torch_compile_backend, mode=args.torch_compile_mode)
        # With adapters, every replica read the same frozen base weights: only the adapters need to agree.
        trained = adapters.trainable_state_dict(stage).values() if self.peft_config else None
        if not joining:  # (a joiner's split was verified by the run; its tied ends are checked on resume)
            broadcast_replica_weights(stage if trained is None else nn.ParameterList(trained), self.mesh)
        self.tied = TiedEmbeddings(stage, self.mesh)
        if not joining:
            self.tied.check_equal()
        check_dataset_size(train_dataset, self.mesh.num_replicas * args.per_device_train_batch_size)
        super().__init__(
            model=stage,
            args=args,
            data_collator=data_collator or default_data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        router = Router(
            self.mesh.num_replicas, args.routing, args.routing_seed, group_size=args.routing_group_size
        )
        self.engine = PipelineEngine(
            self.model,
            self.mesh,
            router,
            args.microbatch_size,
            p2p_timeout=args.p2p_timeout,
            # Accelerate's autocast: bf16 mixed precision when `bf16=True` (the Trainer's is a no-op in v5).
            autocast=lambda: self.accelerator.autocast(),
            schedule=args.pipeline_schedule,
            loss_chunk_tokens=args.loss_chunk_tokens,
            wire_dtype=torch.bfloat16 if args.bf16 else None,  # what autocast computes in: half the bytes
        )
        self.outer: OuterOptimizer | None = None
        self.loaders = ReplicaLoaders(self.mesh, args, self.data_collator)
        self.checkpointer = RunCheckpointer(self)
        if isinstance(train_dataset, TokenStream):
            # The stream's recorded position replaces the Trainer's skipping of seen batches (a re-read).
            self.args.ignore_data_skip = True
        self.throughput = Throughput(stage.config, self.mesh.is_first_stage, args)  # peak FLOPS from args
        self._last_divergence_step = 0
        self._grad_norm: torch.Tensor | None = None  # this step's column gradient norm (set by training_step)
        self._skipped_since_log = 0  # steps this rank skipped since the last log (a replica lost meanwhile)
        # Set-up is over: from here on no rank should wait for another longer than p2p_timeout.
        self.mesh.set_timeout(args.p2p_timeout)
        self.live_replicas = LiveReplicas(self)
        self.replica_loss = replica_loss_policy(
            args.on_replica_loss, self.mesh, args.p2p_timeout, self.live_replicas, joining, args.ddp_timeout
        )
        self.preemption = Preemption.of(self)  # SIGTERM: a checkpoint, then the end (enable_jit_checkpoint)
        for callback in (RunConfigCallback(self), self.preemption):
            self.add_callback(callback)
        # Accelerate's prepared optimizer would round-trip the whole state (slow weights and momentum too)
        # through the accelerator, defeating offload_outer_state: each part already lives where it belongs.
        self.accelerator.device_placement = False

    # ------------------------------------------------------------------------------------------- set-up

    def _verify_split(self, config, args: NoLoCoConfig) -> None:
        trust = (args.model_init_kwargs or {}).get("trust_remote_code", False)
        boundaries, balance = args.stage_boundaries, args.stage_balance
        verify_split(config, self.mesh.num_stages, boundaries, balance, args.loss_chunk_tokens, trust)

    def get_total_train_batch_size(self, args) -> int:
        # The stages of a replica share its batch: the global batch counts replicas, not processes.
        return args.per_device_train_batch_size * self.mesh.num_replicas

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(BATCH_KEYS)

    def _wrap_model(self, model, training=True, dataloader=None):
        return model if isinstance(model, _StageHandle) else _StageHandle(self.model)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            super().create_optimizer(model)
        if not isinstance(self.optimizer, OuterOptimizer):
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            self.outer = OuterOptimizer(
                self.optimizer,
                trainable,
                self.mesh,
                self.args.outer_settings,
                p2p_timeout=self.args.p2p_timeout,
                tied_weight=self.tied.weight if self.tied.trains else None,
                tied_mirror=self.tied.is_mirror,
                tied_peer=self.tied.peer if self.tied.trains else None,
            )
            self.optimizer = self.outer
            # No averaging while the live replicas change; a partner lost mid-exchange is the policy's.
            self.outer.exchange_allowed = lambda: not self.replica_loss.offline
            self.outer.on_lost_partner = lambda exc: self.replica_loss.lost_partner(
                exc, self.state.global_step + 1
            )
            if self.outer.settings.has_outer_step:
                dtype, numel = self.outer.settings.outer_dtype, self.outer.numel
                lora = f" ({self.adapter_summary})" if self.peft_config else ""
                logger.info(
                    "%s: an outer step exchanges the %d trainable parameters%s, %d bytes in %s.",
                    *(self.mesh.describe(), numel, lora, wire_bytes(numel, dtype), dtype),
                )
        return self.optimizer

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("NoLoCoTrainer.train() needs a train_dataset.")
        # Rows per replica column: per_device_train_batch_size (not the Trainer's _train_batch_size x GPUs).
        return self.loaders.loader(
            self._columns(self.train_dataset, "training"), self.args.per_device_train_batch_size, True
        )

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset.")
        return self.loaders.loader(
            self._columns(dataset, "evaluation"), self.args.per_device_eval_batch_size, False
        )

    def _columns(self, dataset, description: str):
        return (
            dataset if isinstance(dataset, TokenStream) else self._remove_unused_columns(dataset, description)
        )

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
        joined = self.live_replicas.resume_folder  # a joined column's copy of its donor's state
        auto = resume_from_checkpoint == "auto" and not joined  # a requeued job resumes, a first one starts
        restarted = auto or not (resume_from_checkpoint or joined) and elastic.agreed_restart(self.mesh)
        if restarted and not auto:
            logger.warning(
                "%s: a restart of this job: resuming from the newest intact checkpoint in %s, if any.",
                self.mesh.describe(),
                self.args.output_dir,
            )
            resume_from_checkpoint = True
        if not (resume_from_checkpoint or joined) and checkpoint.checkpoints_in(self.args.output_dir):
            raise ValueError(
                f"{self.args.output_dir} already holds checkpoints of a run. Resume it with "
                "resume_from_checkpoint=True (or 'auto', for a fresh output_dir too), or choose another one."
            )
        try:
            if joined or resume_from_checkpoint:
                resume_from_checkpoint = joined or self._verified_checkpoint(
                    resume_from_checkpoint, restarted
                )
            result = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
            if self.outer is not None:  # an overlapped outer step still in flight: apply it now
                self.outer.finish_outer_step()
            return result
        except ReplicaDropped:
            self.close_watchers()
            raise
        except Exception as exc:  # re-raised, with the job's first failure added
            error = self.replica_loss.watch.with_root_cause(exc, self.mesh, min(self.args.p2p_timeout, 5.0))
            self.replica_loss.watch.close()  # the diagnosis is done: no more heartbeats, and a clean exit
            if is_lost_peer(exc):
                self.replica_loss.watch.hold_store_at_exit()
            if error is exc:
                raise
            raise error from exc

    def _verified_checkpoint(self, requested, restarted: bool):
        auto = requested == "auto"
        if requested is not True and not auto:
            self.checkpointer.check_mesh_first(requested)
        with self.mesh.patient(self.args.ddp_timeout):  # hashing a large checkpoint may take a while
            found = checkpoint.resolve_resume(
                self.args.output_dir, True if auto else requested, self.mesh, self.model.all_layer_ranges
            )
        if found is None and not restarted:  # a restart before any save starts over
            raise ValueError(f"resume_from_checkpoint=True: {self.args.output_dir} holds no checkpoint.")
        if restarted and self.mesh.rank == 0:
            what = f"resuming {found}." if found else "no checkpoint yet, from step 0."
            logger.warning("%s: %s", "resume_from_checkpoint=auto" if auto else "Restarted job", what)
        return found

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.replica_loss.begin_step()
        step = self.state.global_step + 1
        self.preemption.begin_step(step)
        counters = (self.engine.step_index, self.engine.samples_seen)
        return self.replica_loss.tolerate(
            f"step {step}",
            lambda: self._training_step(inputs, step),
            lambda: self._skip_step(counters, inputs),
            step,
        )

    def _skip_step(self, counters: tuple[int, int], inputs) -> torch.Tensor:
        """The rest of a step whose communication failed under ``on_replica_loss="continue"``: its gradients
        are dropped (the optimizer then leaves the weights and its state untouched, as ``nonfinite="skip"``
        does), the routing counters advance as if it had run, and the logged loss leaves the step out."""
        self.engine.step_index = counters[0] + 1
        self.engine.samples_seen = counters[1] + inputs["input_ids"].shape[0]
        for p in self.model.parameters():
            p.grad = None
        self._grad_norm = torch.zeros((), device=self.args.device)
        self._skipped_since_log += 1
        return torch.zeros((), device=self.args.device)

    def _training_step(self, inputs, step: int) -> torch.Tensor:
        self.model.train()
        result = self.engine.train_step(inputs)
        self.outer.reduce_gradients()  # ddp: first, so the tied sum below adds replica-averaged gradients
        self.tied.sum_gradients()
        every = self.args.torch_empty_cache_steps
        if every is not None and step % every == 0:
            clear_device_cache()
        stats = column_stats(self.model, self.mesh, result.loss, step)
        self._grad_norm = stats[1:].sum().sqrt()
        problem = nonfinite_report(stats, self.mesh, step)
        if problem is not None:
            self._on_nonfinite(problem)
        return stats[0]

    def _on_nonfinite(self, what: str) -> None:
        """Every rank of the column sees the same statistics, so they all take the same decision here. Other
        columns are unaffected: under "skip" their outer-step counters stay aligned, under "error" they fail
        within p2p_timeout on their next message to this column, naming this error."""
        if self.args.nonfinite == "error":
            raise FloatingPointError(
                f"{what}. Stopping (nonfinite='error'); the checkpoints already written are complete: "
                "resume from the last one (perhaps with a lower learning rate), or set nonfinite='skip' to "
                "skip such steps."
            )
        # Skip: drop the gradients. Optimizers leave a parameter without one untouched, while OuterOptimizer
        # .step() still counts the step, so outer steps stay aligned with other replicas.
        for p in self.model.parameters():
            p.grad = None
        if self.mesh.is_first_stage:  # one warning per column
            logger.warning(
                "%s. Skipping this step on replica %d (nonfinite='skip').", what, self.mesh.replica
            )

    def _column_grad_norm(self) -> torch.Tensor:
        if self._grad_norm is None:  # only outside the training loop: training_step computes it
            raise RuntimeError("The column gradient norm is computed by training_step.")
        return self._grad_norm

    def _clip_grad_norm(self, model):
        norm = self._column_grad_norm()
        clip_gradients_(self.model.parameters(), norm, self.args.max_grad_norm)
        return norm

    def _get_grad_norm(self, model, grad_norm=None):
        return (grad_norm if grad_norm is not None else self._column_grad_norm()).item()

    def _live_sum(self, tensor: torch.Tensor, what: str) -> int:
        return self.replica_loss.live_sum(tensor, what, self.state.global_step)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds NoLoCo's metrics to training logs. Runs on every rank, so collectives are safe here."""
        if "loss" in logs and self.outer is not None:
            step = self.state.global_step
            every = self.args.divergence_steps
            if every is not None and step - self._last_divergence_step >= every:
                logs.update(self._divergence())
                self._last_divergence_step = step
            logs.update(
                outer_log_entries(
                    self.outer, lambda t: self._live_sum(t, "all-reduce of the logging statistics")
                )
            )
        if "loss" in logs:
            live_sum = lambda t: self._live_sum(t, "all-reduce of the token counts")
            logs.update(self.throughput.log_entries(live_sum, self.args.device))
        if self.loaders.train_stream is not None and self.state.max_steps:
            # A stream has no length: the Trainer's epoch is the fraction of max_steps, which it would restart
            # from 0 after a resume (it skips no batches then).
            self.state.epoch = self.state.global_step / self.state.max_steps
        super().log(logs, start_time)

    def _divergence(self) -> dict[str, float]:
        """:func:`~hf_noloco.components.metrics.replica_divergence` over the live replicas (none while they
        are changing)."""
        step = self.state.global_step
        return self.replica_loss.tolerate(
            "the replica divergence", lambda: replica_divergence(self.model, self.mesh), dict, step
        )

    def _maybe_log_save_evaluate(
        self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
    ):
        # The logged loss through our own bounded sum over the live ranks (components.metrics says why).
        window = self.state.global_step - self._globalstep_last_logged
        if self.control.should_log and window > 0:
            loss_sum = lambda t: self._live_sum(t, "all-reduce of the training loss")
            loss = mean_training_loss(tr_loss, window, self._skipped_since_log, loss_sum)
            tr_loss -= tr_loss
            self._skipped_since_log = 0
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
        return self.throughput.count(inputs)  # the FLOPs of this rank's tokens; it counts them too

    def store_flos(self) -> None:
        flos = torch.tensor([float(self.current_flos)], dtype=torch.float64, device=self.args.device)
        self._live_sum(flos, "all-reduce of the floating-point operations")
        self.state.total_flos += flos.item()
        self.current_flos = 0

    # -------------------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Perplexity pooled over all live replicas' shards, each replica column evaluated as one model (fixed
        routing). Also the exact replica divergence, unless ``divergence_steps`` schedules it elsewhere. Under
        ``on_replica_loss="continue"`` an evaluation that a lost replica interrupts returns ``{}``."""

        def interrupted() -> dict:
            self.model.train()
            return {}

        def run() -> dict:
            if self.replica_loss.continues:
                self.replica_loss.barrier()  # every live rank evaluates in the same view
            return evaluate_pipeline(self, eval_dataset, metric_key_prefix)

        return self.replica_loss.tolerate("evaluation", run, interrupted, self.state.global_step)

    def predict(self, *args, **kwargs):
        raise NotImplementedError("NoLoCoTrainer has no predict(): export the model and use it directly.")

    # ------------------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial):
        """Every rank writes its stage replica; the folder appears only once all are done (see
        :mod:`hf_noloco.io.checkpoint`)."""
        self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        best = self.state.best_global_step  # set by the Trainer when metric_for_best_model improves
        if best and self.args.save_strategy in ("steps", "epoch", "best"):
            folder = os.path.join(run_dir, f"{checkpoint.PREFIX_CHECKPOINT_DIR}-{best}")
            if best == self.state.global_step or os.path.isdir(folder):
                self.state.best_model_checkpoint = folder  # recorded, and kept by save_total_limit
        step = self.state.global_step
        self.replica_loss.tolerate(
            f"checkpoint-{step}", lambda: self.checkpointer.save(run_dir), lambda: None, step
        )
        if self.args.push_to_hub:
            self._push_from_checkpoint(os.path.join(run_dir, f"{checkpoint.PREFIX_CHECKPOINT_DIR}-{step}"))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        self.checkpointer.load_model_state(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, folder):
        if folder is not None:
            self.checkpointer.load_optimizer_state(folder)
            self.live_replicas.resumed()  # a joined column's copy is read: it goes

    # ------------------------------------------------------------------------------------------ export

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Exports the consensus model (or ``export_replica``) as one ordinary HF checkpoint with a model card
        and training curves. Collective: every rank calls it. Under ``on_replica_loss="continue"`` the
        consensus is over the live replicas, and a replica lost during the export makes the others start it
        again (up to three times)."""
        output_dir = output_dir or self.args.output_dir
        self.replica_loss.retry(
            "the export", lambda: exporter.export_run(self, output_dir), self.state.global_step
        )

    @property
    def tokens_seen(self) -> int:
        """Training tokens (not padding) processed so far over all live replicas, as of the last log."""
        return self.throughput.tokens_seen

    @property
    def export_kind(self) -> str:
        """What ``save_model`` writes: ``"model"``, ``"adapter"`` (PEFT) or ``"merged"`` (adapters merged)."""
        if self.peft_config is None:
            return "model"
        return "merged" if self.args.merge_adapter else "adapter"

    @property
    def adapter_summary(self) -> str | None:
        return adapters.adapter_summary(self.peft_config) if self.peft_config else None

    def create_model_card(self, *args, **kwargs):
        if self.is_world_process_zero():
            exporter.write_model_card(self, self.args.output_dir)

    def init_hf_repo(self, token=None, private=None):
        """Before training, on every rank: the token checked with the Hub and the repository created."""
        self.hub_model_id, self.push_in_progress = exporter.init_repository(self, token, private), None

    def _push_from_checkpoint(self, checkpoint_folder):
        exporter.push_checkpoint(self, checkpoint_folder)  # by hub_strategy: the export, and the checkpoint

    def push_to_hub(
        self, commit_message="End of training", blocking=True, token=None, revision=None, **kwargs
    ):
        """Exports to ``output_dir`` (collective) and uploads it from the leader rank."""
        self._finish_current_push()  # a save's upload still running reads output_dir
        self.save_model(self.args.output_dir)
        return exporter.push_export(self, commit_message or "End of training", token, revision)

    def close_watchers(self) -> None:
        """Stops the heartbeat (and, under ``on_replica_loss="continue"``, the membership watch)."""
        self.replica_loss.close()

    def end(self):
        """Finishes the wandb run (the Trainer never does) and destroys the process group. After a replica
        loss (``on_replica_loss="continue"``) this process ends here, with status 0: see below."""
        if self.is_world_process_zero():
            finish_wandb()
        try:
            self.replica_loss.barrier()
        except PeerError:  # a rank lost at the very end: nothing left to wait for
            if not self.replica_loss.continues:
                raise
        self.close_watchers()
        super().end()
        if not self.replica_loss.may_tear_down_groups():
            # Operations given up after the loss stay posted in gloo, threads waiting on them: destroyed at
            # exit, they abort the process (status 134, a failed job to a scheduler). All is written: skip.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if dist.is_initialized():
            dist.destroy_process_group()
