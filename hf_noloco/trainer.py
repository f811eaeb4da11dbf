"""NoLoCoTrainer: the Hugging Face Trainer driving one pipeline-stage replica per process.

Each process builds only its own stage (from a Hub/local checkpoint, a config, or a model in memory),
runs the routed pipeline schedule in ``training_step`` and wraps the Trainer's optimizer in the outer
optimizer. Everything else is the Trainer's own machinery: schedulers, callbacks, logging, progress bar,
``max_steps``/epochs, ``save_total_limit``.

Gradient clipping uses the norm over the whole replica column (all stages of one replica), so a column
clips like the unsplit model would. One small all-reduce over the column per step carries the last stage's
loss and every stage's squared gradient norm: it serves the loss report, clipping and the non-finite check.

Failures: every wait of the training loop is bounded by ``p2p_timeout`` (P2P waits by the engine, collectives
by the process groups' timeout, which the trainer sets). A rank whose communication fails finds the peers that
stopped responding through heartbeats in the rendezvous store (:class:`~hf_noloco.comm.PeerWatch`); the first
failure of the job is kept there and added to the errors of the ranks that fail after it, so each rank's log
names the root cause.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from accelerate.utils.memory import clear_device_cache
from torch import nn
from torch.utils.data import DataLoader
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    default_data_collator,
)

from . import adapters, checkpoint, elastic
from .card import PLOT_FILE, plot_training_curves, render_model_card
from .comm import PeerError, PeerWatch, group_timeout, wait_collective
from .config import DataArguments, NoLoCoConfig
from .export import gather_full_state_dict, save_consensus_checkpoint
from .hub import check_hub_settings, push_folder_to_hub
from .membership import Membership, ReplicaDropped, silence_limit
from .mesh import PipelineMesh
from .metrics import perplexity, replica_divergence, squared_norm
from .outer import OuterOptimizer, broadcast_replica_weights
from .partition import (
    build_stage,
    load_config,
    resolve_checkpoint,
    split_model,
    ties_embeddings,
    weights_dtype,
)
from .pipeline import PipelineEngine
from .routing import Router
from .streaming import TokenStream
from .tied import TiedEmbeddings

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
        args: a :class:`NoLoCoConfig`.
        data_args: the data's :class:`~hf_noloco.config.DataArguments`, shown in the model card and the wandb
            run's config.
        peft_config: a ``peft.LoraConfig`` (as TRL's ``SFTTrainer`` takes it): each stage gets LoRA adapters,
            only they train and cross the network, and the export is a PEFT adapter (or the merged model with
            ``merge_adapter``). ``model`` must then be a Hub id or folder.
            :func:`hf_noloco.adapters.lora_config` builds one from TRL's option names.
        Other arguments are the Trainer's. ``data_collator`` defaults to ``default_data_collator`` (packed
        blocks, padded rows). ``train_dataset`` / ``eval_dataset`` may be
        :class:`~hf_noloco.streaming.TokenStream` s (``max_steps`` needed): each replica then reads its own
        shard, and a checkpoint records its position.
        ``compute_metrics`` and ``preprocess_logits_for_metrics`` are refused: evaluation computes
        the loss and perplexity inside the pipeline, and no rank ever holds a batch's logits whole.
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
        _check_adapter_inputs(model, args, peft_config)
        _check_streams(train_dataset, args)
        for name in ("compute_metrics", "preprocess_logits_for_metrics", "model_init"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"{name} is not supported by NoLoCoTrainer: evaluation computes loss and perplexity "
                    "inside the pipeline (no rank holds a batch's logits whole); the model is given directly."
                )
        if isinstance(model, PreTrainedModel) and args.model_init_kwargs:
            raise ValueError(
                "model_init_kwargs only applies when the model is given as a Hub id, a folder or a config; "
                "this model is already built: set its dtype and attention implementation on it directly."
            )
        _ensure_process_group(args)
        # Set-up (loading a stage, the first broadcast) may be slow on some nodes: ddp_timeout until training.
        self.mesh = PipelineMesh.build(args.pipeline_stages, device=args.device, timeout=args.ddp_timeout)
        self.base_model = (
            model
            if isinstance(model, str)
            else getattr(getattr(model, "config", None), "_name_or_path", None) or None
        )
        self.base_model_folder: str | None = None  # a fine-tuned checkpoint's files (its card, its license)
        self.base_generation_config = getattr(model, "generation_config", None)  # what the export carries
        self.data_args = data_args
        self.peft_config = None  # the LoraConfig with its target modules resolved, once the adapters exist
        stage = self._build_stage(model, args, peft_config)
        self.export_config = copy.deepcopy(stage.config)  # before the Trainer switches off use_cache
        if args.torch_compile:  # per decoder layer: the stage's own code (masks, routing) stays eager
            for layer in stage.model.layers.values():
                layer.compile(backend=args.torch_compile_backend, mode=args.torch_compile_mode)
        # With adapters, every replica read the same frozen base weights: only the adapters need to agree.
        broadcast_replica_weights(
            stage
            if self.peft_config is None
            else nn.ParameterList(adapters.trainable_state_dict(stage).values()),
            self.mesh,
        )
        self.tied = TiedEmbeddings(stage, self.mesh, args.p2p_timeout)
        self.tied.check_equal()
        self._check_dataset_size(train_dataset, args)
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
        self.engine = PipelineEngine(
            self.model,
            self.mesh,
            Router(
                self.mesh.num_replicas,
                args.routing,
                args.routing_seed,
                group_size=args.resolved_routing_group_size(self.mesh.num_replicas),
            ),
            args.resolved_microbatch_size(),
            p2p_timeout=args.p2p_timeout,
            # Accelerate's autocast: bf16 mixed precision when `bf16=True` (the Trainer's own helper is a
            # no-op in v5).
            autocast=lambda: self.accelerator.autocast(),
            schedule=args.pipeline_schedule,
            loss_chunk_tokens=args.loss_chunk_tokens,
            wire_dtype=torch.bfloat16 if args.bf16 else None,  # what autocast computes in: half the bytes
        )
        self.outer: OuterOptimizer | None = None
        self._train_stream: TokenStream | None = None  # this replica's shard of a streamed training set
        self._stream_position: dict | None = None  # read from a checkpoint before the shard exists
        if isinstance(train_dataset, TokenStream):
            # The stream's recorded position replaces the Trainer's skipping of the batches seen before a
            # resume (which would read them again).
            self.args.ignore_data_skip = True
        self.tokens_seen = 0
        self._last_divergence_step = 0
        self._last_log = (0, time.monotonic())
        self._grad_norm: torch.Tensor | None = None  # this step's column gradient norm (set by training_step)
        self._skipped_since_log = 0  # steps skipped since the last log (on_replica_loss="continue")
        # Set-up is over: from here on no rank should wait for another longer than p2p_timeout.
        self._set_collective_timeout(args.p2p_timeout)
        continuing = args.on_replica_loss == "continue"
        self.watch = PeerWatch(self.mesh.rank, self.mesh.world_size, own_connection=continuing)
        # on_replica_loss="continue": the live replica columns, agreed through the store (membership.py)
        self.live: Membership | None = None
        if continuing:
            self.live = Membership(
                self.watch,
                self.mesh.rank,
                self.mesh.num_stages,
                self.mesh.num_replicas,
                silence=silence_limit(args.p2p_timeout),
                on_change=self._on_live_replicas_changed,
            )
        self.add_callback(_RunConfigCallback(self))
        # Accelerate's prepared optimizer would round-trip the whole state dict through the accelerator at
        # prepare time, slow weights and momentum included, which defeats offload_outer_state: each part of
        # the state already lives where it belongs (the inner state beside its parameters).
        self.accelerator.device_placement = False

    # ------------------------------------------------------------------------------------------- set-up

    def _build_stage(self, model, args: NoLoCoConfig, peft_config=None) -> nn.Module:
        stage = self._build_base_stage(model, args, peft_config)
        if peft_config is not None:
            self.peft_config = adapters.add_adapters(stage, peft_config, seed=args.seed)
        return stage

    def _build_base_stage(self, model, args: NoLoCoConfig, peft_config=None) -> nn.Module:
        mesh = self.mesh
        if isinstance(model, PreTrainedModel):
            stage = split_model(model, mesh.stage, mesh.num_stages, args.stage_boundaries, args.stage_balance)
            return stage.to(args.device)
        init = args.model_init_kwargs or {}
        trust = init.get("trust_remote_code", False)
        if isinstance(model, str):
            folder = self.base_model_folder = resolve_checkpoint(model, init.get("revision"), trust)
            config = load_config(folder, trust_remote_code=trust)
            if os.path.exists(os.path.join(folder, "generation_config.json")):
                self.base_generation_config = GenerationConfig.from_pretrained(folder)
        elif isinstance(model, PretrainedConfig):
            if init.get("revision") is not None:
                raise ValueError("model_revision applies to a Hub model, not to a config built in Python.")
            folder, config = None, model  # replica 0's initialisation is broadcast to the others
        else:
            raise TypeError(
                "model must be a Hub id or folder, a PretrainedConfig or a PreTrainedModel, got "
                f"{type(model).__name__}."
            )
        return build_stage(
            config,
            mesh.stage,
            mesh.num_stages,
            args.stage_boundaries,
            folder,
            args.device,
            dtype=weights_dtype(init.get("dtype"), config),
            stage_balance=args.stage_balance,
            seed=args.seed,
            attn_implementation=init.get("attn_implementation"),
            trust_remote_code=trust,
        )

    def _check_dataset_size(self, dataset, args: NoLoCoConfig) -> None:
        if dataset is None or not hasattr(dataset, "__len__"):
            return
        needed = self.mesh.num_replicas * args.per_device_train_batch_size
        if len(dataset) < needed:
            raise ValueError(
                f"The training set has {len(dataset)} samples, fewer than one batch per replica "
                f"({self.mesh.num_replicas} replicas x per_device_train_batch_size="
                f"{args.per_device_train_batch_size} = {needed}). Use more data or a smaller batch."
            )

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
            )
            self.optimizer = self.outer
            if self.live is not None:  # a lost gossip partner means no averaging this outer step
                self.outer.exchange_allowed = lambda: not self.live.offline
                self.outer.on_lost_partner = lambda exc: self.live.failed(exc, self.state.global_step + 1)
            if self.outer.settings.has_outer_step:
                element = torch.finfo(getattr(torch, self.outer.settings.dtype)).bits // 8
                logger.info(
                    "%s: an outer step exchanges the %d trainable parameters%s, %d bytes in %s.",
                    self.mesh.describe(),
                    self.outer.numel,
                    f" ({adapters.adapter_summary(self.peft_config)})" if self.peft_config else "",
                    self.outer.numel * element,
                    self.outer.settings.dtype,
                )
        return self.optimizer

    def _replica_loader(self, dataset, batch_size, shuffle, description):
        """A dataloader over this replica's shard: both stages of a replica get the same batches."""
        if isinstance(dataset, TokenStream):
            return self._stream_loader(dataset, batch_size, training=shuffle)
        dataset = self._remove_unused_columns(dataset, description=description)
        workers = self.args.dataloader_num_workers
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=shuffle and self.args.dataloader_drop_last,
            collate_fn=self.data_collator,
            num_workers=workers,
            pin_memory=self.args.dataloader_pin_memory and self.args.device.type == "cuda",
            # the Trainer's own loader options, which only apply with worker processes
            persistent_workers=self.args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=self.args.dataloader_prefetch_factor if workers > 0 else None,
            multiprocessing_context=self.args.dataloader_multiprocessing_context if workers > 0 else None,
            in_order=self.args.dataloader_in_order,
        )
        return prepare_data_loader(
            loader,
            self.args.device,
            num_processes=self.mesh.num_replicas,
            process_index=self.mesh.replica,
            put_on_device=True,
            use_seedable_sampler=shuffle,
            data_seed=self.args.data_seed or self.args.seed,
            even_batches=shuffle,
        )

    def _stream_loader(self, stream: TokenStream, batch_size: int, training: bool) -> DataLoader:
        """This replica's shard of a stream, read in this process (its position must be this process's to
        record). Training reads the stream on the first and last stage, the only ones that use the batch's
        tensors; the stages between get rows of the same shape. Evaluation reads it on every stage (it is
        short
        and ends), starting over each time. Tensors stay on the CPU: the pipeline moves what it uses."""
        mesh = self.mesh
        if training:
            if self._train_stream is None:
                reads = mesh.is_first_stage or mesh.is_last_stage
                self._train_stream = stream.shard(mesh.replica, mesh.num_replicas, read=reads)
            if self._stream_position is not None:
                self._train_stream.load_state_dict(self._stream_position)
                self._stream_position = None
            shard = self._train_stream
        else:
            shard = stream.shard(mesh.replica, mesh.num_replicas)
        return DataLoader(shard, batch_size=batch_size, collate_fn=self.data_collator, num_workers=0)

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("NoLoCoTrainer.train() needs a train_dataset.")
        return self._replica_loader(self.train_dataset, self._train_batch_size, True, "training")

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset.")
        return self._replica_loader(dataset, self.args.per_device_eval_batch_size, False, "evaluation")

    # ---------------------------------------------------------------------------------------- training

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """The Trainer's ``train``. ``resume_from_checkpoint`` is a checkpoint folder or ``True`` (the newest
        checkpoint in ``output_dir`` that verifies); either way every file a rank reads is checked against the
        checkpoint's checksums on every rank before any rank trains.

        Workers that a launcher restarted after a worker of the job failed (``torchrun --max-restarts N``,
        ``accelerate launch --max_restarts N``) resume from the newest intact checkpoint in ``output_dir`` by
        themselves, or start over when the failed attempt saved none."""
        restarted = not resume_from_checkpoint and _agreed_restart()
        if restarted:
            logger.warning(
                "%s: a restart of this job: resuming from the newest intact checkpoint in %s, if any.",
                self.mesh.describe(),
                self.args.output_dir,
            )
            resume_from_checkpoint = True
        if not resume_from_checkpoint and checkpoint.checkpoints_in(self.args.output_dir):
            raise ValueError(
                f"{self.args.output_dir} already holds checkpoints of a run. Resume it with "
                "resume_from_checkpoint=True, or choose another output_dir."
            )
        try:
            if resume_from_checkpoint:
                if resume_from_checkpoint is not True:
                    self._check_mesh_first(resume_from_checkpoint)
                with self._patient():  # hashing a large checkpoint may take longer than p2p_timeout
                    resume_from_checkpoint = checkpoint.resolve_resume(
                        self.args.output_dir, resume_from_checkpoint, self.mesh
                    )
                if resume_from_checkpoint is None and not restarted:  # a restart before any save starts over
                    raise ValueError(
                        f"resume_from_checkpoint=True: {self.args.output_dir} holds no checkpoint."
                    )
                if restarted and self.mesh.rank == 0:
                    logger.warning(
                        "Restarted job: %s",
                        f"resuming {resume_from_checkpoint}."
                        if resume_from_checkpoint
                        else "no checkpoint yet, starting over.",
                    )
            result = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
            if self.outer is not None:  # an overlapped outer step still in flight: apply it now
                self.outer.finish_outer_step()
            return result
        except ReplicaDropped:
            self.close_watchers()
            raise
        except Exception as exc:  # re-raised, with the job's first failure added
            error = self._with_root_cause(exc)
            self.watch.close()  # the diagnosis is done: no more heartbeats, and a clean exit
            if _is_communication_error(exc):
                self.watch.hold_store_at_exit()
            if error is exc:
                raise
            raise error from exc

    def _check_mesh_first(self, folder: str) -> None:
        """A checkpoint of another mesh is a likelier mistake than a damaged one: when its mesh record reads,
        say that first (the same on every rank: they read the same file). Damage is the checksums' job."""
        with contextlib.suppress(OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            checkpoint.check_mesh_record(folder, self._mesh_record())

    def _with_root_cause(self, exc: Exception) -> Exception:
        """Records this failure as the job's first unless another rank's came first. A communication error
        comes
        back as a PeerError that names the peers that stopped responding, or the first failure of the job."""
        mine = f"{self.mesh.describe()}: {type(exc).__name__}: {exc}"[:4000]
        communication = _is_communication_error(exc)
        first = self.watch.diagnose(
            mine, self.mesh.describe_rank, find_lost=communication, timeout=min(self.args.p2p_timeout, 5.0)
        )
        if first is None or not communication or first == mine:
            return exc
        if first.startswith(mine):  # this rank was first: its message plus the peers it lost
            return PeerError(first)
        return PeerError(f"{mine}\nThe first failure in this job was on {first}")

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.live is None:
            return self._training_step(inputs)
        # on_replica_loss="continue": every step starts together (a pending change of the live replicas takes
        # effect here); a lost peer during the step skips it on this rank (membership.py).
        self.live.fence()
        counters = (self.engine.step_index, self.engine.samples_seen)
        try:
            return self._training_step(inputs)
        except PeerError as exc:
            return self._skip_interrupted_step(exc, counters, inputs)

    def _skip_interrupted_step(self, exc: PeerError, counters: tuple[int, int], inputs) -> torch.Tensor:
        """The rest of a step whose communication failed under ``on_replica_loss="continue"``: its gradients
        are dropped (the optimizer then leaves the weights and its state untouched, as ``nonfinite="skip"``
        does), the routing counters advance as if it had run, and the logged loss leaves the step out."""
        step = self.state.global_step + 1
        self.live.failed(exc, step)
        self.engine.step_index = counters[0] + 1
        self.engine.samples_seen = counters[1] + inputs["input_ids"].shape[0]
        for p in self.model.parameters():
            p.grad = None
        self._grad_norm = torch.zeros((), device=self.args.device)
        self._skipped_since_log += 1
        if self.mesh.is_first_stage:
            logger.warning("%s: step %d skipped: the live replicas are changing.", self.mesh.describe(), step)
        return torch.zeros((), device=self.args.device)

    def _on_live_replicas_changed(self, live: list[int]) -> None:
        """A new view of the live replicas takes effect (on every live rank, at a fence): new process groups
        among them, and routing drawn over them (gossip draws over ``mesh.live_replicas`` by itself)."""
        self.mesh.regroup(live)
        args = self.args
        self.engine.router = Router(
            self.mesh.num_replicas, args.routing, args.routing_seed, live=self.mesh.live_replicas
        )
        self._set_collective_timeout(args.p2p_timeout)

    def _training_step(self, inputs) -> torch.Tensor:
        self.model.train()
        result = self.engine.train_step(inputs)
        self.outer.reduce_gradients()  # ddp: first, so the tied sum below adds replica-averaged gradients
        self.tied.sum_gradients()
        steps = self.args.torch_empty_cache_steps
        if steps is not None and (self.state.global_step + 1) % steps == 0:
            clear_device_cache()
        loss = result.loss if result.loss is not None else torch.zeros((), device=self.args.device)
        # One all-reduce over the column carries [loss (from the last stage), squared grad norm of each
        # stage]: every rank then reports its column's loss (the Trainer's mean over ranks is the replicas'
        # mean), clips by the column norm and knows where a NaN/inf came from, without a collective of its
        # own.
        stats = torch.zeros(1 + self.mesh.num_stages, dtype=torch.float32, device=self.args.device)
        stats[0] = loss.detach().float()
        mirrored = self.model.mirrored_names  # the tied weight's second copy: counted on the first stage
        for name, p in self.model.named_parameters():
            if p.grad is not None and name not in mirrored:
                # in float32, without a float32 copy of a bf16 gradient (1 GiB for an 8B model's embeddings)
                stats[1 + self.mesh.stage] += squared_norm(p.grad)
        if self.mesh.num_stages > 1:
            work = dist.all_reduce(stats, group=self.mesh.column_group, async_op=True)
            wait_collective(
                work,
                self.args.p2p_timeout,
                f"{self.mesh.describe()}, step {self.state.global_step + 1}: "
                f"all-reduce of the loss and gradient norms over replica {self.mesh.replica}'s column "
                f"({self.mesh.describe_ranks(self.mesh.column_ranks())})",
            )
        self._grad_norm = stats[1:].sum().sqrt()
        self.tokens_seen += inputs["input_ids"].numel() * self.mesh.num_live_replicas
        if not bool(torch.isfinite(stats).all()):
            self._on_nonfinite(stats)
        return stats[0]

    def _on_nonfinite(self, stats: torch.Tensor) -> None:
        """Every rank of the column sees the same ``stats``, so they all take the same decision here. Other
        columns are unaffected: under "skip" their outer-step counters stay aligned (see below), under "error"
        they fail within p2p_timeout on their next message to this column, naming this error."""
        replica, last = self.mesh.replica, self.mesh.num_stages - 1
        step = self.state.global_step + 1
        problems = []
        if not math.isfinite(stats[0].item()):
            problems.append(
                f"a non-finite loss ({stats[0].item()}) on stage {last}, replica {replica} "
                f"(rank {self.mesh.rank_of(replica, last)})"
            )
        bad = [s for s in range(self.mesh.num_stages) if not math.isfinite(stats[1 + s].item())]
        if bad:
            problems.append(
                "non-finite gradients on "
                + ", ".join(
                    f"stage {s}, replica {replica} (rank {self.mesh.rank_of(replica, s)})" for s in bad
                )
            )
        what = f"Step {step}: " + " and ".join(problems)
        if self.args.nonfinite == "error":
            raise FloatingPointError(
                f"{what}. Stopping (nonfinite='error'); the checkpoints already written are complete: resume "
                "from "
                "the last one (perhaps with a lower learning rate), or set nonfinite='skip' to skip such "
                "steps."
            )
        # Skip: drop the gradients. Optimizers leave a parameter without a gradient (and its state) untouched,
        # while OuterOptimizer.step() still counts the step, so outer steps stay aligned with the other
        # replicas.
        for p in self.model.parameters():
            p.grad = None
        if self.mesh.is_first_stage:  # one warning per column
            logger.warning("%s. Skipping this step on replica %d (nonfinite='skip').", what, replica)

    def _column_grad_norm(self) -> torch.Tensor:
        if self._grad_norm is None:  # only outside the training loop: training_step computes it
            raise RuntimeError("The column gradient norm is computed by training_step.")
        return self._grad_norm

    def _clip_grad_norm(self, model):
        norm = self._column_grad_norm()
        scale = torch.clamp(self.args.max_grad_norm / (norm + 1e-6), max=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
        return norm

    def _get_grad_norm(self, model, grad_norm=None):
        return (grad_norm if grad_norm is not None else self._column_grad_norm()).item()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds NoLoCo's metrics to training logs. Runs on every rank, so collectives are safe here."""
        if "loss" in logs and self.outer is not None:
            step = self.state.global_step
            steps = self.args.divergence_steps
            if steps is not None and step - self._last_divergence_step >= steps:
                logs.update(self._divergence())
                self._last_divergence_step = step
            stats = torch.tensor(
                [
                    self.outer.last_divergence_estimate or 0.0,
                    float(self.outer.last_divergence_estimate is not None),
                    float(self.outer.bytes_sent),
                ],
                dtype=torch.float64,
                device=self.args.device,
            )
            ranks = self._live_sum(
                stats, f"{self.mesh.describe()}, step {step}: all-reduce of the logging statistics"
            )
            if stats[1] > 0:
                logs["replica_divergence_estimate"] = (stats[0] / stats[1]).item()
            logs["outer_bytes_sent_per_rank"] = (stats[2] / ranks).item()
            last_tokens, last_time = self._last_log
            now = time.monotonic()
            logs["tokens_seen"] = self.tokens_seen
            logs["tokens_per_second"] = (self.tokens_seen - last_tokens) / max(now - last_time, 1e-9)
            self._last_log = (self.tokens_seen, now)
        if self._train_stream is not None and self.state.max_steps:
            # A stream has no length: the Trainer's epoch is the fraction of max_steps, which it would restart
            # from 0 after a resume (it skips no batches then).
            self.state.epoch = self.state.global_step / self.state.max_steps
        super().log(logs, start_time)

    def _divergence(self) -> dict[str, float]:
        """:func:`~hf_noloco.metrics.replica_divergence` over the live replicas; under
        ``on_replica_loss="continue"`` none while they are changing (or if one is lost meanwhile)."""
        if self.live is None:
            return replica_divergence(self.model, self.mesh)
        if self.live.offline:
            return {}
        try:
            return replica_divergence(self.model, self.mesh)
        except Exception as exc:
            if not _is_communication_error(exc):
                raise
            self.live.failed(exc, self.state.global_step)
            return {}

    def _live_sum(self, tensor: torch.Tensor, what: str) -> int:
        """Sums ``tensor`` in place over every live rank; returns how many ranks it summed over. Under
        ``on_replica_loss="continue"``, while the live replicas are changing (or if a rank is lost during this
        very collective), the sum is this rank's own value alone."""
        ranks = len(self.mesh.live_ranks())
        if self.live is not None and self.live.offline:
            return 1
        try:
            work = dist.all_reduce(tensor, group=self.mesh.world_group, async_op=True)
            wait_collective(work, self.args.p2p_timeout, f"{what} over the {ranks} live ranks")
        except PeerError as exc:
            if self.live is None:
                raise
            self.live.failed(exc, self.state.global_step)
            return 1
        return ranks

    def _maybe_log_save_evaluate(
        self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
    ):
        # The Trainer averages the logged loss with an all_gather over the default group, which holds the lost
        # ranks once on_replica_loss="continue" dropped some: the same average here, over the live ranks.
        # Steps a rank skipped (a replica lost meanwhile) added 0 to its loss and are left out of the mean.
        window = self.state.global_step - self._globalstep_last_logged
        if self.live is not None and self.control.should_log and window > 0:
            stats = torch.tensor(
                [tr_loss.item(), window - self._skipped_since_log],
                dtype=torch.float64,
                device=self.args.device,
            )
            self._live_sum(stats, f"{self.mesh.describe()}: all-reduce of the training loss")
            loss = (stats[0] / stats[1]).item() if stats[1] > 0 else float("nan")
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

    def store_flos(self) -> None:
        if self.live is None:
            return super().store_flos()
        flos = torch.tensor([float(self.current_flos)], dtype=torch.float64, device=self.args.device)
        self._live_sum(flos, f"{self.mesh.describe()}: all-reduce of the floating-point operations")
        self.state.total_flos += flos.item()
        self.current_flos = 0

    # -------------------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Perplexity pooled over all replicas' shards, each replica column evaluated as one model (fixed
        routing). Also the exact replica divergence, unless ``divergence_steps`` schedules it elsewhere.
        Under ``on_replica_loss="continue"`` the live replicas are evaluated, and an evaluation that a lost
        replica interrupts returns ``{}``."""
        if self.live is None:
            return self._evaluate_pipeline(eval_dataset, metric_key_prefix)
        try:
            self.live.barrier()
            return self._evaluate_pipeline(eval_dataset, metric_key_prefix)
        except Exception as exc:
            if not _is_communication_error(exc):
                raise
            self.live.failed(exc, self.state.global_step)
            self.model.train()
            logger.warning("%s: evaluation skipped: the live replicas are changing.", self.mesh.describe())
            return {}

    def _evaluate_pipeline(self, eval_dataset, metric_key_prefix: str) -> dict[str, float]:
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        start = time.monotonic()
        loader = self.get_eval_dataloader(eval_dataset)
        self.callback_handler.eval_dataloader = loader  # the progress bar's length (shown on rank 0)
        for batch in loader:
            loss_sum, tokens = self.engine.eval_step(batch)
            totals += torch.tensor([loss_sum, tokens], dtype=torch.float64, device=totals.device)
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        if self.mesh.num_live_replicas > 1:
            work = dist.all_reduce(totals, group=self.mesh.replica_group, async_op=True)
            wait_collective(
                work, self.args.p2p_timeout, f"{self.mesh.describe()}: all-reduce of the evaluation loss"
            )
        loss_sum, tokens = totals.tolist()
        metrics = {
            f"{metric_key_prefix}_loss": loss_sum / max(tokens, 1),
            f"{metric_key_prefix}_perplexity": perplexity(loss_sum, max(tokens, 1)),
            f"{metric_key_prefix}_tokens": int(tokens),
            f"{metric_key_prefix}_runtime": time.monotonic() - start,
        }
        if self.args.divergence_steps is None:
            metrics.update(self._divergence())
        self.model.train()
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, *args, **kwargs):
        raise NotImplementedError(
            "NoLoCoTrainer does not support predict(); export the model and use it directly."
        )

    # ------------------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial):
        """Every rank writes its stage replica; the folder appears only once all are done (see
        :mod:`hf_noloco.checkpoint`)."""
        self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        best = self.state.best_global_step  # set by the Trainer when metric_for_best_model improves
        if best and self.args.save_strategy in ("steps", "epoch", "best"):
            folder = os.path.join(run_dir, f"{checkpoint.PREFIX_CHECKPOINT_DIR}-{best}")
            if best == self.state.global_step or os.path.isdir(folder):
                self.state.best_model_checkpoint = folder  # recorded, and kept by save_total_limit
        if self.live is not None and self.live.offline:
            logger.warning(
                "%s: checkpoint-%d not written: the live replicas are changing.",
                self.mesh.describe(),
                self.state.global_step,
            )
            return
        with self._patient():  # writing files may take longer than p2p_timeout
            try:
                checkpoint.write_checkpoint(
                    run_dir,
                    self.state.global_step,
                    self.mesh,
                    self._write_rank_state,
                    self._write_run_state,
                    timeout=self.args.ddp_timeout,
                    save_total_limit=self.args.save_total_limit,
                    best_model_checkpoint=self.state.best_model_checkpoint,
                    barrier=self.live.barrier if self.live is not None else None,
                )
            except PeerError as exc:
                if self.live is None:
                    raise
                self.live.failed(exc, self.state.global_step)
                logger.warning(
                    "%s: checkpoint-%d not completed: a replica was lost while it was written.",
                    self.mesh.describe(),
                    self.state.global_step,
                )

    def _write_rank_state(self, folder: str) -> list[str]:
        pipeline_state = {"engine": self.engine.state_dict(), "tokens_seen": self.tokens_seen}
        if self._train_stream is not None:
            pipeline_state["stream"] = self._train_stream.state_dict()
        checkpoint.save_rank_state(
            folder,
            self.mesh,
            self.model,
            self.optimizer.state_dict(),
            pipeline_state,
            trainable_only=self.peft_config is not None,
        )
        self._save_rng_state(folder)
        # The Trainer's name for this process's RNG file (beside the rank folders): recorded in its checksums.
        return ["rng_state.pth" if self.args.world_size <= 1 else f"rng_state_{self.args.process_index}.pth"]

    def _write_run_state(self, folder: str) -> None:
        for callback in self.callback_handler.callbacks + [self.control]:
            if hasattr(callback, "state") and callable(callback.state):
                self.state.stateful_callbacks[type(callback).__name__] = callback.state()
        self.state.save_to_json(os.path.join(folder, "trainer_state.json"))
        torch.save(self.lr_scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
        self.model.config.to_json_file(os.path.join(folder, "config.json"))
        checkpoint.write_mesh_record(folder, self._mesh_record())

    def _mesh_record(self) -> dict:
        record = {
            "pipeline_stages": self.mesh.num_stages,
            "num_replicas": self.mesh.num_replicas,
            "layer_ranges": [list(r) for r in self.model.all_layer_ranges],
            "outer_optimizer": self.args.outer_optimizer,
            "routing": self.args.routing,
            "adapter": adapters.adapter_record(self.peft_config),
        }
        if self.mesh.num_live_replicas < self.mesh.num_replicas:
            record["live_replicas"] = list(self.mesh.live_replicas)
        return record

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        checkpoint.check_mesh_record(resume_from_checkpoint, self._mesh_record())
        state = checkpoint.load_rank_state(
            resume_from_checkpoint, self.mesh, self.model, trainable_only=self.peft_config is not None
        )
        self.tied.check_equal()
        self.engine.load_state_dict(state["engine"])
        if state.get("stream") is not None:
            if self._train_stream is not None:
                self._train_stream.load_state_dict(state["stream"])
            else:
                self._stream_position = state["stream"]
        self.tokens_seen = state["tokens_seen"]
        self._last_log = (self.tokens_seen, time.monotonic())

    def _load_optimizer_and_scheduler(self, folder):
        if folder is None:
            return
        self.optimizer.load_state_dict(checkpoint.load_optimizer_state(folder, self.mesh))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(folder, "scheduler.pt"), weights_only=True))

    # ------------------------------------------------------------------------------------------ export

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Exports the consensus model (or ``export_replica``) as one ordinary HF checkpoint with a model card
        and training curves. Collective: every rank calls it. Under ``on_replica_loss="continue"`` the
        consensus is over the live replicas, and a replica lost during the export makes the others start it
        again (up to three times)."""
        if self.live is None:
            return self._export(output_dir)
        for _ in range(3):
            self.live.fence()  # a pending change of the live replicas takes effect first
            try:
                return self._export(output_dir)
            except Exception as exc:
                if not _is_communication_error(exc):
                    raise
                self.live.failed(exc, self.state.global_step)
                logger.warning(
                    "%s: export interrupted by a lost replica; starting it again.", self.mesh.describe()
                )
        raise PeerError(f"{self.mesh.describe()}: the export was interrupted three times by lost replicas.")

    def _export(self, output_dir: str | None) -> None:
        output_dir = output_dir or self.args.output_dir
        if self.peft_config is not None:
            self._save_adapter_export(output_dir)
            return
        with self._patient():  # rank 0 writes the whole model while the others wait
            path = save_consensus_checkpoint(
                self.model,
                self.mesh,
                self.export_config,
                output_dir,
                tokenizer=self.processing_class,
                generation_config=self.base_generation_config,
                replica=self.args.export_replica,
                dtype=getattr(torch, self.args.export_dtype) if self.args.export_dtype else None,
                trust_remote_code=(self.args.model_init_kwargs or {}).get("trust_remote_code", False),
            )
            if path is not None:
                self._write_model_card(output_dir)
            self._barrier()

    def _save_adapter_export(self, output_dir: str) -> None:
        """The consensus adapters (or ``export_replica``'s) as a PEFT adapter folder, or merged into the base
        model (``merge_adapter``), with the tokenizer and the model card. Collective: every rank calls it."""
        with self._patient():
            consensus = adapters.consensus_adapters(self.model, self.mesh, replica=self.args.export_replica)
            first_column = self.mesh.replica == self.mesh.live_replicas[0]
            full = gather_full_state_dict(consensus if first_column else None, self.mesh)
            if self.mesh.is_leader:
                if self.args.merge_adapter:
                    adapters.save_merged(output_dir, full, self.peft_config, self.base_model_folder)
                else:
                    adapters.save_adapter(output_dir, full, self.peft_config, self.base_model)
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                self._write_model_card(output_dir)
            self._barrier()

    def _barrier(self) -> None:
        """Waits for every live rank (through the store under ``on_replica_loss="continue"``)."""
        if self.live is not None:
            self.live.barrier()
        else:
            dist.barrier(group=self.mesh.world_group)

    def run_settings(self) -> dict:
        """The run's settings as the model card and the wandb run show them."""
        args, outer = self.args, self.args.outer_settings
        settings = {
            "outer_optimizer": outer.method,
            "pipeline_stages": self.mesh.num_stages,
            "layer_ranges": [f"{a}-{b - 1}" for a, b in self.model.all_layer_ranges],
            "num_replicas": self.mesh.num_replicas,
            "on_replica_loss": args.on_replica_loss,
            "live_replicas": self.mesh.num_live_replicas if self.live is not None else None,
            "inner_steps": outer.inner_steps,
            "outer_lr": outer.outer_lr,
            "outer_momentum": outer.outer_momentum,
            "outer_averaging": outer.outer_averaging,
            "gossip_group_size": outer.group_size if outer.method == "noloco" else None,
            "outer_dtype": outer.dtype if outer.has_outer_step else None,
            "routing": args.routing,
            "routing_domain": args.routing_domain,
            "routing_group_size": args.resolved_routing_group_size(self.mesh.num_replicas),
            "outer_overlap_steps": outer.overlap_steps if outer.has_outer_step else None,
            "pipeline_schedule": args.pipeline_schedule,
            "microbatch_size": args.resolved_microbatch_size(),
            "global_batch_size": self.get_total_train_batch_size(args),
            "block_size": self.data_args.block_size if self.data_args else None,
            "max_steps": self.state.max_steps or args.max_steps,
            "optimizer": args.optim,
            "learning_rate": args.learning_rate,
            "lr_scheduler_type": args.lr_scheduler_type,
            "warmup_steps": args.warmup_steps,
            "weight_decay": args.weight_decay,
            "max_grad_norm": args.max_grad_norm,
            "mixed_precision": "bf16" if args.bf16 else "no",
            "weights_dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "activation_checkpointing": bool(args.activation_checkpointing),
            "loss_chunk_tokens": args.loss_chunk_tokens,
            "tied_embeddings": ties_embeddings(self.model.config),
            "seed": args.seed,
            "export_replica": args.export_replica,
            "adapter": adapters.adapter_summary(self.peft_config) if self.peft_config else None,
            "export": self.export_kind,
        }
        return {k: getattr(v, "value", v) for k, v in settings.items()}

    @property
    def export_kind(self) -> str:
        """What ``save_model`` writes: ``"model"``, ``"adapter"`` (PEFT) or ``"merged"`` (adapters merged)."""
        if self.peft_config is None:
            return "model"
        return "merged" if self.args.merge_adapter else "adapter"

    def _evaluation_split(self) -> str | None:
        split = getattr(self.eval_dataset, "split", None)
        if split is None:
            return None
        # A dataset without a validation split is evaluated on documents held out of "train"
        # (data.load_splits).
        return "train (held-out documents)" if str(split) == "train" else str(split)

    def _write_model_card(self, output_dir: str) -> None:
        history = self.state.log_history
        last = lambda key: next((e[key] for e in reversed(history) if key in e), None)
        plot = plot_training_curves(history, os.path.join(output_dir, PLOT_FILE)) if history else None
        data = self.data_args or DataArguments()
        render_model_card(
            output_dir,
            base_model=self.base_model,
            dataset=data.dataset_name,
            dataset_config=data.dataset_config,
            dataset_split=self._evaluation_split(),
            settings=self.run_settings(),
            final_perplexity=last("eval_perplexity"),
            replica_divergence=last("replica_divergence"),
            tokens_seen=self.tokens_seen,
            plot_file=plot,
            repo_id=self.hub_model_id,
            base_model_folder=self.base_model_folder,
            wandb_url=_wandb_url(),
        )

    def create_model_card(self, *args, **kwargs):
        if self.is_world_process_zero():
            self._write_model_card(self.args.output_dir)

    def init_hf_repo(self, token=None, private=None):
        """Checks the push settings on every rank before training; the repo is created when pushing."""
        self.hub_model_id = check_hub_settings(True, self.args.hub_model_id, token or self.args.hub_token)

    def _push_from_checkpoint(self, checkpoint_folder):
        pass  # checkpoints are per-rank shards; only the exported model is pushed

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token=None,
        revision=None,
        **kwargs,
    ) -> str | None:
        """Exports to ``output_dir`` (collective) and uploads it from rank 0."""
        self.save_model(self.args.output_dir)
        url = None
        with self._patient():  # the others wait while rank 0 uploads
            if self.mesh.is_leader:
                url = push_folder_to_hub(
                    self.args.output_dir,
                    self.hub_model_id or self.args.hub_model_id,
                    token=token or self.args.hub_token,
                    private=self.args.hub_private_repo,
                    commit_message=commit_message or "End of training",
                    revision=revision or self.args.hub_revision,
                )
            self._barrier()
        return url

    def close_watchers(self) -> None:
        """Stops the heartbeat (and, under ``on_replica_loss="continue"``, the membership watch)."""
        if self.live is not None:
            self.live.close()
        self.watch.close()

    # --------------------------------------------------------------------------------- timeouts

    def _set_collective_timeout(self, seconds: float) -> None:
        """Sets the timeout of every process group this rank uses (see :func:`~hf_noloco.comm.group_timeout`:
        under NCCL a margin beyond ``seconds``, so that our own bounded waits fail first and name the peer).
        """
        timeout = group_timeout(dist.get_backend(), seconds)
        groups = (None, self.mesh.world_group, self.mesh.replica_group, self.mesh.column_group)
        for group in dict.fromkeys(groups):  # None: the default group
            dist.distributed_c10d._set_pg_timeout(timeout, group)

    @contextlib.contextmanager
    def _patient(self):
        """Collectives inside wait up to ``ddp_timeout`` (set-up, checkpoint and export I/O), then p2p_timeout
        again."""
        self._set_collective_timeout(self.args.ddp_timeout)
        try:
            yield
        finally:
            self._set_collective_timeout(self.args.p2p_timeout)

    def end(self):
        """Finishes the wandb run (the Trainer never does) and destroys the process group."""
        if self.is_world_process_zero():
            try:
                import wandb

                if wandb.run is not None:
                    wandb.finish()
            except ImportError:
                pass
        if self.live is not None:
            with contextlib.suppress(PeerError):  # a rank lost at the very end: nothing left to wait for
                self.live.barrier()
        elif dist.is_initialized():
            dist.barrier()
        self.close_watchers()
        super().end()
        # Not after a replica was lost: tearing down groups that hold operations given up on (a wait still
        # blocked in gloo) aborted the process with "terminate called without an active exception" in 2 of 3
        # recipe runs; the process exits without it (0 of 2).
        if dist.is_initialized() and not (self.live is not None and self.live.view > 0):
            dist.destroy_process_group()


def _check_adapter_inputs(model, args: NoLoCoConfig, peft_config) -> None:
    if peft_config is None:
        if args.merge_adapter:
            raise ValueError("merge_adapter=True merges LoRA adapters: it needs use_peft (a peft_config).")
        return
    if args.on_replica_loss == "continue":
        raise ValueError("on_replica_loss='continue' does not support LoRA adapters (use_peft) yet.")
    if type(peft_config).__name__ != "LoraConfig":
        raise TypeError(f"peft_config must be a peft.LoraConfig, got {type(peft_config).__name__}.")
    if not isinstance(model, str):
        raise ValueError(
            "LoRA adapters fine-tune a pretrained checkpoint: pass its Hub id or folder as the model (the "
            "export refers to it, and merge_adapter reads its weights)."
        )


def _check_streams(train_dataset, args: NoLoCoConfig) -> None:
    if not isinstance(train_dataset, TokenStream):
        return
    if args.max_steps <= 0:
        raise ValueError("A streamed training set has no length: set max_steps.")
    if args.dataloader_num_workers:
        raise ValueError(
            "A streamed training set is read in the training process (its position goes into checkpoints): "
            "set dataloader_num_workers=0."
        )


def _ensure_process_group(args: NoLoCoConfig) -> None:
    """Accelerate initialises the process group when launched; a plain ``python script.py`` gets a
    one-process gloo group so that the same code paths run."""
    args._setup_devices  # noqa: B018 - initialises torch.distributed under accelerate/torchrun
    if not dist.is_initialized():
        from .local_launch import free_port

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=args.ddp_timeout),
        )


def _agreed_restart() -> bool:
    """Whether a launcher's agent restarted this job's workers, the same answer on every rank: each agent
    counts its own restarts, so one node's workers may not know that the job restarted (elastic.py)."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) == 0:
        return False  # no agent that restarts workers: no collective
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, elastic.is_restart())
    return any(views)


def _is_communication_error(exc: BaseException) -> bool:
    """A lost or stuck peer, as our waits report it (PeerError) or as gloo/NCCL do (RuntimeErrors)."""
    if isinstance(exc, (PeerError, dist.DistError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text
        for mark in (
            "Connection closed",
            "Connection reset",
            "Timed out",
            "timed out",
            "monitoredBarrier",
            "NCCL",
            "Socket",
        )
    )


def _wandb_url() -> str | None:
    """The page of this process's wandb run, if it has one online."""
    try:
        import wandb
    except ImportError:
        return None
    run = wandb.run
    return None if run is None or run.settings._offline else run.url


class _RunConfigCallback(TrainerCallback):
    """Adds the mesh, routing, outer and data settings to the wandb run's config (the Trainer's own callback
    records the TrainingArguments and the model config), and says how wandb summarises NoLoCo's metrics."""

    def __init__(self, trainer: NoLoCoTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or "wandb" not in (args.report_to or []):
            return
        import wandb

        if wandb.run is None:
            return
        data = self.trainer.data_args
        wandb.run.config.update(
            {"noloco": self.trainer.run_settings(), "data": dataclasses.asdict(data) if data else None},
            allow_val_change=True,
        )
        wandb.define_metric("eval/perplexity", summary="min")
        wandb.define_metric("train/replica_divergence*", summary="last")
