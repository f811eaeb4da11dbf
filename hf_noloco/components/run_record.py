"""The run's settings as the model card and the wandb run show them, and the callback that gives them to
wandb.

The Trainer's own wandb callback records the ``TrainingArguments`` and the model config; this one adds the
mesh, routing, outer and data settings under ``noloco`` and ``data``, and says how wandb summarises NoLoCo's
metrics.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from transformers import TrainerCallback

from hf_noloco.adapters.settings import adapter_summary
from hf_noloco.components.run_state import RunState
from hf_noloco.config import NoLoCoConfig
from hf_noloco.data.arguments import DataArguments
from hf_noloco.data.streaming import TokenStream
from hf_noloco.engine.loading import BuiltStage
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.stage import PipelineStage, ties_embeddings


class RunRecord:
    """The settings of a :class:`~hf_noloco.NoLoCoTrainer`'s run, by option name (enums as their values), as
    the model card and the wandb run show them.

    Args:
        args: the run's config; mesh, engine, stage: its parts; source: what the stage was built from.
        run: the Trainer's objects (``max_steps`` comes from its state once training has begun).
        continues: ``on_replica_loss="continue"`` (the live replicas are recorded).
        peft_config: the LoRA adapters' config, if any; data_args: the data's options, if given.
        train_dataset: the training rows (their layout: packed, padded or wrapped).
    """

    def __init__(
        self,
        args: NoLoCoConfig,
        mesh: PipelineMesh,
        engine: PipelineEngine,
        stage: PipelineStage,
        source: BuiltStage,
        run: RunState,
        continues: bool,
        peft_config=None,
        data_args: DataArguments | None = None,
        train_dataset=None,
    ):
        self.args, self.mesh, self.engine, self.stage, self.source, self.run = (
            args,
            mesh,
            engine,
            stage,
            source,
            run,
        )
        self.continues, self.peft_config, self.data_args = continues, peft_config, data_args
        self.train_dataset = train_dataset

    @property
    def export_kind(self) -> str:
        """What ``save_model`` writes: ``"model"``, ``"adapter"`` (PEFT) or ``"merged"`` (adapters merged)."""
        if self.peft_config is None:
            return "model"
        return "merged" if self.args.merge_adapter else "adapter"

    @property
    def adapter_summary(self) -> str | None:
        return adapter_summary(self.peft_config) if self.peft_config else None

    def settings(self) -> dict:
        args, mesh, stage = self.args, self.mesh, self.stage
        outer = args.outer_settings
        has_outer = outer.has_outer_step
        state = self.run.trainer_state
        settings = {
            "outer_optimizer": outer.outer_optimizer,
            "pipeline_stages": mesh.num_stages,
            "layer_ranges": [f"{a}-{b - 1}" for a, b in stage.all_layer_ranges],
            "num_replicas": mesh.num_replicas,
            "on_replica_loss": args.on_replica_loss,
            "live_replicas": mesh.num_live_replicas if self.continues else None,
            "inner_steps": outer.inner_steps,
            "outer_lr": outer.outer_lr,
            "outer_momentum": outer.outer_momentum,
            "outer_averaging": outer.outer_averaging,
            "gossip_group_size": outer.gossip_group_size if outer.outer_optimizer == "noloco" else None,
            "outer_dtype": outer.outer_dtype if has_outer else None,
            "boundary_dtype": args.boundary_dtype,
            "boundary_grad_dtype": args.boundary_grad_dtype,
            "boundary_block_size": args.boundary_block_size,
            "boundary_grad_stochastic_rounding": args.boundary_grad_stochastic_rounding,
            "routing": args.routing,
            "routing_domain": args.routing_domain,
            "routing_group_size": self.engine.router.group_size,
            "outer_overlap_steps": outer.outer_overlap_steps if has_outer else None,
            "pipeline_schedule": args.pipeline_schedule,
            "microbatch_size": args.microbatch_size,
            "global_batch_size": args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * mesh.num_replicas,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "max_length": self.data_args.max_length if self.data_args else None,
            "packing": _row_layout(self.train_dataset),
            "max_steps": (state.max_steps if state is not None else 0) or args.max_steps,
            "optimizer": args.optim,
            "learning_rate": args.learning_rate,
            "lr_scheduler_type": args.lr_scheduler_type,
            "warmup_steps": args.warmup_steps,
            "weight_decay": args.weight_decay,
            "max_grad_norm": args.max_grad_norm,
            "mixed_precision": "bf16" if args.bf16 else "no",
            "weights_dtype": str(self.source.weights_dtype).removeprefix("torch."),
            "master_weights": args.master_weights if self.source.weights_dtype == torch.bfloat16 else None,
            "activation_checkpointing": bool(args.activation_checkpointing),
            "loss_chunk_tokens": args.loss_chunk_tokens,
            "tied_embeddings": ties_embeddings(stage.config),
            "seed": args.seed,
            "export_replica": args.export_replica,
            "adapter": self.adapter_summary,
            "export": self.export_kind,
        }
        return {k: getattr(v, "value", v) for k, v in settings.items()}

    def callback(self) -> RunConfigCallback:
        """The callback that gives these settings (and the data's) to the wandb run."""
        return RunConfigCallback(self)


def _row_layout(dataset) -> str | None:
    """How the training rows were filled, read from their columns: ``bfd`` (packed sequences with their
    position ids), ``padded`` (one document per row, with a mask) or ``wrapped``."""
    if isinstance(dataset, TokenStream):
        return "wrapped" if dataset.packing else "padded"
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return None
    if "position_ids" in columns:
        return "bfd"
    return "padded" if "attention_mask" in columns else "wrapped"


def finish_wandb() -> None:
    """Finishes this process's wandb run, if any (the Trainer never does: an offline run writes its records
    only then)."""
    wandb = sys.modules.get("wandb")  # never imported: no run (and no second spent importing it)
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def wandb_url() -> str | None:
    """The page of this process's wandb run, if it has one online."""
    wandb = sys.modules.get("wandb")
    if wandb is None:
        return None
    run = wandb.run
    # An offline run has a page only once `wandb sync` uploads it.
    return None if run is None or run.settings.mode in ("offline", "dryrun", "disabled") else run.url


class RunConfigCallback(TrainerCallback):
    """Adds :meth:`RunRecord.settings` and the data's settings to the wandb run's config."""

    def __init__(self, record: RunRecord):
        self.record = record

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or "wandb" not in (args.report_to or []):
            return
        import wandb

        if wandb.run is None:
            return
        data = self.record.data_args
        wandb.run.config.update(
            {"noloco": self.record.settings(), "data": dataclasses.asdict(data) if data else None},
            allow_val_change=True,
        )
        wandb.define_metric("eval/perplexity", summary="min")
        wandb.define_metric("train/replica_divergence*", summary="last")
