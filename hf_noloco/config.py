"""Every setting of a NoLoCo run: its allowed values, its paper default and its check, each written once.

- :class:`NoLoCoConfig`: ``TrainingArguments`` plus the pipeline, routing and outer-optimizer settings.
- :class:`ModelArguments`, :class:`DataArguments`: what ``hf-noloco-train`` adds (which model, which text).
- :class:`OuterSettings`: the outer optimizer's settings, resolved (paper defaults filled in) and checked,
  as the engine receives them.

Settings flow one way: this module imports no part of the engine. The engine imports the allowed values and
the check functions from here, so a direct Python user of ``PipelineEngine`` or ``OuterOptimizer`` gets the
same error, from the same line, as a recipe user. A field's ``--help`` text is its entry in the class
docstring (:func:`_help_from_docstring`): one text, two places to read it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
import types
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from transformers import TrainingArguments

from .elastic import join_restartable_group

# ----------------------------------------------------------------------------------------------------------
# Allowed values
# ----------------------------------------------------------------------------------------------------------

Routing = Literal["sample", "step", "fixed"]
RoutingDomain = Literal["global", "node"]
PipelineSchedule = Literal["1f1b", "gpipe"]
StageBalance = Literal["layers", "compute"]
OuterMethod = Literal["noloco", "diloco", "ddp", "local"]
OuterDtype = Literal["float32", "bfloat16"]
NonfiniteAction = Literal["error", "skip"]
ReplicaLossAction = Literal["stop", "continue"]

ROUTINGS: tuple[str, ...] = get_args(Routing)
ROUTING_DOMAINS: tuple[str, ...] = get_args(RoutingDomain)
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
STAGE_BALANCES: tuple[str, ...] = get_args(StageBalance)
OUTER_METHODS: tuple[str, ...] = get_args(OuterMethod)
OUTER_DTYPES: tuple[str, ...] = get_args(OuterDtype)
NONFINITE_ACTIONS: tuple[str, ...] = get_args(NonfiniteAction)
REPLICA_LOSS_ACTIONS: tuple[str, ...] = get_args(ReplicaLossAction)

# The weights' dtype (TRL's `dtype`): no float16 without loss scaling; "auto" is the checkpoint's own.
WeightDtype = Literal["float32", "bfloat16", "auto"]
ExportDtype = Literal["float32", "bfloat16"]
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2"]
WEIGHT_DTYPES: tuple[str, ...] = get_args(WeightDtype)
EXPORT_DTYPES: tuple[str, ...] = get_args(ExportDtype)
ATTN_IMPLEMENTATIONS: tuple[str, ...] = get_args(AttnImplementation)
# What model_init_kwargs may hold: the keys TRL scripts put there from ModelConfig.
MODEL_INIT_KEYS = ("dtype", "attn_implementation", "revision", "trust_remote_code")

# Methods with an outer step every `inner_steps` (ddp and local have no outer hyperparameters).
OUTER_STEP_METHODS = ("noloco", "diloco")

# The paper's defaults (Section 4). gamma (outer_averaging) is not stated in the paper; the official code uses
# gamma = beta, written here as None and resolved to outer_lr.
PAPER_DEFAULTS: dict[str, dict[str, float | int | None]] = {
    "noloco": {"inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.5},
    "diloco": {"inner_steps": 100, "outer_lr": 0.7, "outer_momentum": 0.3},
}

# NCCL's default error handling (1: tear down) kills the process within ~100 ms of a failed or timed-out
# operation, before a NoLoCo rank can find and name the lost peer. 2 (clean up only) aborts the communicator
# and raises in the waiting rank instead; a value already set by the user is kept.
NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}

BUILTIN_DATASET = "builtin:python-docs"
DATA_FILE_EXTENSIONS = (".txt", ".json", ".jsonl", ".parquet")


# ----------------------------------------------------------------------------------------------------------
# Checks shared by the settings and the engine
# ----------------------------------------------------------------------------------------------------------


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}.")


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def mesh_shape(world_size: int, pipeline_stages: int) -> tuple[int, int]:
    """``(num_replicas, num_stages)`` for ``world_size`` processes, or a clear error."""
    check_positive_int("pipeline_stages", pipeline_stages)
    if world_size % pipeline_stages:
        raise ValueError(
            f"The world size ({world_size} processes) is not divisible by pipeline_stages={pipeline_stages}: "
            f"launch a multiple of {pipeline_stages} processes (num_replicas x pipeline_stages)."
        )
    return world_size // pipeline_stages, pipeline_stages


def check_stage_boundaries(boundaries, num_stages: int, num_layers: int | None = None) -> None:
    """``boundaries`` lists the first decoder layer of stages 1..num_stages-1; with ``num_layers``, also
    checks
    that every stage gets at least one layer."""
    if boundaries is None:
        return
    if len(boundaries) != num_stages - 1:
        raise ValueError(
            f"stage_boundaries must list the first layer of stages 1..{num_stages - 1} "
            f"({num_stages - 1} numbers), got {list(boundaries)}."
        )
    if num_layers is None:
        return
    starts = [0, *boundaries]
    if any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= num_layers:
        raise ValueError(
            f"stage_boundaries {list(boundaries)} do not split layers 0..{num_layers - 1} into {num_stages} "
            "non-empty stages: they must be strictly increasing, above 0 and below the layer count."
        )


def check_microbatch_size(rows: int, microbatch_size: int, what: str = "per_device_train_batch_size") -> None:
    check_positive_int("microbatch_size", microbatch_size)
    if rows % microbatch_size:
        raise ValueError(f"{what} has {rows} rows, not a multiple of microbatch_size={microbatch_size}.")


def check_export_replica(replica: int | None, num_replicas: int) -> None:
    if replica is not None and not 0 <= replica < num_replicas:
        raise ValueError(f"export_replica must be in [0, {num_replicas}), got {replica}.")


PEFT_INSTALL_HINT = "pip install 'hf-noloco[peft]'"


def check_lora_settings(r, alpha, dropout, target_modules) -> None:
    """LoRA's settings, and that PEFT is installed (an optional dependency)."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"lora_r must be a positive integer, got {r!r}.")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0):
        raise ValueError(f"lora_alpha must be a positive number, got {alpha!r}.")
    if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
        raise ValueError(f"lora_dropout must be in [0, 1), got {dropout!r}.")
    if target_modules is not None and (
        isinstance(target_modules, str)
        or not target_modules
        or not all(isinstance(t, str) and t for t in target_modules)
    ):
        raise ValueError(
            f"lora_target_modules must be a non-empty list of module names (or ['all-linear']), got "
            f"{target_modules!r}."
        )
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ValueError(
            f"use_peft needs the PEFT library, an optional dependency: {PEFT_INSTALL_HINT}."
        ) from None


def check_model_init_kwargs(kwargs) -> dict:
    """``model_init_kwargs`` as a checked dict (a JSON string is parsed): only :data:`MODEL_INIT_KEYS`, each
    with an allowed value. ``flash_attention_2`` is refused where the ``flash_attn`` package is not
    installed."""
    if kwargs is None:
        return {}
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            kwargs = None
    if not isinstance(kwargs, dict):
        raise ValueError(
            f'model_init_kwargs must be a mapping such as {{"dtype": "bfloat16"}}, got {kwargs!r}.'
        )
    unknown = sorted(set(kwargs) - set(MODEL_INIT_KEYS))
    if unknown:
        raise ValueError(
            f"model_init_kwargs: unsupported key {unknown[0]!r}; the keys are {', '.join(MODEL_INIT_KEYS)}."
        )
    dtype = kwargs.get("dtype")
    if dtype is not None:
        dtype = str(dtype).removeprefix("torch.")
        if dtype in ("float16", "half"):
            raise ValueError(
                "dtype float16 is not supported (the pipeline has no loss scaling): use bfloat16 instead."
            )
        check_choice("dtype", dtype, WEIGHT_DTYPES)
    attn = kwargs.get("attn_implementation")
    if attn is not None:
        check_choice("attn_implementation", attn, ATTN_IMPLEMENTATIONS)
        if attn == "flash_attention_2":
            from transformers.utils import is_flash_attn_2_available

            if not is_flash_attn_2_available():
                raise ValueError(
                    "attn_implementation flash_attention_2 needs the flash_attn package and a GPU it "
                    "supports (pip install flash-attn); use sdpa (the default) otherwise."
                )
    revision = kwargs.get("revision")
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise ValueError(f"model_revision must be a branch, tag or commit name, got {revision!r}.")
    trust = kwargs.get("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise ValueError(f"trust_remote_code must be true or false, got {trust!r}.")
    return {**kwargs, **({"dtype": dtype} if dtype is not None else {})}


def processes_per_node() -> int:
    """Processes this launch runs on each node: ``LOCAL_WORLD_SIZE`` (set by torchrun and accelerate), or the
    whole world when it is unset (a single-machine launch)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def routing_group_size(
    domain: str,
    group_size: int | None,
    num_replicas: int,
    pipeline_stages: int,
    procs_per_node: int | None = None,
) -> int:
    """Replicas per routing group: all of them (``global``), or those whose replica columns share a node
    (``node``): ``group_size`` if given, else ``procs_per_node // pipeline_stages``. Ranks are
    ``replica * pipeline_stages + stage`` and a node holds consecutive ranks, so the replicas of one node are
    consecutive and their whole columns sit on it exactly when ``pipeline_stages`` divides the processes per
    node."""
    check_choice("routing_domain", domain, ROUTING_DOMAINS)
    if group_size is not None:
        if domain != "node":
            raise ValueError(
                f"routing_group_size={group_size} only applies to routing_domain='node' (got {domain!r})."
            )
        check_positive_int("routing_group_size", group_size)
    if domain == "global":
        return num_replicas
    if group_size is None:
        procs_per_node = processes_per_node() if procs_per_node is None else procs_per_node
        if procs_per_node % pipeline_stages:
            raise ValueError(
                f"routing_domain='node' needs every replica column on one node, but pipeline_stages="
                f"{pipeline_stages} does not divide the {procs_per_node} processes per node: launch a "
                "multiple of pipeline_stages per node, or set routing_group_size explicitly."
            )
        group_size = max(procs_per_node // pipeline_stages, 1)
        group_size = min(group_size, num_replicas)
    if num_replicas % group_size:
        raise ValueError(
            f"routing_group_size={group_size} does not divide the {num_replicas} replicas per stage."
        )
    return group_size


def is_local_dataset_path(name: str) -> bool:
    """Whether ``dataset_name`` means local files. Hub names are ``name`` or ``owner/name``; anything with a
    file extension we read, or that starts like a filesystem path, is local, and must then exist (never fall
    through
    to the Hub)."""
    return (
        os.path.exists(os.path.expanduser(name))
        or name.startswith(("/", ".", "~"))
        or os.path.splitext(name)[1].lower() in DATA_FILE_EXTENSIONS
        or name.count("/") > 1
    )


# ----------------------------------------------------------------------------------------------------------
# Outer optimizer
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OuterSettings:
    """The outer optimizer's settings as :class:`~hf_noloco.outer.OuterOptimizer` receives them.

    ``None`` hyperparameters become the paper's default for ``method`` (gamma: equal to beta), then every
    value is checked. ``ddp`` and ``local`` have no outer step: their hyperparameters stay ``None`` and are
    unused. Ranges: ``inner_steps`` >= 1; ``0 < outer_lr <= 2`` and ``0 <= outer_averaging <= 2`` (above 2 a
    pull towards the group mean overshoots by more than the distance it closes, so replicas drift apart);
    ``0 <= outer_momentum < 1`` (heavy-ball momentum of 1 or more never forgets).

    Attributes:
        method: ``"noloco"``, ``"diloco"``, ``"ddp"`` or ``"local"``.
        inner_steps, outer_lr, outer_momentum, outer_averaging: H, beta, alpha, gamma.
        group_size: n, replicas averaged together at a noloco outer step (2: pairs).
        dtype: what crosses the network at an outer step (``"bfloat16"`` halves the bytes; the outer state
            itself stays float32).
        offload: keep the slow weights and the momentum on the CPU.
        seed: shared by every rank; draws the gossip groups.
        overlap_steps: tau, inner steps that run while an outer step's exchange is in flight (0: the exchange
            blocks, as without overlap). In [0, inner_steps]; noloco and diloco only.
    """

    method: OuterMethod = "noloco"
    inner_steps: int | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_averaging: float | None = None
    group_size: int = 2
    dtype: OuterDtype = "float32"
    offload: bool = False
    seed: int = 0
    overlap_steps: int = 0

    def __post_init__(self):
        check_choice("outer_optimizer", self.method, OUTER_METHODS)
        check_choice("outer_dtype", self.dtype, OUTER_DTYPES)
        if isinstance(self.overlap_steps, bool) or not isinstance(self.overlap_steps, int):
            raise ValueError(f"outer_overlap_steps must be an integer, got {self.overlap_steps!r}.")
        if not self.has_outer_step:
            if self.overlap_steps:
                raise ValueError(
                    f"outer_overlap_steps={self.overlap_steps} needs an outer step to overlap: it applies to "
                    f"outer_optimizer 'noloco' and 'diloco', not {self.method!r}."
                )
            return
        if self.method != "noloco" and self.outer_averaging is not None:
            raise ValueError("outer_averaging (gamma) only applies to outer_optimizer='noloco'.")
        defaults = PAPER_DEFAULTS[self.method]
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if self.method == "noloco" and self.outer_averaging is None:
            object.__setattr__(self, "outer_averaging", self.outer_lr)
        if (
            isinstance(self.inner_steps, bool)
            or not isinstance(self.inner_steps, int)
            or self.inner_steps < 1
        ):
            raise ValueError(
                "inner_steps (H, inner steps per outer step) must be a positive integer, got "
                f"{self.inner_steps!r}."
            )
        if not 0 <= self.overlap_steps <= self.inner_steps:
            raise ValueError(
                f"outer_overlap_steps (tau) must be in [0, inner_steps={self.inner_steps}]: an outer step's "
                f"exchange must end before the next one starts, got {self.overlap_steps}."
            )
        if not (math.isfinite(self.outer_lr) and 0 < self.outer_lr <= 2):
            raise ValueError(
                f"outer_lr (beta) must be in (0, 2], got {self.outer_lr!r} (the paper uses 0.7)."
            )
        if not (math.isfinite(self.outer_momentum) and 0 <= self.outer_momentum < 1):
            raise ValueError(
                f"outer_momentum (alpha) must be in [0, 1), got {self.outer_momentum!r} "
                f"(the paper uses {defaults['outer_momentum']})."
            )
        if self.method == "noloco":
            if not (math.isfinite(self.outer_averaging) and 0 <= self.outer_averaging <= 2):
                raise ValueError(
                    f"outer_averaging (gamma) must be in [0, 2], got {self.outer_averaging!r} "
                    "(the official code uses gamma = outer_lr)."
                )
            if (
                isinstance(self.group_size, bool)
                or not isinstance(self.group_size, int)
                or self.group_size < 2
            ):
                raise ValueError(
                    "gossip_group_size must be an integer >= 2 (a replica and at least one partner), "
                    f"got {self.group_size!r}."
                )

    @property
    def has_outer_step(self) -> bool:
        return self.method in OUTER_STEP_METHODS

    @property
    def sends_slow_weights(self) -> bool:
        """With gamma == beta the slow weights cancel out of the update: only fast weights travel."""
        return self.method == "noloco" and self.outer_averaging != self.outer_lr

    def check_replicas(self, num_replicas: int) -> None:
        """Refuses a mesh this method cannot run on."""
        if self.method != "noloco":
            return
        if num_replicas < 2:
            raise ValueError(
                "outer method 'noloco' needs at least 2 replicas per stage: with a single replica there is "
                "no "
                "partner to average with. Use outer_optimizer='local' (no sync) instead, or launch more "
                "processes."
            )
        if self.group_size > num_replicas:
            raise ValueError(
                f"gossip_group_size={self.group_size} is larger than the {num_replicas} replicas per stage: "
                "use "
                f"at most {num_replicas}."
            )


# ----------------------------------------------------------------------------------------------------------
# Help texts from docstrings
# ----------------------------------------------------------------------------------------------------------

_DOC_ENTRY = re.compile(r"^(\w+) \(.*\):$")


def docstring_entries(doc: str) -> dict[str, str]:
    """``{name: description}`` of a docstring's ``Parameters:`` entries (``name (`type`, ...):`` then an
    indented
    description), each description joined into one paragraph."""
    entries: dict[str, str] = {}
    name, indent = None, 0
    for line in inspect.cleandoc(doc or "").splitlines():
        stripped = line.strip()
        match = _DOC_ENTRY.match(stripped)
        if match:
            name, indent = match.group(1), len(line) - len(line.lstrip())
            entries[name] = ""
        elif name is not None and stripped and len(line) - len(line.lstrip()) > indent:
            entries[name] = f"{entries[name]} {stripped}".strip()
        elif stripped:
            name = None
    return entries


def _help_from_docstring(cls):
    """Gives every field documented in ``cls``'s docstring that entry as its ``--help`` text."""
    entries = docstring_entries(cls.__doc__)
    for f in dataclasses.fields(cls):
        if f.name in entries and f.name in cls.__annotations__:  # fields declared here, not inherited ones
            f.metadata = types.MappingProxyType({**f.metadata, "help": entries[f.name]})
    return cls


# ----------------------------------------------------------------------------------------------------------
# NoLoCoConfig
# ----------------------------------------------------------------------------------------------------------


@_help_from_docstring
@dataclass
class NoLoCoConfig(TrainingArguments):
    r"""
    Configuration for [`NoLoCoTrainer`]: everything [`~transformers.TrainingArguments`] has, plus the settings
    below. ``per_device_train_batch_size`` is the batch of one replica column (every stage of a column sees
    the same batch); the global batch is that times the number of replicas.

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
        pipeline_schedule (`str`, *optional*, defaults to `"1f1b"`):
            Order of forwards and backwards within a step: `"1f1b"` (a stage holds the activations of at most
            `pipeline_stages - stage` microbatches) or `"gpipe"` (all forwards, then all backwards; holds
            every microbatch). Both give the same gradients.
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
            hf_noloco.column_launch`, whose store outlives every worker; see `hf_noloco/membership.py`).
            A rank is lost when killed, or when its heartbeat in the store stops for `min(p2p_timeout, 10)`
            seconds (frozen, cut off). The step during which the loss happened is skipped by the survivors
            that had not finished it; the lost column's data shard is skipped for the rest of the run;
            routing pairs and gossip groups are drawn among the live replicas; checkpoints, metrics and the
            export cover the live replicas. A checkpoint written after a loss cannot be resumed yet.

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
            Precision of the weights sent in an outer step: `"float32"` or `"bfloat16"` (half the bytes). The
            outer state itself (slow weights, momentum) always stays float32.
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
            weights, gradients and optimizer state in bf16, half the memory of float32, while the outer
            state, slow weights and momentum, stays float32 so that NoLoCo's small averaged updates are not
            rounded away; `"auto"`: the checkpoint's own dtype, float32 for a float16 one),
            `attn_implementation` (`"sdpa"`, the default, `"eager"`, or `"flash_attention_2"` where the
            flash_attn package is installed), `revision` (a Hub branch, tag or commit) and
            `trust_remote_code` (run the checkpoint's own modelling code; it must still be a Llama-family
            model).
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
        loss_chunk_tokens (`int` or `None`, *optional*, defaults to `1024`):
            The last stage scores a microbatch's positions this many at a time and recomputes each chunk's
            logits in the backward pass, so it never holds the full float32 logits (rows x tokens x vocabulary
            x 4 bytes: 8 GiB for 4 x 4096 tokens of Llama-3's 128k vocabulary), for one more `lm_head`
            forward. Microbatches with fewer positions are scored at once. `None`: never chunk.

        > Metrics and export

        divergence_steps (`int` or `None`, *optional*, defaults to `None`):
            Compute the exact replica divergence (an all-reduce of the weights) every this many steps, at a
            logging step. `None`: at every evaluation.
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
            Must stay `"end"`: the exported model is pushed by `push_to_hub`; checkpoints are per-rank shards
            that are never uploaded.
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
    pipeline_schedule: PipelineSchedule = "1f1b"
    p2p_timeout: float = 300.0
    nonfinite: NonfiniteAction = "error"
    on_replica_loss: ReplicaLossAction = "stop"
    routing: Routing = "sample"
    routing_seed: int | None = None
    routing_domain: RoutingDomain = "global"
    routing_group_size: int | None = None
    outer_optimizer: OuterMethod = "noloco"
    inner_steps: int | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_averaging: float | None = None
    gossip_group_size: int = 2
    outer_dtype: OuterDtype = "float32"
    offload_outer_state: bool = False
    model_init_kwargs: dict | str | None = None
    # Redeclared to carry this class's --help (TrainingArguments': nargs="?" makes a bare flag mean True).
    activation_checkpointing: bool | None = field(default=None, metadata={"nargs": "?", "const": True})
    loss_chunk_tokens: int | None = 1024
    outer_overlap_steps: int = 0
    divergence_steps: int | None = None
    export_replica: int | None = None
    merge_adapter: bool = False
    export_dtype: ExportDtype | None = None
    # Changed defaults of TrainingArguments fields.
    average_tokens_across_devices: bool = False
    dataloader_drop_last: bool = True
    hub_strategy: str = "end"

    def __post_init__(self):
        if not self.use_cpu and not torch.cuda.is_available():
            # Accelerate only picks the gloo (MULTI_CPU) path when told to use the CPU; on a machine without
            # a GPU, launch configs written for GPUs must still work as written.
            self.use_cpu = True
        # Checked first: TrainingArguments.__post_init__ joins the process group when launched, and a bad
        # setting must fail before that, on every rank alike.
        check_config(self)
        self.model_init_kwargs = check_model_init_kwargs(self.model_init_kwargs)
        for name, value in NCCL_ENVIRONMENT.items():  # read when the NCCL group is made, just below
            os.environ.setdefault(name, value)
        if self.routing_seed is None:
            self.routing_seed = self.seed
        self.ddp_timeout = max(int(self.ddp_timeout), int(self.p2p_timeout))
        # Under torchrun/accelerate with --max-restarts, each attempt joins a process group of its own
        # (elastic.py says why); Accelerate then keeps that group.
        join_restartable_group(self.ddp_backend or ("gloo" if self.use_cpu else "nccl"), self.ddp_timeout)
        super().__post_init__()

    @property
    def outer_settings(self) -> OuterSettings:
        """The outer optimizer's settings, the paper's defaults filled in."""
        return outer_settings_of(self)

    def resolved_routing_group_size(self, num_replicas: int) -> int:
        """Replicas per routing group for this launch (see ``routing_domain``)."""
        return routing_group_size(
            self.routing_domain, self.routing_group_size, num_replicas, self.pipeline_stages
        )

    def resolved_microbatch_size(self) -> int:
        if self.microbatch_size is not None:
            return self.microbatch_size
        batch = self.per_device_train_batch_size
        wanted = 2 * self.pipeline_stages if self.pipeline_stages > 1 else 1
        divisors = [m for m in range(batch, 0, -1) if batch % m == 0 and batch // m >= wanted]
        return divisors[0] if divisors else 1


def outer_settings_of(c) -> OuterSettings:
    seed = c.routing_seed if c.routing_seed is not None else c.seed
    return OuterSettings(
        method=c.outer_optimizer,
        inner_steps=c.inner_steps,
        outer_lr=c.outer_lr,
        outer_momentum=c.outer_momentum,
        outer_averaging=c.outer_averaging,
        group_size=c.gossip_group_size,
        dtype=c.outer_dtype,
        offload=c.offload_outer_state,
        seed=seed,
        overlap_steps=c.outer_overlap_steps,
    )


def check_config(c) -> None:
    """Every check of :class:`NoLoCoConfig`. ``c`` is the config, or any object with its attributes (the
    command checks its parsed options before the config joins the process group)."""
    for name in ("pipeline_stages", "per_device_train_batch_size", "per_device_eval_batch_size"):
        check_positive_int(name, getattr(c, name))
    check_choice("routing", c.routing, ROUTINGS)
    check_choice("routing_domain", c.routing_domain, ROUTING_DOMAINS)
    if c.routing_group_size is not None:  # the launch-dependent checks come with the mesh shape, below
        routing_group_size(c.routing_domain, c.routing_group_size, c.routing_group_size, 1)
    check_choice("pipeline_schedule", c.pipeline_schedule, PIPELINE_SCHEDULES)
    check_choice("stage_balance", c.stage_balance, STAGE_BALANCES)
    check_choice("nonfinite", c.nonfinite, NONFINITE_ACTIONS)
    check_replica_loss(c)
    if not c.p2p_timeout > 0:
        raise ValueError(f"p2p_timeout must be a positive number of seconds, got {c.p2p_timeout!r}.")
    if c.microbatch_size is not None:
        check_microbatch_size(c.per_device_train_batch_size, c.microbatch_size)
    if c.divergence_steps is not None:
        check_positive_int("divergence_steps", c.divergence_steps)
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
    if c.gradient_accumulation_steps != 1:
        raise ValueError(
            "gradient_accumulation_steps must be 1: the pipeline already accumulates over microbatches. "
            "Raise per_device_train_batch_size (and set microbatch_size) instead."
        )
    if c.average_tokens_across_devices:
        raise ValueError("average_tokens_across_devices must be False: ranks hold different pipeline stages.")
    if c.load_best_model_at_end:
        raise ValueError("load_best_model_at_end is not supported by NoLoCoTrainer.")
    check_unhonoured(c)
    check_model_init_kwargs(c.model_init_kwargs)
    if c.loss_chunk_tokens is not None:
        check_positive_int("loss_chunk_tokens", c.loss_chunk_tokens)
    if c.export_dtype is not None:
        if c.export_dtype in ("float16", "half"):
            raise ValueError("export_dtype float16 is not supported: use bfloat16 or float32.")
        check_choice("export_dtype", c.export_dtype, EXPORT_DTYPES)
    _check_activation_checkpointing(c)
    _check_trainer_extras(c)
    num_replicas, _ = mesh_shape(int(os.environ.get("WORLD_SIZE", "1")), c.pipeline_stages)
    settings = outer_settings_of(c)
    settings.check_replicas(num_replicas)
    routing_group_size(c.routing_domain, c.routing_group_size, num_replicas, c.pipeline_stages)
    check_export_replica(c.export_replica, num_replicas)


def check_replica_loss(c) -> None:
    """``on_replica_loss="continue"`` needs an algorithm whose training path has no collective over the
    replicas, a backend whose groups survive a lost member, and a store that outlives every worker."""
    action = getattr(c, "on_replica_loss", "stop")
    check_choice("on_replica_loss", action, REPLICA_LOSS_ACTIONS)
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
            "the "
            "live replicas."
        )
    if (not c.use_cpu and torch.cuda.is_available()) or c.ddp_backend not in (None, "gloo"):
        raise ValueError(
            "on_replica_loss='continue' runs on gloo (CPU) only: an NCCL communicator with a lost member "
            "aborts, and survivors cannot keep it."
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (
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
    "enable_jit_checkpoint": (False, "a checkpoint is a collective of every rank, not a signal handler's"),
    "hub_always_push": (False, "only the exported model is pushed, once (hub_strategy='end')"),
    "eval_accumulation_steps": (None, "evaluation gathers no predictions, only loss sums"),
    "eval_use_gather_object": (False, "evaluation gathers no predictions, only loss sums"),
    "eval_do_concat_batches": (True, "evaluation gathers no predictions, only loss sums"),
    "batch_eval_metrics": (False, "evaluation computes loss and perplexity only (no compute_metrics)"),
    "include_for_metrics": ([], "evaluation computes loss and perplexity only (no compute_metrics)"),
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
    strategy = str(getattr(c.hub_strategy, "value", c.hub_strategy))
    if strategy != "end":
        raise ValueError(
            f"hub_strategy={strategy!r} is not supported by NoLoCoTrainer: checkpoints are per-rank shards "
            "that are never uploaded; push_to_hub uploads the exported model (hub_strategy='end')."
        )
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
        from .hub import check_hub_settings

        check_hub_settings(True, c.hub_model_id, c.hub_token)
    resume = c.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() not in ("true", "last") and not os.path.isdir(resume):
        raise ValueError(f"resume_from_checkpoint: no such checkpoint folder {resume!r}.")


# ----------------------------------------------------------------------------------------------------------
# What the command adds: the model and the data
# ----------------------------------------------------------------------------------------------------------

# model_config sizes that must be positive integers (transformers would fail later, in its own words)
_MODEL_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "head_dim",
)


@_help_from_docstring
@dataclass
class ModelArguments:
    r"""
    Which model `hf-noloco-train` trains. Give exactly one of `model_name_or_path` and `model_config`; one
    given on the command line replaces the recipe's.

    Parameters:
        model_name_or_path (`str` or `None`, *optional*, defaults to `None`):
            Fine-tune this Llama-family checkpoint: a Hub id or a local folder of safetensors weights. Each
            process reads only its own stage's tensors.
        model_config (`dict`, `str` or `None`, *optional*, defaults to `None`):
            Pretrain from scratch: the model's config as a mapping with a `model_type` (in a recipe), a JSON
            object (on the command line) or the path of a `config.json`.
        tokenizer_name_or_path (`str` or `None`, *optional*, defaults to `None`):
            The tokenizer (Hub id or folder). `None`: the checkpoint's, or, from scratch, a byte-level BPE
            tokenizer trained on the training documents and saved in `output_dir/tokenizer`.
        tokenizer_vocab_size (`int`, *optional*, defaults to `4096`):
            Vocabulary of the BPE tokenizer trained from scratch (at least 259: 256 bytes and 3 special
            tokens).
        model_revision (`str` or `None`, *optional*, defaults to `None`):
            The Hub branch, tag or commit of `model_name_or_path` (and of its tokenizer). `None`: `main`.
        dtype (`str` or `None`, *optional*, defaults to `None`):
            The weights' dtype: `"float32"` (what `None` means), `"bfloat16"` (weights, gradients and
            optimizer state in bf16; the outer state stays float32) or `"auto"` (the checkpoint's own). The
            export is written in it unless `export_dtype` says otherwise. float16 is refused (no loss
            scaling).
        attn_implementation (`str` or `None`, *optional*, defaults to `None`):
            `"sdpa"` (what `None` means), `"eager"`, or `"flash_attention_2"` where the flash_attn package is
            installed.
        trust_remote_code (`bool`, *optional*, defaults to `False`):
            Allow the checkpoint's own modelling code (`auto_map` in its config) to run. The model must still
            be laid out like Llama; anything else is refused with the list of what it lacks.

        > LoRA (PEFT)

        use_peft (`bool`, *optional*, defaults to `False`):
            Fine-tune LoRA adapters (through PEFT, `pip install 'hf-noloco[peft]'`) instead of the whole
            model: each stage gets the adapters of its own layers, the base weights stay frozen, and only the
            adapters train, cross the network at an outer step, and go into checkpoints. The export is a PEFT
            adapter (or, with `merge_adapter`, the merged model). Needs `model_name_or_path`.
        lora_r (`int`, *optional*, defaults to `16`):
            LoRA rank: the inner dimension of each adapter's two factors.
        lora_alpha (`int`, *optional*, defaults to `32`):
            LoRA scaling numerator: the adapter's update is scaled by `lora_alpha / lora_r`.
        lora_dropout (`float`, *optional*, defaults to `0.05`):
            Dropout on the adapters' input, in [0, 1).
        lora_target_modules (`list[str]` or `None`, *optional*, defaults to `None`):
            Names of the modules that get adapters (e.g. `q_proj v_proj`), or `all-linear` (every linear layer
            of the decoder layers). Every pipeline stage must hold at least one. `None`: PEFT's default for
            the architecture (`q_proj` and `v_proj` for Llama-family models).
    """

    model_name_or_path: str | None = None
    model_config: dict | str | None = None
    tokenizer_name_or_path: str | None = None
    tokenizer_vocab_size: int = 4096
    model_revision: str | None = None
    dtype: WeightDtype | None = None
    attn_implementation: AttnImplementation | None = None
    trust_remote_code: bool = False
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None

    def __post_init__(self):
        if (self.model_name_or_path is None) == (self.model_config is None):
            raise ValueError(
                "Give exactly one of model_name_or_path (fine-tune) or model_config (pretrain from scratch)."
            )
        if self.use_peft:
            check_lora_settings(self.lora_r, self.lora_alpha, self.lora_dropout, self.lora_target_modules)
            if self.model_name_or_path is None:
                raise ValueError(
                    "use_peft fine-tunes LoRA adapters on a pretrained model: give model_name_or_path (a "
                    "model from scratch has nothing worth freezing)."
                )
        if self.model_revision is not None and self.model_name_or_path is None:
            raise ValueError("model_revision applies to model_name_or_path, not to a model_config.")
        check_model_init_kwargs(self.model_init_kwargs())
        if self.model_config is not None:
            self.model_config = model_config_values(self.model_config)
            if self.tokenizer_name_or_path is None and self.tokenizer_vocab_size < 259:
                raise ValueError(
                    "tokenizer_vocab_size must be at least 259 for a byte-level BPE tokenizer, got "
                    f"{self.tokenizer_vocab_size}."
                )

    def model_init_kwargs(self) -> dict:
        """The settings given here, as :class:`NoLoCoConfig`'s ``model_init_kwargs`` holds them."""
        values = {
            "dtype": self.dtype,
            "attn_implementation": self.attn_implementation,
            "revision": self.model_revision,
            "trust_remote_code": self.trust_remote_code or None,
        }
        return {k: v for k, v in values.items() if v is not None}


def model_config_values(spec: dict | str) -> dict:
    """``model_config`` as a checked dict: a mapping, a JSON object or a config.json path, with a
    ``model_type``
    and positive sizes."""
    values = spec
    if isinstance(spec, str) and os.path.isfile(spec):
        try:
            with open(spec) as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"model_config: {spec} is not a readable JSON file ({exc}).") from None
    elif isinstance(spec, str):
        try:
            values = json.loads(spec)
        except json.JSONDecodeError:
            raise ValueError(
                f"model_config is neither a config.json path nor a JSON dict: {spec!r}"
            ) from None
    if not isinstance(values, dict):
        raise ValueError(
            f"model_config must be a mapping of config fields (with a model_type), got {spec!r}."
        )
    if "model_type" not in values:
        raise ValueError("model_config needs a model_type (e.g. llama, mistral, qwen2).")
    for name in _MODEL_SIZES:
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"model_config: {name} must be a positive integer, got {value!r}.")
    return values


@_help_from_docstring
@dataclass
class DataArguments:
    r"""
    Which text `hf-noloco-train` trains and evaluates on.

    Parameters:
        dataset_name (`str`, *optional*, defaults to `"builtin:python-docs"`):
            A Hub dataset name, a local `.txt`/`.json`/`.jsonl`/`.parquet` file or folder of them, or
            `"builtin:python-docs"`: CPython's own English documentation, which needs no network.
        dataset_config (`str` or `None`, *optional*, defaults to `None`):
            The Hub dataset's configuration name (e.g. `wikitext-103-raw-v1`).
        text_column (`str`, *optional*, defaults to `"text"`):
            The column holding the documents' text.
        block_size (`int`, *optional*, defaults to `256`):
            Tokens per training sequence: documents are concatenated (an end-of-text token after each) and cut
            into blocks of this many tokens.
        validation_split_percentage (`float`, *optional*, defaults to `5`):
            Share of the documents held out for evaluation when the dataset has no validation or test split,
            in [0, 100); chosen by a seeded shuffle of documents (with `streaming`, by a hash of each row's
            content), so no block mixes both sides.
        max_train_samples (`int` or `None`, *optional*, defaults to `None`):
            Keep only the first this many training rows (blocks). With `streaming`, an epoch ends after this
            many blocks over all replicas.
        max_eval_samples (`int` or `None`, *optional*, defaults to `None`):
            Evaluate on at most this many rows (blocks of `block_size` tokens) over all replicas: the first
            ones of the evaluation split, the same at every evaluation. Needed with `streaming` when the
            dataset has no validation split.
        preprocessing_num_proc (`int` or `None`, *optional*, defaults to `None`):
            Processes used to tokenize and pack the dataset (not with `streaming`).
        streaming (`bool`, *optional*, defaults to `False`):
            Read the dataset as a stream (a Hub dataset or local files) instead of downloading and tokenizing
            it first: each replica reads its own shard (whole files when their count divides by the number of
            replicas), tokenizes and packs on the fly, and a checkpoint records where it is, so a resumed run
            continues at the very next block. Nothing is cached and no rank waits for another. Streams are
            read in the source's order (not shuffled), need `max_steps`, and evaluation needs
            `max_eval_samples` when the dataset has no validation split (rows are then held out by a hash of
            their content).
        packing (`bool` or `None`, *optional*, defaults to `None`):
            `True`: concatenate the documents and cut the stream into blocks of `block_size` tokens (blocks
            span documents, and attention crosses from one into the next, as in pretraining). `False`: one
            document per row, truncated to `block_size` and right-padded to it (padding masked out of
            attention and loss), so attention never crosses documents. `None`: `True` for text and
            pre-tokenized rows, `False` for conversations and prompt/completion pairs (which cannot be
            packed).
        add_bos (`bool` or `None`, *optional*, defaults to `None`):
            Put the tokenizer's beginning-of-text token before each text document (and plain prompt/completion
            pair). `None`: if the tokenizer adds one itself (Llama's does; GPT-2's and Qwen's do not). Chat
            templates and pre-tokenized rows keep their own tokens.
        add_eos (`bool` or `None`, *optional*, defaults to `None`):
            Put the tokenizer's end-of-text token after each text document (and plain prompt/completion pair),
            which tells a packed model where documents end. `None`: `True`.
        assistant_only_loss (`bool`, *optional*, defaults to `False`):
            For conversations (a `messages` column, rendered with the tokenizer's chat template): train only
            on the assistant turns, end-of-turn tokens included; every other label is -100.
        completion_only_loss (`bool` or `None`, *optional*, defaults to `None`):
            For `prompt`/`completion` rows: train only on the completion. `None`: `True` for such rows.
        pad_token (`str` or `None`, *optional*, defaults to `None`):
            The token that pads rows to `block_size` (never seen by the model: masked out of attention and
            loss). `None`: the tokenizer's own padding token, or its end-of-text token when it has none (the
            exported tokenizer keeps it as its padding token).
    """

    dataset_name: str = BUILTIN_DATASET
    dataset_config: str | None = None
    text_column: str = "text"
    block_size: int = 256
    validation_split_percentage: float = 5
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    preprocessing_num_proc: int | None = None
    streaming: bool = False
    packing: bool | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    assistant_only_loss: bool = False
    completion_only_loss: bool | None = None
    pad_token: str | None = None

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}.")
        if self.streaming and self.preprocessing_num_proc is not None:
            raise ValueError(
                "preprocessing_num_proc does nothing with streaming=True (each replica tokenizes its own "
                "rows as it reads them): remove it."
            )
        if self.streaming and self.dataset_name == BUILTIN_DATASET and self.max_eval_samples is None:
            raise ValueError(
                "Streaming the built-in corpus (which has no validation split) needs max_eval_samples."
            )
        if self.packing and (self.assistant_only_loss or self.completion_only_loss):
            raise ValueError(
                "packing=True cannot go with assistant_only_loss or completion_only_loss: conversations and "
                "prompt/completion pairs are padded, one per row, so that attention never crosses them."
            )
        if self.assistant_only_loss and self.completion_only_loss:
            raise ValueError(
                "assistant_only_loss (for `messages` rows) and completion_only_loss (for "
                "`prompt`/`completion` rows) apply to different formats: set the one of your dataset."
            )
        for name in ("max_train_samples", "max_eval_samples", "preprocessing_num_proc"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}.")
        if not 0 <= self.validation_split_percentage < 100:
            raise ValueError(
                f"validation_split_percentage must be in [0, 100), got {self.validation_split_percentage}."
            )
        name = self.dataset_name
        if (
            name != BUILTIN_DATASET
            and is_local_dataset_path(name)
            and not os.path.exists(os.path.expanduser(name))
        ):
            raise ValueError(f"dataset_name: no such file or folder {name!r}.")
