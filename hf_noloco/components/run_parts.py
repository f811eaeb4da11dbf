"""The parts of a run, built once, in order, from the config and the model, before the Trainer's own set-up:
the process mesh, this process's stage, the pipeline engine, the tied-embeddings sync, the loaders, the
replica-loss policy and the components the trainer delegates to. :class:`RunParts` holds them;
:func:`build_run_parts` is the one place that knows the order they need (written out there, step by step).

The Trainer's own objects, which it makes later (the optimizer and scheduler, in ``train``) or replaces (its
state), are in :class:`~hf_noloco.components.run_state.RunState`, which every part that reads them holds.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from hf_noloco.adapters.settings import adapter_record, adapter_summary
from hf_noloco.adapters.stage import add_adapters, trainable_state_dict
from hf_noloco.components.capacity_balance import CapacityBalance
from hf_noloco.components.checkpointer import RunCheckpointer
from hf_noloco.components.evaluation import Evaluation
from hf_noloco.components.exporter import Exporter
from hf_noloco.components.inputs import check_dataset_size, proof_forms
from hf_noloco.components.loaders import ReplicaLoaders
from hf_noloco.components.metrics import PredictionStats, Throughput
from hf_noloco.components.run_record import RunRecord, finish_wandb
from hf_noloco.components.run_state import RunState
from hf_noloco.components.training_logs import TrainingLogs
from hf_noloco.components.training_step import TrainingStep
from hf_noloco.config import NoLoCoConfig
from hf_noloco.data.arguments import DataArguments
from hf_noloco.engine.fidelity import verify_split
from hf_noloco.engine.loading import BuiltStage, keep_float32_masters, stage_from_source, weights_dtype
from hf_noloco.engine.mesh import PipelineMesh, ensure_process_group
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.routing import Router
from hf_noloco.engine.stage import PipelineStage
from hf_noloco.engine.tied import TiedEmbeddings
from hf_noloco.outer.compression import wire_bytes
from hf_noloco.outer.optimizer import OuterOptimizer, broadcast_replica_weights
from hf_noloco.resilience.authentication import recipe_digest
from hf_noloco.resilience.live_replicas import LiveReplicas
from hf_noloco.resilience.policy import ReplicaLossPolicy, replica_loss_policy
from hf_noloco.resilience.preemption import Preemption

logger = logging.getLogger(__name__)


@dataclass
class RunInputs:
    """What the user handed the trainer besides the model and the config."""

    train_dataset: object = None
    eval_dataset: object = None
    tokenizer: object = None
    collate_fn: Callable | None = None
    data_args: DataArguments | None = None
    user_collator: bool = False  # the collator is the user's (then the rows' forms are unknown)
    peft_config: object = None  # a peft.LoraConfig


@dataclass
class RunParts:
    """Everything a :class:`~hf_noloco.NoLoCoTrainer` run is made of besides the Trainer itself."""

    args: NoLoCoConfig
    mesh: PipelineMesh
    source: BuiltStage  # the stage, and what the export carries from the model it came from
    peft_config: object  # the LoraConfig with its target modules resolved, or None
    tied: TiedEmbeddings
    engine: PipelineEngine
    loaders: ReplicaLoaders
    throughput: Throughput
    run: RunState
    checkpointer: RunCheckpointer
    live_replicas: LiveReplicas
    replica_loss: ReplicaLossPolicy
    preemption: Preemption
    record: RunRecord
    exporter: Exporter
    step: TrainingStep
    logs: TrainingLogs
    evaluation: Evaluation

    ended: bool = False  # NoLoCoTrainer.end() ran

    @property
    def stage(self) -> PipelineStage:
        return self.source.stage

    def end_at_exit(self) -> None:
        """What ``NoLoCoTrainer.end()`` does, at the process's exit when nobody called it (without its
        barrier): the wandb run finished (an offline run writes its records only then), the watchers stopped,
        the process groups torn down."""
        if self.ended:
            return
        self.ended = True
        if self.args.process_index == 0:
            finish_wandb()
        self.replica_loss.close()
        self.replica_loss.tear_down()

    def wrap_optimizer(self, inner: torch.optim.Optimizer) -> OuterOptimizer:
        """The Trainer's optimizer wrapped in the outer optimizer of ``outer_optimizer``."""
        args, mesh, tied = self.args, self.mesh, self.tied
        trainable = [p for p in self.stage.parameters() if p.requires_grad]
        outer = OuterOptimizer(
            inner,
            trainable,
            mesh,
            args.outer_settings,
            p2p_timeout=args.p2p_timeout,
            tied_weight=tied.weight if tied.trains else None,
            tied_mirror=tied.is_mirror,
            tied_peer=tied.peer if tied.trains else None,
            replica_loss=self.replica_loss,
        )
        if outer.settings.has_outer_step:
            dtype, numel = outer.settings.outer_dtype, outer.numel
            lora = f" ({adapter_summary(self.peft_config)})" if self.peft_config else ""
            logger.info(
                "%s: an outer step exchanges the %d trainable parameters%s, %d bytes in %s.",
                *(mesh.describe(), numel, lora, wire_bytes(numel, dtype), dtype),
            )
        return outer


def run_recipe(args: NoLoCoConfig, source: BuiltStage, inputs: RunInputs, peft_config) -> dict:
    """What a column joining the live run must share with it, or it would train another run: the model (its
    config and source), the stage split, the outer optimizer's settings, the data (its arguments and the
    training set's size), the mesh, the routing and seeds, the batch and the steps, the adapters."""
    config = {k: v for k, v in source.stage.config.to_dict().items() if not k.startswith("_")}
    config.pop("transformers_version", None)
    data = inputs.data_args
    rows = inputs.train_dataset
    return {
        "model": config,
        "base_model": source.base_model,
        "layer_ranges": [list(r) for r in source.stage.all_layer_ranges],
        "outer": dataclasses.asdict(args.outer_settings),
        "data": dataclasses.asdict(data) if data is not None else None,
        "train_rows": len(rows) if hasattr(rows, "__len__") else None,
        "mesh": [args.pipeline_stages, args.world_size],
        "routing": [args.routing, args.routing_domain, args.routing_group_size, args.routing_seed],
        "seeds": [args.seed, args.data_seed],
        "batch": [
            args.per_device_train_batch_size,
            args.gradient_accumulation_steps,
            args.microbatch_size,
            args.max_steps,
        ],
        "adapter": adapter_record(peft_config),
    }


def _check_split(args: NoLoCoConfig, num_stages: int, forms, model, config: PretrainedConfig) -> None:
    """The start-up proof of the split, on the input forms the run feeds its stages, at its attention
    implementation and dtype."""
    init = args.model_init_kwargs or {}
    dtype = model.dtype if isinstance(model, PreTrainedModel) else weights_dtype(init.get("dtype"), config)
    verify_split(
        config,
        num_stages,
        args.stage_boundaries,
        args.stage_balance,
        args.loss_chunk_tokens,
        init.get("trust_remote_code", False),
        attn_implementation=init.get("attn_implementation"),  # None: transformers' default
        forms=forms,
        dtype=dtype,
    )


def _autocast(args: NoLoCoConfig) -> Callable[[], contextlib.AbstractContextManager]:
    """What each stage forward runs under: bf16 autocast with ``bf16``, as Accelerate's ``autocast()`` gives
    it for this device (the Trainer's own is a no-op in v5), and nothing otherwise."""
    if not args.bf16:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=args.device.type, dtype=torch.bfloat16)


def _build_stage(
    model, args: NoLoCoConfig, mesh: PipelineMesh, inputs: RunInputs
) -> tuple[BuiltStage, object]:
    """This process's stage, verified, with its LoRA adapters, master weights and compiled layers."""
    peft_config = inputs.peft_config
    forms = proof_forms(inputs.train_dataset, inputs.eval_dataset, inputs.user_collator)
    check = (
        functools.partial(_check_split, args, mesh.num_stages, forms, model) if args.verify_split else None
    )
    source = stage_from_source(
        model,
        mesh.stage,
        mesh.num_stages,
        args.device,
        args.stage_boundaries,
        args.stage_balance,
        args.seed,
        args.model_init_kwargs,
        check=None if args.joining else check,  # a joiner's split was verified by the run
    )
    stage = source.stage
    resolved = add_adapters(stage, peft_config, seed=args.seed) if peft_config else None
    if args.master_weights == "float32" and keep_float32_masters(stage):
        args.bf16, args.mixed_precision = True, "bf16"  # compute in bf16, as the weights' dtype asked
    if args.torch_compile:  # per decoder layer: the stage's own code (masks, routing) stays eager
        for layer in stage.model.layers.values():
            layer.compile(backend=args.torch_compile_backend, mode=args.torch_compile_mode)
    return source, resolved


def build_run_parts(
    model: str | PretrainedConfig | PreTrainedModel,
    args: NoLoCoConfig,
    inputs: RunInputs,
    write_rng: Callable[[str], None],
    decay_names: Callable[[nn.Module], list[str]],
) -> RunParts:
    """The run's parts, in the order they need each other (see the module). ``write_rng`` and
    ``decay_names`` are the Trainer's (its random-state files; its parameter grouping)."""
    # 1. The process group (joined by the config when launched; a plain `python script.py` gets a one-process
    #    group) and the mesh. Set-up (loading a stage, the first broadcast) may be slow on some nodes:
    #    ddp_timeout until training.
    device = args.device
    ensure_process_group(args.ddp_timeout)
    mesh = PipelineMesh.build(args.pipeline_stages, device, args.ddp_timeout, args.joining)
    # 2. The stage; every replica of it starts identical (with adapters only the adapters need to agree: every
    #    replica read the same frozen base weights), and so do the two copies of tied embeddings. A joiner's
    #    state comes from a live replica instead.
    source, peft_config = _build_stage(model, args, mesh, inputs)
    stage = source.stage
    if not args.joining:
        trained = nn.ParameterList(trainable_state_dict(stage).values()) if peft_config else stage
        broadcast_replica_weights(trained, mesh)
    tied = TiedEmbeddings(stage, mesh)
    if not args.joining:
        tied.check_equal()
    check_dataset_size(inputs.train_dataset, mesh.num_replicas * args.per_device_train_batch_size)
    # 3. The engine and what feeds it.
    router = Router(mesh.num_replicas, args.routing, args.routing_seed, group_size=args.routing_group_size)
    if router.group_size == 1 and mesh.num_replicas > 1 and args.routing != "fixed" and mesh.rank == 0:
        logger.warning(
            "routing_domain='node' with one replica column per node: no sample is routed at random (each "
            "stays in its column, as routing='fixed'). Put several columns on each node, or use "
            "routing_domain='global' for random routing across nodes."
        )
    engine = PipelineEngine(
        stage,
        mesh,
        router,
        args.microbatch_size,
        p2p_timeout=args.p2p_timeout,
        autocast=_autocast(args),
        schedule=args.pipeline_schedule,
        loss_chunk_tokens=args.loss_chunk_tokens,
        wire_dtype=torch.bfloat16 if args.bf16 else None,  # what autocast computes in: half the bytes
        loss_type=args.loss_type,
        offload_activations=args.activation_offloading,
        boundary_dtype=args.boundary_dtype,
        boundary_grad_dtype=args.boundary_grad_dtype,
        boundary_block_size=args.boundary_block_size,
        boundary_grad_stochastic_rounding=args.boundary_grad_stochastic_rounding,
    )
    loaders = ReplicaLoaders(mesh, args, inputs.collate_fn)
    throughput = Throughput(stage.config, mesh.is_first_stage, args)  # the peak FLOPS from args
    predictions = PredictionStats(mesh.is_last_stage)
    run = RunState()
    checkpointer = RunCheckpointer(
        args, mesh, stage, engine, tied, loaders, throughput, run, peft_config, write_rng, decay_names
    )
    # 4. Set-up is over: from here on no rank should wait for another longer than p2p_timeout. The
    #    replica-loss policy starts this rank's heartbeat (and admits a joining column: its state comes here).
    mesh.set_timeout(args.p2p_timeout)
    live_replicas = LiveReplicas(mesh, engine, checkpointer, args.p2p_timeout, args.ddp_timeout)
    recipe = recipe_digest(run_recipe(args, source, inputs, peft_config))  # a joiner must share it
    policy = replica_loss_policy(
        args.on_replica_loss, mesh, args.p2p_timeout, live_replicas, args.joining, args.ddp_timeout, recipe
    )
    preemption = Preemption(mesh, policy, args.enable_jit_checkpoint)  # SIGTERM: a checkpoint, then the end
    record = RunRecord(
        args,
        mesh,
        engine,
        stage,
        source,
        run,
        policy.continues,
        peft_config,
        inputs.data_args,
        inputs.train_dataset,
    )
    capacity = None
    if args.capacity_routing:
        capacity = CapacityBalance(
            mesh, engine, args.capacity_rebalance_steps, args.capacity_floor, args.p2p_timeout
        )
    logs = TrainingLogs(args, mesh, stage, run, throughput, loaders, policy, predictions, capacity)
    exporter = Exporter(
        args,
        mesh,
        stage,
        source,
        peft_config,
        policy,
        throughput,
        record,
        run,
        inputs.tokenizer,
        inputs.data_args,
        inputs.eval_dataset,
    )
    parts = RunParts(
        args,
        mesh,
        source,
        peft_config,
        tied,
        engine,
        loaders,
        throughput,
        run,
        checkpointer,
        live_replicas,
        policy,
        preemption,
        record,
        exporter,
        TrainingStep(args, mesh, stage, engine, tied, run, predictions, capacity),
        logs,
        Evaluation(args, mesh, stage, engine, logs, policy),
    )
    atexit.register(parts.end_at_exit)
    return parts
