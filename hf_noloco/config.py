"""NoLoCoConfig: TrainingArguments plus the pipeline, routing and outer-optimizer settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from .gossip import OUTER_METHODS, resolve_outer_defaults, validate_outer_settings
from .partition import STAGE_BALANCES
from .pipeline import SCHEDULES
from .routing import ROUTING_GRANULARITIES

OUTER_DTYPES = ("float32", "bfloat16")
NONFINITE_ACTIONS = ("error", "skip")


@dataclass
class NoLoCoConfig(TrainingArguments):
    r"""
    Configuration for [`NoLoCoTrainer`]: everything [`~transformers.TrainingArguments`] has, plus the settings
    below. ``per_device_train_batch_size`` is the batch of one replica column (every stage of a column sees the
    same batch); the global batch is that times the number of replicas.

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
            `vocab_size / (12 * hidden_size)` decoder layers (1.3 for a 4096-word vocabulary at hidden size 256,
            2.4 for Llama-3-8B), so `"compute"` is usually faster; it moves layers off the last stage.
        microbatch_size (`int` or `None`, *optional*, defaults to `None`):
            Rows per pipeline microbatch; must divide `per_device_train_batch_size`. `None` picks the largest
            divisor giving at least `2 * pipeline_stages` microbatches (1 if none does), which keeps the
            pipeline bubble small.
        pipeline_schedule (`str`, *optional*, defaults to `"1f1b"`):
            Order of forwards and backwards within a step: `"1f1b"` (a stage holds the activations of at most
            `pipeline_stages - stage` microbatches) or `"gpipe"` (all forwards, then all backwards; holds every
            microbatch). Both give the same gradients.
        p2p_timeout (`float`, *optional*, defaults to `300`):
            Seconds to wait for a peer's message before failing with an error that names it. It also bounds
            every collective of the training loop (the trainer sets its process groups' timeout to it), so a
            lost rank stops the whole job within about this time. The set-up before training, checkpoint saving
            and the export wait up to `ddp_timeout` instead (at least `p2p_timeout`): file I/O and uploads may
            take longer.
        nonfinite (`str`, *optional*, defaults to `"error"`):
            What a non-finite (NaN/inf) loss or gradient does: `"error"` stops the run with an error naming the
            step, stage and replica (checkpoints already written stay intact; resume from the last one), `"skip"`
            drops that step's gradients, so the optimizer leaves the weights and its state untouched, logs a
            warning and goes on. Every stage of the affected replica column takes the same decision.

        > Routing

        routing (`str`, *optional*, defaults to `"sample"`):
            How samples pick the replica of the next stage: `"sample"` (a fresh random pairing per sample, as
            the official code), `"step"` (one pairing per optimizer step, as the paper's text) or `"fixed"`
            (each replica column is an independent model).
        routing_seed (`int` or `None`, *optional*, defaults to `None`):
            Seed shared by all ranks for routing and gossip groups. `None` uses `seed`.

        > Outer optimizer

        outer_optimizer (`str`, *optional*, defaults to `"noloco"`):
            `"noloco"` (random-partner averaging with modified Nesterov momentum), `"diloco"` (all-reduce of
            pseudo-gradients), `"ddp"` (gradients all-reduced every step) or `"local"` (no sync at all).
        inner_steps (`int` or `None`, *optional*, defaults to `None`):
            H, inner optimizer steps per outer step. `None`: the paper's default (50 for noloco, 100 for diloco).
        outer_lr (`float` or `None`, *optional*, defaults to `None`):
            beta, the outer learning rate. `None`: 0.7.
        outer_momentum (`float` or `None`, *optional*, defaults to `None`):
            alpha, the outer momentum. `None`: 0.5 for noloco, 0.3 for diloco.
        outer_averaging (`float` or `None`, *optional*, defaults to `None`):
            gamma, the pull of slow weights towards the group mean (noloco only). `None`: equal to `outer_lr`,
            in which case only fast weights cross the network.
        gossip_group_size (`int`, *optional*, defaults to `2`):
            n, replicas averaged together at a noloco outer step.
        outer_dtype (`str`, *optional*, defaults to `"float32"`):
            Precision of the weights sent in an outer step: `"float32"` or `"bfloat16"` (half the bytes). The
            outer state itself (slow weights, momentum) always stays float32.
        offload_outer_state (`bool`, *optional*, defaults to `False`):
            Keep slow weights and momentum on the CPU to save accelerator memory.

        > Metrics and export

        divergence_steps (`int` or `None`, *optional*, defaults to `None`):
            Compute the exact replica divergence (an all-reduce of the weights) every this many steps, at a
            logging step. `None`: at every evaluation.
        export_replica (`int` or `None`, *optional*, defaults to `None`):
            What `save_model` exports: `None` the consensus (mean of each stage's replicas), or one replica's weights.
    """

    pipeline_stages: int = field(default=1, metadata={"help": "Number of pipeline stages."})
    stage_boundaries: list[int] | None = field(
        default=None,
        metadata={"help": "First decoder layer of stages 1..pipeline_stages-1; None: split as stage_balance says."},
    )
    stage_balance: str = field(
        default="layers", metadata={"help": "Split without stage_boundaries: equal layers, or balanced compute.",
                                    "choices": list(STAGE_BALANCES)}
    )
    microbatch_size: int | None = field(
        default=None, metadata={"help": "Rows per pipeline microbatch; None picks one for a small bubble."}
    )
    pipeline_schedule: str = field(
        default="1f1b", metadata={"help": "Pipeline schedule.", "choices": list(SCHEDULES)}
    )
    p2p_timeout: float = field(default=300.0, metadata={"help": "Seconds to wait for a peer before failing."})
    nonfinite: str = field(
        default="error", metadata={"help": "On a NaN/inf loss or gradient: stop with an error, or skip the step.",
                                   "choices": list(NONFINITE_ACTIONS)}
    )
    routing: str = field(
        default="sample", metadata={"help": "Replica routing between stages.", "choices": list(ROUTING_GRANULARITIES)}
    )
    routing_seed: int | None = field(default=None, metadata={"help": "Shared routing/gossip seed; None uses seed."})
    outer_optimizer: str = field(
        default="noloco", metadata={"help": "Replica synchronisation method.", "choices": list(OUTER_METHODS)}
    )
    inner_steps: int | None = field(default=None, metadata={"help": "H: inner steps per outer step."})
    outer_lr: float | None = field(default=None, metadata={"help": "beta: outer learning rate."})
    outer_momentum: float | None = field(default=None, metadata={"help": "alpha: outer momentum."})
    outer_averaging: float | None = field(default=None, metadata={"help": "gamma: pull towards the group mean."})
    gossip_group_size: int = field(default=2, metadata={"help": "n: replicas averaged together (noloco)."})
    outer_dtype: str = field(
        default="float32", metadata={"help": "Precision of the weights sent in an outer step.", "choices": list(OUTER_DTYPES)}
    )
    offload_outer_state: bool = field(default=False, metadata={"help": "Keep outer state on the CPU."})
    divergence_steps: int | None = field(
        default=None, metadata={"help": "Exact replica divergence every N steps; None: at evaluations."}
    )
    export_replica: int | None = field(
        default=None, metadata={"help": "Export one replica instead of the consensus (replica mean)."}
    )
    # Changed defaults: stages hold different layers, so no token averaging over all ranks (see
    # reference notes), and every replica must see full batches of the same shape.
    average_tokens_across_devices: bool = field(
        default=False, metadata={"help": "Must stay False: ranks hold different stages."}
    )
    dataloader_drop_last: bool = field(default=True, metadata={"help": "Drop the last incomplete batch."})

    def __post_init__(self):
        if not self.use_cpu and not torch.cuda.is_available():
            # Accelerate only picks the gloo (MULTI_CPU) path when told to use the CPU; on a machine without
            # a GPU, launch configs written for GPUs must still work as written.
            self.use_cpu = True
        # Validate first: TrainingArguments.__post_init__ initialises the process group when launched, and a
        # bad setting must fail before that, on every rank alike.
        self._validate()
        if self.routing_seed is None:
            self.routing_seed = self.seed
        self.ddp_timeout = max(int(self.ddp_timeout), int(self.p2p_timeout))
        super().__post_init__()

    @property
    def outer_settings(self) -> dict:
        """inner_steps, outer_lr, outer_momentum, outer_averaging with the method's paper defaults filled in."""
        return resolve_outer_defaults(
            self.outer_optimizer, self.inner_steps, self.outer_lr, self.outer_momentum, self.outer_averaging
        )

    def resolved_microbatch_size(self) -> int:
        if self.microbatch_size is not None:
            return self.microbatch_size
        batch = self.per_device_train_batch_size
        wanted = 2 * self.pipeline_stages if self.pipeline_stages > 1 else 1
        divisors = [m for m in range(batch, 0, -1) if batch % m == 0 and batch // m >= wanted]
        return divisors[0] if divisors else 1

    def _validate(self) -> None:
        def positive_int(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")

        positive_int("pipeline_stages")
        positive_int("per_device_train_batch_size")
        positive_int("per_device_eval_batch_size")
        if self.routing not in ROUTING_GRANULARITIES:
            raise ValueError(f"Unknown routing {self.routing!r}: choose one of {', '.join(ROUTING_GRANULARITIES)}.")
        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(f"pipeline_schedule must be one of {', '.join(SCHEDULES)}, got {self.pipeline_schedule!r}.")
        if self.outer_dtype not in OUTER_DTYPES:
            raise ValueError(f"outer_dtype must be one of {', '.join(OUTER_DTYPES)}, got {self.outer_dtype!r}.")
        if self.nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE_ACTIONS)}, got {self.nonfinite!r}.")
        if not self.p2p_timeout > 0:
            raise ValueError(f"p2p_timeout must be a positive number of seconds, got {self.p2p_timeout!r}.")
        if self.microbatch_size is not None:
            positive_int("microbatch_size")
            if self.per_device_train_batch_size % self.microbatch_size:
                raise ValueError(
                    f"per_device_train_batch_size={self.per_device_train_batch_size} is not a multiple of "
                    f"microbatch_size={self.microbatch_size}."
                )
        if self.divergence_steps is not None:
            positive_int("divergence_steps")
        if self.stage_boundaries is not None and len(self.stage_boundaries) != self.pipeline_stages - 1:
            raise ValueError(
                f"stage_boundaries must list the first layer of stages 1..{self.pipeline_stages - 1} "
                f"({self.pipeline_stages - 1} numbers), got {self.stage_boundaries}."
            )
        # Values that torch's optimizers, numpy's seeding or the Trainer would refuse late, without naming them.
        for name in ("learning_rate", "weight_decay", "adam_epsilon", "warmup_steps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}.")
        for name in ("seed", "data_seed"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 2**32:
                raise ValueError(f"{name} must be in [0, 2**32), got {value}.")
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            raise ValueError(
                f"Nothing to train: max_steps={self.max_steps} and num_train_epochs={self.num_train_epochs}. "
                "Set a positive max_steps or num_train_epochs."
            )
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(
                    f"{name} must be positive (a number of steps, or a fraction of the run below 1), got {value}."
                )
        if self.stage_balance not in STAGE_BALANCES:
            raise ValueError(f"stage_balance must be one of {', '.join(STAGE_BALANCES)}, got {self.stage_balance!r}.")
        if self.stage_boundaries is not None and self.stage_balance != "layers":
            raise ValueError(
                f"stage_boundaries={self.stage_boundaries} and stage_balance={self.stage_balance!r} both choose the "
                "split: set only one."
            )
        if self.fp16:
            raise ValueError("fp16 is not supported (the pipeline has no loss scaling): use bf16=True instead.")
        if self.gradient_accumulation_steps != 1:
            raise ValueError(
                "gradient_accumulation_steps must be 1: the pipeline already accumulates over microbatches. "
                "Raise per_device_train_batch_size (and set microbatch_size) instead."
            )
        if self.average_tokens_across_devices:
            raise ValueError("average_tokens_across_devices must be False: ranks hold different pipeline stages.")
        if self.load_best_model_at_end:
            raise ValueError("load_best_model_at_end is not supported by NoLoCoTrainer.")
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size % self.pipeline_stages:
            raise ValueError(
                f"The world size ({world_size} processes) is not divisible by pipeline_stages="
                f"{self.pipeline_stages}: launch a multiple of {self.pipeline_stages} processes."
            )
        num_replicas = world_size // self.pipeline_stages
        validate_outer_settings(
            self.outer_optimizer, num_replicas, self.gossip_group_size, self.inner_steps, self.outer_lr,
            self.outer_momentum, self.outer_averaging,
        )
        if self.export_replica is not None and not 0 <= self.export_replica < num_replicas:
            raise ValueError(f"export_replica must be in [0, {num_replicas}), got {self.export_replica}.")
