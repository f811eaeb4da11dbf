"""NoLoCoConfig: ``TrainingArguments`` plus the pipeline, routing and outer-optimizer settings, and its check.

Every ``None`` default is resolved once, in ``__post_init__``, and read from the field afterwards. The allowed
values and the rules behind the checks live in :mod:`hf_noloco.rules`, which the engine imports too, so a
recipe user and a direct Python user of the engine get the same error. The process group is joined where
``TrainingArguments`` joins it, when its device is first set up (:meth:`NoLoCoConfig._setup_devices`), and
every check runs before that, so a bad setting fails on every rank alike without waiting for a peer.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from transformers import TrainingArguments

from hf_noloco.docstrings import help_from_docstring
from hf_noloco.engine.shape import mesh_shape, routing_group_size
from hf_noloco.outer.settings import OuterSettings
from hf_noloco.resilience.authentication import authenticate_store, join_authenticated_group
from hf_noloco.resilience.elastic import join_restartable_group
from hf_noloco.resilience.joining import is_joining, join_live_run
from hf_noloco.rules import (
    EXPORT_DTYPES,
    HUB_STRATEGIES,
    LOSS_TYPES,
    MASTER_WEIGHTS,
    NONFINITE_ACTIONS,
    PIPELINE_SCHEDULES,
    REPLICA_LOSS_ACTIONS,
    ROUTING_DOMAINS,
    ROUTINGS,
    STAGE_BALANCES,
    BoundaryDtype,
    ExportDtype,
    HubStrategyName,
    LossType,
    MasterWeights,
    NonfiniteAction,
    PipelineSchedule,
    ReplicaLossAction,
    Routing,
    RoutingDomain,
    StageBalance,
    check_boundary_formats,
    check_choice,
    check_export_replica,
    check_finite_numbers,
    check_microbatch_size,
    check_model_init_kwargs,
    check_positive_int,
    check_stage_boundaries,
    check_timeout,
    default_microbatch_size,
)

# NCCL's default error handling (1: tear down) kills the process within ~100 ms of a failed or timed-out
# operation, before a NoLoCo rank can find and name the lost peer. 2 (clean up only) aborts the communicator
# and raises in the waiting rank instead; a value already set by the user is kept.
NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


@help_from_docstring
@dataclass
class NoLoCoConfig(OuterSettings, TrainingArguments):
    r"""
    Configuration for [`NoLoCoTrainer`]: everything [`~transformers.TrainingArguments`] has, plus the settings
    below. ``per_device_train_batch_size`` is the batch of one replica column (every stage of a column sees
    the same batch); the optimizer steps once per ``per_device_train_batch_size`` x
    ``gradient_accumulation_steps`` rows per replica, run as one pipeline step over all their microbatches (so
    accumulation also shrinks the pipeline's bubble, and the loss is token-weighted over the whole accumulated
    batch); the global batch is that times the number of replicas.

    Parameters:
        > Pipeline

        pipeline_stages (`int`, *optional*, defaults to `1`):
            Number of pipeline stages the decoder layers are split into. The number of launched processes must
            be a multiple of it; the quotient is the number of replicas per stage.
        stage_boundaries (`list[int]` or `None`, *optional*, defaults to `None`):
            First decoder layer of stages 1..pipeline_stages-1 (e.g. `[4, 7]` splits 10 layers 4/3/3). `None`
            splits as `stage_balance` says.
        stage_balance (`str`, *optional*, defaults to `"layers"`):
            How stages are split without `stage_boundaries`: `"layers"` gives each stage the same number of
            decoder layers (earlier stages take the remainder: 10 layers over 3 stages is 4/3/3); `"compute"`
            balances the stages' estimated compute, counting the last stage's `lm_head` (parameter counts:
            multiply-adds per token). The slowest stage sets the pipeline's pace, and `lm_head` costs about
            `vocab_size / (12 * hidden_size)` decoder layers (1.3 for a 4096-word vocabulary at hidden size
            256, 2.4 for Llama-3-8B), so `"compute"` is usually faster; it moves layers off the last stage.
        microbatch_size (`int` or `None`, *optional*, defaults to `None`):
            Rows per pipeline microbatch; must divide `per_device_train_batch_size`. `None` picks the largest
            divisor giving at least `2 * pipeline_stages` microbatches (1 if none does), which keeps the
            pipeline bubble small.
        verify_split (`bool`, *optional*, defaults to `True`):
            Before any process trains, prove on a shrunken copy of the model's config (the same model type and
            every setting that shapes its forward, a few layers, small widths, its windows and other length
            settings shrunk below the proof's rows; 0.11 s on one CPU thread, on rank 0, for Llama-3-8B's
            config at 4 stages) that the composed stages, cut at this run's boundaries, compute the model's
            own logits, loss and gradients on every input form the run feeds them (unpadded, padded and
            packed rows, the evaluation path), at its attention implementation and dtype. A model they do not
            reproduce is refused with one line naming what differs and on which form (e.g. `gemma2:
            final_logit_softcapping is not reproduced by the stages on unpadded rows (...)`). `False` skips
            the proof: the run then trains whatever the stages compute, which for a refused model is another
            function than the checkpoint's.
        pipeline_schedule (`str`, *optional*, defaults to `"1f1b"`):
            Order of forwards and backwards within a step: `"1f1b"` (a stage holds the activations of at most
            `pipeline_stages - stage` microbatches), `"gpipe"` (all forwards, then all backwards; holds every
            microbatch) or `"zb-h1"` (ZB-H1: 1F1B's order with each backward split into the input gradient,
            sent upstream at once, and the weight gradients, deferred into the pipeline's idle slots; the
            first stage holds what it holds under 1F1B and every later stage at most as many microbatches,
            `pipeline_stages`, each deferred weight gradient also keeping the gradients at its weights'
            joints: a later stage holds more than under 1F1B, measured 1.76x 1F1B's peak on a Llama-3.2-1B
            stage 6 of 8 with 4 microbatches, and `estimate_stage_memory` predicts it). All three give the
            same gradients, zb-h1 and 1f1b bit for bit. Measured on CPU with gloo (`benchmarks/RESULTS.md`),
            zb-h1 shortens the stages' waits (2 stages, 2 microbatches: the
            first stage waits 0.24 of the step instead of 0.39) for 3 to 8 percent more CPU time (the weight
            gradients take several autograd calls); on a 2-core machine shared with other programs it was not
            measurably faster than 1f1b (tokens/s ratios 0.94-1.09, each within noise), so 1f1b stays the
            default; whether it pays where every stage has a core or a GPU of its own is not measured. Under
            activation checkpointing zb-h1 runs each whole backward at B time, which is 1f1b's computation.
            Against `torch.distributed.pipelining` on the same stages, loss and optimizer (`Schedule1F1B`, and
            `ScheduleInterleavedZeroBubble` with one stage per rank, which runs zb-h1's order), both engines
            compute the same gradients bit for bit at the same CPU time per step (within 4 percent); on the
            same shared machine neither was measurably faster (tokens/s ratios 0.94-1.09).
        p2p_timeout (`float`, *optional*, defaults to `300`):
            Seconds to wait for a peer's message before failing with an error that names it. It also bounds
            every collective of the training loop (the trainer sets its process groups' timeout to it), so a
            lost rank stops the whole job within about this time. The set-up before training, checkpoint
            saving and the export wait up to `ddp_timeout` instead (at least `p2p_timeout`): file I/O and
            uploads may take longer.
        nonfinite (`str`, *optional*, defaults to `"error"`):
            What a non-finite (NaN/inf) loss or gradient does: `"error"` stops the run with an error naming
            the step, stage and replica (checkpoints already written stay intact; resume from the last one),
            `"skip"` drops that step's gradients, so the optimizer leaves the weights and its state untouched,
            logs a warning and goes on. Every stage of the affected replica column takes the same decision.
        on_replica_loss (`str`, *optional*, defaults to `"stop"`):
            What a lost rank does to the run. `"stop"`: every process ends with an error naming it (resume
            from the newest intact checkpoint, by hand or with a launcher's `--max-restarts`). `"continue"`:
            the lost rank's whole replica column is dropped and the others train on to `max_steps` (NoLoCo
            and `local` only, on gloo, with one launch per replica column from `python -m
            hf_noloco.column_launch`, whose store outlives every worker; see `docs/fault-tolerance.md`).
            A rank is lost when killed, or when its heartbeat in the store stops for `min(p2p_timeout, 10)`
            seconds (frozen, cut off). The step during which the loss happened is skipped by the survivors
            that had not finished it; the lost column's data shard is skipped for the rest of the run;
            routing pairs and gossip groups are drawn among the live replicas; checkpoints, metrics and the
            export cover the live replicas. A checkpoint written after a loss resumes onto the live
            replicas or the full mesh (`docs/fault-tolerance.md`).

        > Routing

        routing (`str`, *optional*, defaults to `"sample"`):
            How samples pick the replica of the next stage: `"sample"` (a fresh random pairing per sample, as
            the official code), `"step"` (one pairing per optimizer step, as the paper's text) or `"fixed"`
            (each replica column is an independent model).
        routing_seed (`int` or `None`, *optional*, defaults to `None`):
            Seed shared by all ranks for routing and gossip groups. `None` uses `seed`.
        routing_domain (`str`, *optional*, defaults to `"global"`):
            Which replicas a sample may be routed to: `"global"` (any replica of the next stage, wherever it
            runs) or `"node"` (only replicas whose columns share this node, so activations and their
            gradients never cross nodes; each node's group draws its own random pairings from the shared
            seed). A node's group is `routing_group_size` replicas, by default the processes per node
            (`LOCAL_WORLD_SIZE`, set by torchrun and accelerate) divided by `pipeline_stages`, which must
            divide them. On one node both are the same. Gossip partners are still drawn among all replicas.
        routing_group_size (`int` or `None`, *optional*, defaults to `None`):
            With `routing_domain="node"`: replicas per routing group (consecutive replica indices; must divide
            the number of replicas). `None`: derived from the launch as above.
        capacity_routing (`bool`, *optional*, defaults to `False`):
            Mixed-speed replicas: every microbatch's rows are shared among a stage's replicas in proportion to
            each replica's measured speed (its compute seconds per row, smoothed over steps) instead of
            equally, so a slower replica computes fewer rows and the step stops waiting for it. Every replica
            keeps the same microbatches in the same order; each sample still counts once with its token
            weight. Use it when replicas differ in speed (mixed GPU generations, a shared or throttled
            machine); with equal speeds it routes exactly as without. Needs `routing` `"sample"` or
            `"step"`, and `on_replica_loss="stop"`.
        capacity_rebalance_steps (`int`, *optional*, defaults to `10`):
            With `capacity_routing`: the shares change every this many steps (at a step boundary, after one
            small all-gather of the measured speeds over every rank); before the first, rows are equal.
        capacity_floor (`float`, *optional*, defaults to `0.05`):
            With `capacity_routing`: the least share of a microbatch's rows any replica of a routing group
            gets, so a slow replica still trains and stays in the gossip (and never fewer than one row per
            microbatch). A replica held at the floor for three rebalances in a row is named in a warning.

        > Stage boundaries

        boundary_dtype (`str` or `None`, *optional*, defaults to `None`):
            How a microbatch's activations travel to the next stage (per token, one row of `hidden_size`
            values): `None` keeps the wire dtype (bfloat16 under `bf16`, else the weights' dtype); `"float32"`
            and `"bfloat16"` are casts; `"int8"` (integers in [-127, 127]), `"float8_e4m3"`, `"float8_e5m2"`
            (8 bits) and `"int4"` (integers in [-7, 7], two per byte) are scaled by the absolute maximum of
            each scale group (`boundary_block_size`) and carry its float32 scale. Bytes per token at hidden
            size 4096: float32 16384, bfloat16 8192, the 8-bit formats 4100, int4 2052 (one scale per token).
            Every packet stands alone (no error feedback): any replica of the next stage decodes any sender's.
            Which to use: the wire dtype while the link carries a microbatch's activations in less than a
            microbatch's compute (a microbatch's send overlaps the next one's compute); a scaled format on
            slower links, where stages are on different machines (measured costs and speeds:
            `docs/stage-boundaries.md`).
        boundary_grad_dtype (`str` or `None`, *optional*, defaults to `None`):
            The same for the activation gradients sent back to the previous stage; `"float8_e5m2"` has the
            wider range gradients need among the 8-bit floats. `None`: the wire dtype.
        boundary_block_size (`int` or `None`, *optional*, defaults to `None`):
            Values per float32 scale of the scaled boundary formats: `None` one scale per token (the fewest
            bytes), or a divisor of `hidden_size` (even for int4): each block of that many values of a token
            gets its own scale, so one large value (an outlier channel) coarsens only its block, for 4 bytes
            more per block and token.
        boundary_grad_stochastic_rounding (`bool`, *optional*, defaults to `False`):
            Round the scaled gradient format stochastically (up or down with the probabilities that make
            each decoded value unbiased; seeded from `routing_seed`, the step, microbatch, stage and replica,
            so runs repeat), so rounding errors average out in the weight gradients instead of adding up.
            Needs a scaled `boundary_grad_dtype`.

        > Outer optimizer

        outer_optimizer (`str`, *optional*, defaults to `"noloco"`):
            `"noloco"` (random-partner averaging with modified Nesterov momentum), `"diloco"` (all-reduce of
            pseudo-gradients), `"ddp"` (gradients all-reduced every step) or `"local"` (no sync at all).
        inner_steps (`int` or `None`, *optional*, defaults to `None`):
            H, inner optimizer steps per outer step. `None`: the paper's default (50 for noloco, 100 for
            diloco).
        outer_lr (`float` or `None`, *optional*, defaults to `None`):
            beta, the outer learning rate, in (0, 2]. `None`: 0.7.
        outer_momentum (`float` or `None`, *optional*, defaults to `None`):
            alpha, the outer momentum, in [0, 1). `None`: 0.5 for noloco, 0.3 for diloco.
        outer_averaging (`float` or `None`, *optional*, defaults to `None`):
            gamma, the pull of slow weights towards the group mean (noloco only), in [0, 2]. `None`: equal to
            `outer_lr`, in which case only fast weights cross the network.
        gossip_group_size (`int`, *optional*, defaults to `2`):
            n, replicas averaged together at a noloco outer step (at most the number of replicas).
        outer_dtype (`str`, *optional*, defaults to `"float32"`):
            What an outer step sends, per parameter and quantity sent: `"float32"` (4 bytes, exact),
            `"bfloat16"` (2 bytes, a cast), or a block-scaled format with error feedback (blocks of 64 values,
            one float32 scale each, counted): `"int8"` and `"float8_e4m3"` (1.0625 bytes), `"int4"` (0.5625
            bytes, two values per byte). noloco with gamma == beta sends the fast weights, with gamma != beta
            the local progress (theta - phi) and the slow weights; diloco's compressed pseudo-gradients are
            all-gathered and summed after decoding (fewer bytes than a float32 all-reduce below 8 replicas
            for the 8-bit formats, below 14 for int4). Which to use: float32 while the outer exchange hides
            behind compute (a fast link, or an exchange shorter than `outer_overlap_steps` inner steps); int8
            when it does not (a quarter of the bytes, no measured quality cost); int4 only where int8's bytes
            still do not fit the link (the replicas end several times further apart); float8_e4m3 sends
            int8's bytes less accurately; bfloat16 halves the bytes, a cast without feedback. Measured on a
            1.25M-parameter Llama, final perplexity against float32 (3 paired seeds, 95% intervals,
            docs/compressed-gossip.md): dp 4 int8 -0.04% [-0.42, +0.34], bfloat16 +0.42% [+0.03, +0.80],
            float8_e4m3 +0.47% [-1.54, +2.52], int4 +0.73% [-2.89, +4.49], with 3x (float8) and 9x (int4) the
            replicas' spread, diloco int8 +0.00%; dp 8 int8 -0.05% [-1.13, +1.04], bfloat16 -0.32% [-1.21,
            +0.57], float8_e4m3 -0.14% [-2.24, +2.01], int4 +0.88% [-2.00, +3.85], with 2.3x and 6.6x the
            spread, diloco int8 -0.05% [-0.19, +0.08]. Behind an emulated 8B-equivalent 1 Gbit/s link
            (noloco, node routing, `outer_overlap_steps` = `inner_steps`) int4 kept 0.99 of the unlimited
            link's tokens/s, int8 0.87, bfloat16 0.40, float32 0.22. Unmeasured on larger models. The outer
            state (slow weights, momentum) stays float32; the compressed formats add float32 error-feedback
            buffers (4 bytes per parameter and quantity sent), saved in checkpoints.
        offload_outer_state (`bool`, *optional*, defaults to `False`):
            Keep slow weights and momentum in CPU memory (pinned when a GPU is present) to save accelerator
            memory; they stay there through Accelerate's preparation of the optimizer and through a resume.
        outer_overlap_steps (`int`, *optional*, defaults to `0`):
            tau (noloco, diloco): the exchange of an outer step runs in the background, on a process group of
            its own, while the next tau inner steps run; when it ends, the update is applied keeping the local
            progress made meanwhile (theta <- phi_new + theta_now - theta_sent). In [0, inner_steps]; 0 blocks
            until the exchange ends (the update of the paper). Costs one more float32 copy of the stage (plus
            the partners' copies) while in flight.

        > Memory and precision

        model_init_kwargs (`dict`, `str` or `None`, *optional*, defaults to `None`):
            How the trainer builds the model when it is given a Hub id, a folder or a config (as TRL's
            `SFTConfig.model_init_kwargs`; `hf-noloco-train` fills it from `dtype`, `attn_implementation`,
            `model_revision` and `trust_remote_code`). Keys: `dtype` (`"float32"`, the default; `"bfloat16"`:
            bf16 weights, trained through float32 masters unless `master_weights` is `"none"`; the outer
            state, slow weights and momentum, stays float32 either way; `"auto"`: the checkpoint's own
            dtype, float32 for a float16 one),
            `attn_implementation` (`"sdpa"`, the default, `"eager"`, or `"flash_attention_2"` where the
            flash_attn package is installed), `revision` (a Hub branch, tag or commit) and
            `trust_remote_code` (run the checkpoint's own modelling code; it must still be a Llama-family
            model).
        master_weights (`str`, *optional*, defaults to `"float32"`):
            What the optimizer steps when `model_init_kwargs` asks for bf16 weights: `"float32"` keeps the
            trained weights in float32 (the master copy) and computes in bf16 under autocast (`bf16` is then
            set), so updates far below a bf16 weight's precision still add up; frozen weights (the base model
            under LoRA) stay bf16. Weights, gradients and AdamW state then take 16 bytes per trained
            parameter, as in float32. `"none"`: pure bf16, 8 bytes per parameter, where an update smaller than
            half a bf16 step of its weight is rounded away (at a fine-tuning learning rate of 2e-5 most
            weights never move: see benchmarks/RESULTS.md).
        activation_checkpointing (`bool`, *optional*, defaults to `False`):
            Recompute each decoder layer of a stage in the backward pass (non-reentrant checkpointing) instead
            of keeping its activations: a layer keeps only its input, at the cost of one more forward. Losses
            and gradients are those of the run without it; works with both schedules. `gradient_checkpointing`
            is its older name. `activation_checkpointing_kwargs` may hold `every_n_layers` (checkpoint only
            the layers whose index is a multiple of it), `offload` (keep the saved inputs in host memory) and
            options of `torch.utils.checkpoint.checkpoint`, except `use_reentrant=True`.
        torch_compile (`bool`, *optional*, defaults to `False`):
            Compile each decoder layer of the stage with `torch.compile` (`torch_compile_backend`, default
            inductor, and `torch_compile_mode`). Measured on 1 CPU thread (benchmarks/torch_compile.py): 12%
            shorter steps, after 50-100 s of compiling per process.
        activation_offloading (`bool`, *optional*, defaults to `False`):
            Keep what each stage's training forward saves for its backward in host memory (TRL's option):
            copied into pinned memory without blocking the host, and back for the backward. Saves the
            accelerator the activations' memory for two copies over the host link per microbatch.
        loss_type (`str`, *optional*, defaults to `"nll"`):
            The last stage's loss (TRL's option): `"nll"`, the next-token cross-entropy, or `"dft"` (dynamic
            fine-tuning: each token's cross-entropy weighted by its predicted probability, held constant).
            `"chunked_nll"`, TRL's deprecated name of `"nll"`, is taken as it. The start-up proof compares the
            stages with Hugging Face's own loss, `"nll"`'s.
        loss_chunk_tokens (`int` or `None`, *optional*, defaults to `1024`):
            The last stage scores a microbatch's positions this many at a time and recomputes each chunk's
            logits in the backward pass, so it never holds the full float32 logits (rows x tokens x vocabulary
            x 4 bytes: 8 GiB for 4 x 4096 tokens of Llama-3's 128k vocabulary), for one more `lm_head`
            forward. Microbatches with fewer positions are scored at once. `None`: never chunk.

        > Metrics and export

        divergence_steps (`int` or `None`, *optional*, defaults to `None`):
            Compute the exact replica divergence (an all-reduce of the weights) every this many steps, at a
            logging step. `None`: at every evaluation.
        peak_tflops (`float` or `None`, *optional*, defaults to `None`):
            The peak TFLOPS of one device, for the logged `mfu` (model FLOPs utilisation: the model's
            training FLOPs on the non-padding tokens, estimated from its config as `6 N + 12 L d s` per
            token, per second and device, over this peak). `None`: the dense bf16 peak of a known GPU (H200,
            H100, A100, L40S, L4), else no `mfu` entry. Logs also carry `tokens_per_second` (non-padding
            tokens) and `trained_tokens_per_second` (tokens with a label), and the Trainer's `total_flos` (the
            same estimate over every token computed, padding included).
        export_replica (`int` or `None`, *optional*, defaults to `None`):
            What `save_model` exports: `None` the consensus (mean of each stage's replicas), or one replica's
            weights.
        merge_adapter (`bool`, *optional*, defaults to `False`):
            With LoRA adapters (`use_peft`): export the base model with the adapters merged into its weights
            (an ordinary checkpoint) instead of the PEFT adapter (`adapter_config.json` and
            `adapter_model.safetensors`, which `PeftModel.from_pretrained` loads on top of the base model).
        export_dtype (`str` or `None`, *optional*, defaults to `None`):
            The dtype of the exported weights: `None` the training dtype (see `model_init_kwargs`), or
            `"float32"`, `"bfloat16"`. A tied model is exported with one embedding matrix and
            `tie_word_embeddings=True`.
        hub_strategy (`str`, *optional*, defaults to `"end"`):
            What `push_to_hub` uploads, as in the Trainer. `"end"`: the export, once, at the end.
            `"every_save"`: also at each save, the consensus model exported into `output_dir` (a gather of
            every stage to one rank, as at the end) and uploaded in the background while training goes on
            (a save whose previous upload still runs is not pushed, unless `hub_always_push`).
            `"checkpoint"`: also the checkpoint itself, to `last-checkpoint/` (download that folder and pass
            it as `resume_from_checkpoint` to resume elsewhere, on the same mesh or another).
            `"all_checkpoints"`: every checkpoint, each in a folder of its own name. The token and the
            repository are checked with the Hub on one rank before training, and every rank stops with its
            verdict.
        hub_always_push (`bool`, *optional*, defaults to `False`):
            With `hub_strategy` other than `"end"`: when the previous save's upload still runs, wait for it
            and push this save too, instead of skipping this one (the export must not rewrite files an upload
            is reading).
        enable_jit_checkpoint (`bool`, *optional*, defaults to `True`):
            On SIGTERM (what Slurm sends at preemption, a requeue and the time limit, and what torchrun and
            `accelerate launch` forward to their workers), every rank saves a checkpoint at the same step
            boundary, after the step running when the signal came or the next one, and training stops:
            `hf-noloco-train` then exits with status 143 without evaluating or exporting, and the same command
            with `resume_from_checkpoint: auto` resumes there and ends bit-identical to an uninterrupted run.
            The ranks agree through a host-side all-reduce per step (no GPU synchronisation). Give the job a
            grace period of two steps plus a save (torchrun and Slurm's default `KillWait` give 30 s).
            `False`: SIGTERM ends the processes at once, as Python's default.
        average_tokens_across_devices (`bool`, *optional*, defaults to `False`):
            Must stay `False`: ranks hold different pipeline stages, and the last stage already weights each
            sample by the target tokens of its replica's batch.
        dataloader_drop_last (`bool`, *optional*, defaults to `True`):
            Drop the last incomplete training batch: every replica must see full batches of the same shape.
    """

    pipeline_stages: int = 1
    stage_boundaries: list[int] | None = None
    stage_balance: StageBalance = "layers"
    microbatch_size: int | None = None
    verify_split: bool = True
    pipeline_schedule: PipelineSchedule = "1f1b"
    p2p_timeout: float = 300.0
    nonfinite: NonfiniteAction = "error"
    on_replica_loss: ReplicaLossAction = "stop"
    routing: Routing = "sample"
    routing_domain: RoutingDomain = "global"
    routing_group_size: int | None = None
    capacity_routing: bool = False
    capacity_rebalance_steps: int = 10
    capacity_floor: float = 0.05
    boundary_dtype: BoundaryDtype | None = None
    boundary_grad_dtype: BoundaryDtype | None = None
    boundary_block_size: int | None = None
    boundary_grad_stochastic_rounding: bool = False
    # The outer optimizer's fields (and routing_seed) are OuterSettings', inherited: declared once.
    model_init_kwargs: dict | str | None = None
    master_weights: MasterWeights = "float32"
    # Redeclared to carry this class's --help (TrainingArguments': nargs="?" makes a bare flag mean True).
    activation_checkpointing: bool | None = field(default=None, metadata={"nargs": "?", "const": True})
    activation_offloading: bool = False
    loss_type: LossType = "nll"
    loss_chunk_tokens: int | None = 1024
    divergence_steps: int | None = None
    peak_tflops: float | None = None
    export_replica: int | None = None
    merge_adapter: bool = False
    export_dtype: ExportDtype | None = None
    # Changed defaults of TrainingArguments fields.
    average_tokens_across_devices: bool = False
    dataloader_drop_last: bool = True
    hub_strategy: HubStrategyName = "end"
    enable_jit_checkpoint: bool = True
    # Whether this process joins a live run (`column_launch --join`): read once, here, from the launch.
    joining: bool = field(default=False, init=False, repr=False)

    def __post_init__(self):
        if not self.use_cpu and not torch.cuda.is_available():
            # Accelerate only picks the gloo (MULTI_CPU) path when told to use the CPU; on a machine without
            # a GPU, launch configs written for GPUs must still work as written.
            self.use_cpu = True
        self.model_init_kwargs = check_model_init_kwargs(self.model_init_kwargs)
        self.joining = is_joining()
        # Checked first: TrainingArguments.__post_init__ joins the process group when launched (it sets up the
        # device), and a bad setting must fail before that, on every rank alike.
        check_config(self, self.joining)
        self._resolve_defaults()
        TrainingArguments.__post_init__(self)

    def _resolve_defaults(self) -> None:
        """Every ``None`` default becomes its value here, once; the rest of the package reads the fields."""
        if self.routing_seed is None:
            self.routing_seed = self.seed
        if self.microbatch_size is None:
            self.microbatch_size = default_microbatch_size(
                self.per_device_train_batch_size, self.pipeline_stages
            )
        if self.routing_domain == "node" and self.routing_group_size is None:
            num_replicas, _ = mesh_shape(_world_size(), self.pipeline_stages)
            self.routing_group_size = routing_group_size("node", None, num_replicas, self.pipeline_stages)
        self.resolve()  # OuterSettings' own defaults (the paper's), in these fields
        self.ddp_timeout = max(int(self.ddp_timeout), int(self.p2p_timeout))

    @cached_property
    def outer_settings(self) -> OuterSettings:
        """The outer optimizer's settings, as :class:`~hf_noloco.outer.optimizer.OuterOptimizer` takes
        them."""
        return OuterSettings.of(self)

    @cached_property
    def _setup_devices(self) -> torch.device:
        # TrainingArguments joins the process group here (through Accelerate) when launched. Under torchrun or
        # accelerate with --max-restarts each attempt must join a group of its own (resilience/elastic.py
        # says why): it is joined first, and Accelerate keeps it. NCCL reads its environment when its group is
        # made.
        for name, value in NCCL_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        if self.on_replica_loss == "continue" and _world_size() > 1:
            # The store must prove the run's secret before any group is joined on it (docs/security.md).
            store = authenticate_store(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                self.ddp_timeout,
                min(self.p2p_timeout, 60.0),
            )
            if not (self.joining or dist.is_initialized()):
                join_authenticated_group(store, self.ddp_backend or "gloo", self.ddp_timeout)
        join_restartable_group(self.ddp_backend or ("gloo" if self.use_cpu else "nccl"), self.ddp_timeout)
        if self.joining:  # column_launch --join: a stand-in default group (resilience/joining.py)
            join_live_run(self.ddp_timeout)
        return super()._setup_devices


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_gpus_per_machine(c) -> None:
    """Each process of a machine takes the GPU of its local rank: with more processes than GPUs (a 4-process
    CPU launch config on a machine with 1-3 GPUs) the last ones would fail when they reach the device."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)  # set by torchrun and accelerate launch
    if c.use_cpu or c.ddp_backend == "gloo" or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if local > gpus:
        raise ValueError(
            f"{local} processes on this machine but {gpus} GPU{'s' if gpus != 1 else ''}: launch at most "
            f"{gpus} per machine (--num_processes), or pass --use_cpu true to train on the CPU (gloo)."
        )


def check_config(c, joining: bool = False) -> None:
    """Every check of :class:`NoLoCoConfig`. ``c`` is the config, or any object with its attributes (the
    command checks its parsed options before the config joins the process group); ``joining``: this process
    joins a live run (``column_launch --join``)."""
    for name in ("pipeline_stages", "per_device_train_batch_size", "per_device_eval_batch_size"):
        check_positive_int(name, getattr(c, name))
    check_choice("routing", c.routing, ROUTINGS)
    check_choice("routing_domain", c.routing_domain, ROUTING_DOMAINS)
    if c.routing_group_size is not None:  # the launch-dependent checks come with the mesh shape, below
        routing_group_size(c.routing_domain, c.routing_group_size, c.routing_group_size, 1)
    check_choice("pipeline_schedule", c.pipeline_schedule, PIPELINE_SCHEDULES)
    check_boundary_formats(
        c.boundary_dtype, c.boundary_grad_dtype, c.boundary_block_size, c.boundary_grad_stochastic_rounding
    )
    check_choice("loss_type", c.loss_type, LOSS_TYPES)
    if c.loss_type == "chunked_nll":  # TRL's deprecated name of nll
        c.loss_type = "nll"
    check_choice("stage_balance", c.stage_balance, STAGE_BALANCES)
    check_choice("nonfinite", c.nonfinite, NONFINITE_ACTIONS)
    check_choice("master_weights", c.master_weights, MASTER_WEIGHTS)
    check_replica_loss(c, joining)
    check_gpus_per_machine(c)
    check_choice("hub_strategy", str(getattr(c.hub_strategy, "value", c.hub_strategy)), HUB_STRATEGIES)
    check_finite_numbers({k: v for k, v in vars(c).items() if not k.startswith("_")})
    check_timeout("p2p_timeout", c.p2p_timeout)
    check_timeout("ddp_timeout", c.ddp_timeout)
    if c.microbatch_size is not None:
        check_microbatch_size(c.per_device_train_batch_size, c.microbatch_size)
    if c.divergence_steps is not None:
        check_positive_int("divergence_steps", c.divergence_steps)
    check_capacity_routing(c)
    check_stage_boundaries(c.stage_boundaries, c.pipeline_stages)
    if c.stage_boundaries is not None and c.stage_balance != "layers":
        raise ValueError(
            f"stage_boundaries={c.stage_boundaries} and stage_balance={c.stage_balance!r} both choose the "
            "split: set only one."
        )
    # Values that torch's optimizers, numpy's seeding or the Trainer would refuse late, without naming them.
    for name in ("learning_rate", "weight_decay", "adam_epsilon", "warmup_steps"):
        if not getattr(c, name) >= 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(c, name)}.")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(c, name) < 1:
            raise ValueError(f"{name} must be in [0, 1), got {getattr(c, name)}.")
    for name in ("seed", "data_seed", "routing_seed"):
        value = getattr(c, name)
        if value is not None and not 0 <= value < 2**32:
            raise ValueError(f"{name} must be in [0, 2**32), got {value}.")
    if c.max_steps <= 0 and not c.num_train_epochs > 0:
        raise ValueError(
            f"Nothing to train: max_steps={c.max_steps} and num_train_epochs={c.num_train_epochs}. "
            "Set a positive max_steps or num_train_epochs."
        )
    for name in ("logging_steps", "eval_steps", "save_steps"):
        value = getattr(c, name)
        if value is not None and value < 0:
            raise ValueError(
                f"{name} must be positive (a number of steps, or a fraction of the run below 1), got {value}."
            )
    if c.fp16:
        raise ValueError("fp16 is not supported (the pipeline has no loss scaling): use bf16=True instead.")
    check_positive_int("gradient_accumulation_steps", c.gradient_accumulation_steps)
    if c.average_tokens_across_devices:
        raise ValueError("average_tokens_across_devices must be False: ranks hold different pipeline stages.")
    if c.load_best_model_at_end:
        raise ValueError("load_best_model_at_end is not supported by NoLoCoTrainer.")
    check_unhonoured(c)
    _check_attention_available(c.model_init_kwargs)
    if c.loss_chunk_tokens is not None:
        check_positive_int("loss_chunk_tokens", c.loss_chunk_tokens)
    if c.peak_tflops is not None and not c.peak_tflops > 0:
        raise ValueError(f"peak_tflops must be positive, got {c.peak_tflops}.")
    if c.export_dtype is not None:
        if c.export_dtype in ("float16", "half"):
            raise ValueError("export_dtype float16 is not supported: use bfloat16 or float32.")
        check_choice("export_dtype", c.export_dtype, EXPORT_DTYPES)
    _check_activation_checkpointing(c)
    _check_trainer_extras(c)
    num_replicas, _ = mesh_shape(_world_size(), c.pipeline_stages)
    OuterSettings.of(c).check_replicas(num_replicas)
    group = routing_group_size(c.routing_domain, c.routing_group_size, num_replicas, c.pipeline_stages)
    if c.capacity_routing and c.capacity_floor * group > 1:
        raise ValueError(
            f"capacity_floor={c.capacity_floor} times the {group} replicas of a routing group exceeds 1: "
            f"use at most {1 / group:.4g}."
        )
    check_export_replica(c.export_replica, num_replicas)


def check_capacity_routing(c) -> None:
    """``capacity_routing`` needs random routing and a run whose ranks all take part in every rebalance."""
    check_positive_int("capacity_rebalance_steps", c.capacity_rebalance_steps)
    if not 0 <= c.capacity_floor < 1:
        raise ValueError(f"capacity_floor must be in [0, 1), got {c.capacity_floor}.")
    if not c.capacity_routing:
        return
    if c.routing == "fixed":
        raise ValueError("capacity_routing needs routing='sample' or 'step': fixed routing moves no rows.")
    if getattr(c, "on_replica_loss", "stop") == "continue":
        raise ValueError(
            "capacity_routing does not support on_replica_loss='continue' yet: its rebalance is an "
            "all-gather over every rank, which a lost replica would block."
        )


def check_replica_loss(c, joining: bool = False) -> None:
    """``on_replica_loss="continue"`` needs an algorithm whose training path has no collective over the
    replicas, a backend whose groups survive a lost member, and a store that outlives every worker."""
    action = getattr(c, "on_replica_loss", "stop")
    check_choice("on_replica_loss", action, REPLICA_LOSS_ACTIONS)
    if joining and action != "continue":
        raise ValueError(
            "column_launch --join joins a live on_replica_loss='continue' run: give the run's own arguments "
            f"(on_replica_loss='continue'), not on_replica_loss={action!r}."
        )
    if action != "continue":
        return
    if c.outer_optimizer not in ("noloco", "local"):
        raise ValueError(
            f"on_replica_loss='continue' needs outer_optimizer 'noloco' or 'local': {c.outer_optimizer!r} "
            "all-reduces over every replica, which a lost replica blocks."
        )
    if c.outer_overlap_steps:
        raise ValueError("on_replica_loss='continue' does not support outer_overlap_steps > 0 yet.")
    if c.routing_domain != "global":
        raise ValueError(
            "on_replica_loss='continue' needs routing_domain='global': node groups would no longer divide "
            "the live replicas."
        )
    if (not c.use_cpu and torch.cuda.is_available()) or c.ddp_backend not in (None, "gloo"):
        raise ValueError(
            "on_replica_loss='continue' runs on gloo (CPU) only: an NCCL communicator with a lost member "
            "aborts, and survivors cannot keep it."
        )
    if _world_size() > 1 and not (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RUN_ID" not in os.environ
    ):
        raise ValueError(
            "on_replica_loss='continue' needs one launch per replica column around a store that outlives "
            "every worker: start `python -m hf_noloco.column_launch --column R ...` once per column "
            "(recipes/README.md shows the lines). Under torchrun or accelerate launch the agent stops every "
            "worker when one is lost, and without an agent rank 0 hosts the store."
        )


# TrainingArguments fields NoLoCoTrainer does not honour, with the values that are honoured (their defaults)
# and why: each is refused, naming it, rather than accepted and silently ignored. Found by reading
# transformers' Trainer: features it implements inside compute_loss, training_step, evaluation_loop or
# _save_checkpoint (which this trainer replaces) or by wrapping the model (which a stage cannot be).
UNHONOURED: dict[str, tuple[object, str]] = {
    "use_liger_kernel": (
        False,
        "Liger kernels patch the full model's forward, which a pipeline stage never calls",
    ),
    "liger_kernel_config": (None, "Liger kernels are not supported (use_liger_kernel)"),
    "neftune_noise_alpha": (
        None,
        "NEFTune noise hooks the full model's embeddings, which a stage does not call",
    ),
    "label_smoothing_factor": (0.0, "the pipeline computes LlamaForCausalLM's plain cross-entropy"),
    "bf16_full_eval": (False, "evaluation runs the stages in their training dtype"),
    "fp16_full_eval": (False, "evaluation runs the stages in their training dtype"),
    "auto_find_batch_size": (False, "the batch size fixes the microbatch schedule of every stage"),
    "include_num_input_tokens_seen": ("no", "the logs carry tokens_seen (tokens of every replica)"),
    "save_only_model": (False, "a checkpoint always holds what an exact resume needs"),
    "save_on_each_node": (False, "checkpoints are written once, to a filesystem shared by all ranks"),
    "eval_accumulation_steps": (
        None,
        "each microbatch's predictions for compute_metrics go to the CPU at once",
    ),
    "eval_use_gather_object": (False, "the predictions for compute_metrics are gathered as tensors"),
    "eval_do_concat_batches": (True, "compute_metrics sees every batch's predictions concatenated"),
    "batch_eval_metrics": (False, "compute_metrics is called once, with the whole evaluation's predictions"),
    "include_for_metrics": ([], "compute_metrics' EvalPrediction holds the predictions and the labels"),
    "label_names": (None, "the labels are always the batch's `labels` (or its input_ids)"),
    "train_sampling_strategy": ("random", "each replica's shard is shuffled by a seeded sampler"),
    "length_column_name": ("length", "batches are not grouped by length"),
    "ddp_find_unused_parameters": (None, "stages are never wrapped in DistributedDataParallel"),
    "ddp_bucket_cap_mb": (None, "stages are never wrapped in DistributedDataParallel"),
    "ddp_broadcast_buffers": (None, "stages are never wrapped in DistributedDataParallel"),
    "ddp_static_graph": (None, "stages are never wrapped in DistributedDataParallel"),
    "fsdp": (None, "stages are replicated, not sharded"),
    "fsdp_config": (None, "stages are replicated, not sharded"),
    "deepspeed": (None, "stages are replicated, not sharded"),
    "parallelism_config": (None, "the (replica, stage) mesh is hf_noloco's own"),
    "debug": ("", "the debug hooks assume an unsplit model"),
    "use_cache": (False, "training never uses a KV cache"),
    "do_predict": (False, "predict() is not supported"),
}
# accelerator_config keys that configure Accelerate's data loading, which the trainer replaces by its own
# (one shard per replica, shared by the replica's stages).
_ACCELERATOR_DATA_KEYS = {"split_batches": False, "dispatch_batches": None, "even_batches": True}


def check_unhonoured(c) -> None:
    """Refuses every TrainingArguments option set to a value NoLoCoTrainer would silently ignore (see
    :data:`UNHONOURED`), with a one-line error naming it."""
    for name, (default, why) in UNHONOURED.items():
        if not hasattr(c, name):
            continue
        value = getattr(c, name)
        if value == default or (default in ("", [], "no") and not value):  # before TrainingArguments parses
            continue
        raise ValueError(f"{name}={value!r} is not supported by NoLoCoTrainer: {why}.")
    accelerator = c.accelerator_config
    if isinstance(accelerator, str) and accelerator.strip().startswith("{"):
        accelerator = json.loads(accelerator)
    if accelerator is not None and not isinstance(accelerator, (dict, str)):
        accelerator = dataclasses.asdict(accelerator)
    if isinstance(accelerator, str):
        raise ValueError(
            "accelerator_config is not supported by NoLoCoTrainer: it loads each replica's shard itself."
        )
    for key, default in _ACCELERATOR_DATA_KEYS.items():
        if accelerator and accelerator.get(key, default) != default:
            raise ValueError(
                f"accelerator_config {key}={accelerator[key]!r} is not supported by NoLoCoTrainer: it loads "
                "each replica's shard itself."
            )


def _check_attention_available(model_init_kwargs) -> None:
    attn = (model_init_kwargs or {}).get("attn_implementation")
    if attn == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            raise ValueError(
                "attn_implementation flash_attention_2 needs the flash_attn package and a GPU it supports "
                "(pip install flash-attn); use sdpa (the default) otherwise."
            )


def _check_activation_checkpointing(c) -> None:
    kwargs = c.activation_checkpointing_kwargs
    if kwargs is None:
        kwargs = getattr(c, "gradient_checkpointing_kwargs", None)
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            kwargs = None
        if not isinstance(kwargs, dict):
            raise ValueError(
                "activation_checkpointing_kwargs must be a JSON object such as '{\"every_n_layers\": 2}'."
            )
    kwargs = kwargs or {}
    if kwargs.get("use_reentrant"):
        raise ValueError(
            "activation_checkpointing_kwargs: use_reentrant=True is not supported; stages checkpoint their "
            "decoder layers with the non-reentrant implementation."
        )
    every = kwargs.get("every_n_layers", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"activation_checkpointing_kwargs: every_n_layers must be a positive integer, got {every!r}."
        )


def _check_trainer_extras(c) -> None:
    """TrainingArguments values whose mistakes would otherwise surface late, in another library's words."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    names = c.report_to if isinstance(c.report_to, list) else [c.report_to]
    unknown = [n for n in names if n not in (None, "none", "all") and n not in INTEGRATION_TO_CALLBACK]
    if unknown:
        raise ValueError(
            f"report_to: unknown integration {unknown[0]!r}; use none, all, or one of "
            f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}."
        )
    kwargs = c.lr_scheduler_kwargs
    if isinstance(kwargs, str) and kwargs.strip():
        try:
            parsed = json.loads(kwargs)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError(
                f"lr_scheduler_kwargs must be a JSON object such as '{{\"num_cycles\": 2}}', got {kwargs!r}."
            )
    if c.push_to_hub:
        from hf_noloco.io.hub import check_hub_settings

        check_hub_settings(True, c.hub_model_id, c.hub_token)
    resume = c.resume_from_checkpoint
    if (
        isinstance(resume, str)
        and resume.lower() not in ("true", "last", "auto")
        and not os.path.isdir(resume)
    ):
        raise ValueError(f"resume_from_checkpoint: no such checkpoint folder {resume!r}.")
