"""The ground floor: every setting's allowed values, the paper's defaults, and the rules that check them.

Each rule is one function, written once and called wherever it applies: by :class:`~hf_noloco.NoLoCoConfig`
for a recipe user, and by the engine's classes for a direct Python user of ``PipelineEngine`` or
``OuterOptimizer``, so both get the same error from the same line. This module imports neither torch nor
transformers: every other layer imports it, and it imports nothing of the package.

Elsewhere: the mesh's arithmetic (:mod:`hf_noloco.engine.shape`), the rule for local dataset paths
(:mod:`hf_noloco.data.arguments`) and the docstring convention of the settings classes
(:mod:`hf_noloco.docstrings`).
"""

from __future__ import annotations

import json
import math
import os
from typing import Literal, get_args

# ----------------------------------------------------------------------------------------------------------
# Allowed values
# ----------------------------------------------------------------------------------------------------------

Routing = Literal["sample", "step", "fixed"]
RoutingDomain = Literal["global", "node"]
PipelineSchedule = Literal["1f1b", "gpipe", "zb-h1"]
# The last stage's loss (TRL's loss_type): cross-entropy, or each token's weighted by its probability (DFT);
# chunked_nll is TRL's deprecated name of nll.
LossType = Literal["nll", "dft", "chunked_nll"]
StageBalance = Literal["layers", "compute"]
OuterMethod = Literal["noloco", "diloco", "ddp", "local"]
OuterDtype = Literal["float32", "bfloat16", "int8", "float8_e4m3", "int4"]
# A stage boundary's wire format (the formats of hf_noloco.engine.boundary_codec); unset: the wire dtype.
BoundaryDtype = Literal["float32", "bfloat16", "float8_e4m3", "float8_e5m2", "int8", "int4"]
NonfiniteAction = Literal["error", "skip"]
ReplicaLossAction = Literal["stop", "continue"]
# What the optimizer steps when the weights are bf16 (see NoLoCoConfig.master_weights).
MasterWeights = Literal["float32", "none"]
# The weights' dtype (TRL's `dtype`): no float16 without loss scaling; "auto" is the checkpoint's own.
WeightDtype = Literal["float32", "bfloat16", "auto"]
ExportDtype = Literal["float32", "bfloat16"]
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2"]
# How documents share a row (TRL's packing_strategy): cut from one stream, or best-fit-decreasing bins.
PackingStrategy = Literal["wrapped", "bfd", "bfd_split"]
# What push_to_hub uploads, and when (the Trainer's hub_strategy values).
HubStrategyName = Literal["end", "every_save", "checkpoint", "all_checkpoints"]

ROUTINGS: tuple[str, ...] = get_args(Routing)
ROUTING_DOMAINS: tuple[str, ...] = get_args(RoutingDomain)
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
STAGE_BALANCES: tuple[str, ...] = get_args(StageBalance)
OUTER_METHODS: tuple[str, ...] = get_args(OuterMethod)
OUTER_DTYPES: tuple[str, ...] = get_args(OuterDtype)
BOUNDARY_DTYPES: tuple[str, ...] = get_args(BoundaryDtype)
SCALED_BOUNDARY_DTYPES = ("float8_e4m3", "float8_e5m2", "int8", "int4")  # with float32 scales
NONFINITE_ACTIONS: tuple[str, ...] = get_args(NonfiniteAction)
REPLICA_LOSS_ACTIONS: tuple[str, ...] = get_args(ReplicaLossAction)
MASTER_WEIGHTS: tuple[str, ...] = get_args(MasterWeights)
WEIGHT_DTYPES: tuple[str, ...] = get_args(WeightDtype)
EXPORT_DTYPES: tuple[str, ...] = get_args(ExportDtype)
ATTN_IMPLEMENTATIONS: tuple[str, ...] = get_args(AttnImplementation)
HUB_STRATEGIES: tuple[str, ...] = get_args(HubStrategyName)
# What model_init_kwargs may hold: the keys TRL scripts put there from ModelConfig.
MODEL_INIT_KEYS = ("dtype", "attn_implementation", "revision", "trust_remote_code")

# Methods with an outer step every `inner_steps` (ddp and local have no outer hyperparameters).
OUTER_STEP_METHODS = ("noloco", "diloco")

# The paper's defaults (Section 4). gamma (outer_averaging) is not stated in the paper; the official code uses
# gamma = beta, written here as None and resolved to outer_lr.
PAPER_DEFAULTS: dict[str, dict[str, float | int]] = {
    "noloco": {"inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.5},
    "diloco": {"inner_steps": 100, "outer_lr": 0.7, "outer_momentum": 0.3},
}

# ----------------------------------------------------------------------------------------------------------
# Rules
# ----------------------------------------------------------------------------------------------------------


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}.")


def is_positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def check_positive_int(name: str, value, what: str = "") -> None:
    """``value`` is an int >= 1 (``what`` says what it counts, for the message)."""
    if not is_positive_int(value):
        raise ValueError(f"{name}{f' ({what})' if what else ''} must be a positive integer, got {value!r}.")


def check_in_range(name: str, value, low: float, high: float, closed_low: bool, closed_high: bool, hint=""):
    """``value`` is a finite number in the interval; ``hint`` ends the message (e.g. the paper's value)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    inside = (
        number
        and (value >= low if closed_low else value > low)
        and (value <= high if closed_high else value < high)
    )
    if not inside:
        interval = f"{'[' if closed_low else '('}{low:g}, {high:g}{']' if closed_high else ')'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}{f' ({hint})' if hint else ''}.")


def check_stage_boundaries(boundaries, num_stages: int, num_layers: int | None = None) -> None:
    """``boundaries`` lists the first decoder layer of stages 1..num_stages-1; with ``num_layers``, also
    checks that every stage gets at least one layer."""
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


def default_microbatch_size(batch_size: int, pipeline_stages: int) -> int:
    """The largest divisor of ``batch_size`` giving at least ``2 * pipeline_stages`` microbatches (1 if none
    does), which keeps the pipeline bubble small; the whole batch with one stage."""
    wanted = 2 * pipeline_stages if pipeline_stages > 1 else 1
    divisors = [m for m in range(batch_size, 0, -1) if batch_size % m == 0 and batch_size // m >= wanted]
    return divisors[0] if divisors else 1


def check_boundary_formats(dtype, grad_dtype, block_size, grad_stochastic_rounding) -> None:
    """The stage-boundary wire settings (``boundary_dtype``, ``boundary_grad_dtype``, ``boundary_block_size``,
    ``boundary_grad_stochastic_rounding``); whether the block size divides the hidden size is checked where
    the model is known (the engine)."""
    for name, value in (("boundary_dtype", dtype), ("boundary_grad_dtype", grad_dtype)):
        if value is not None:
            check_choice(name, value, BOUNDARY_DTYPES)
    if block_size is not None:
        check_positive_int("boundary_block_size", block_size)
        if dtype not in SCALED_BOUNDARY_DTYPES and grad_dtype not in SCALED_BOUNDARY_DTYPES:
            raise ValueError(
                f"boundary_block_size={block_size} sets the scale groups of a scaled boundary format: set "
                f"boundary_dtype or boundary_grad_dtype to one of {', '.join(SCALED_BOUNDARY_DTYPES)}, or "
                "leave boundary_block_size unset."
            )
    if not isinstance(grad_stochastic_rounding, bool):
        raise ValueError(
            f"boundary_grad_stochastic_rounding must be true or false, got {grad_stochastic_rounding!r}."
        )
    if grad_stochastic_rounding and grad_dtype not in SCALED_BOUNDARY_DTYPES:
        raise ValueError(
            "boundary_grad_stochastic_rounding rounds a scaled gradient format: set boundary_grad_dtype to "
            f"one of {', '.join(SCALED_BOUNDARY_DTYPES)} (got {grad_dtype!r})."
        )


def check_export_replica(replica: int | None, num_replicas: int) -> None:
    if replica is not None and not 0 <= replica < num_replicas:
        raise ValueError(f"export_replica must be in [0, {num_replicas}), got {replica}.")


def check_lora_values(r, alpha, dropout, target_modules) -> None:
    """LoRA's settings (:func:`hf_noloco.adapters.settings.require_peft` checks that PEFT is installed)."""
    check_positive_int("lora_r", r)
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
            "lora_target_modules must be a non-empty list of module names (or ['all-linear']), got "
            f"{target_modules!r}."
        )


def check_lora_variant(task_type, modules_to_save) -> None:
    """PEFT's task type (a causal LM only) and its ``modules_to_save`` (module names)."""
    if task_type != "CAUSAL_LM":
        raise ValueError(
            f"lora_task_type={task_type!r} is not supported: the pipeline trains a causal language model "
            "(CAUSAL_LM)."
        )
    if modules_to_save is not None and (
        isinstance(modules_to_save, str) or not all(isinstance(m, str) and m for m in modules_to_save)
    ):
        raise ValueError(f"lora_modules_to_save must be a list of module names, got {modules_to_save!r}.")


def check_model_init_kwargs(kwargs) -> dict:
    """``model_init_kwargs`` as a checked dict (a JSON string is parsed): only :data:`MODEL_INIT_KEYS`, each
    with an allowed value, ``dtype`` without a ``torch.`` prefix."""
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
    checked = dict(kwargs)
    if kwargs.get("dtype") is not None:
        dtype = str(kwargs["dtype"]).removeprefix("torch.")
        if dtype in ("float16", "half"):
            raise ValueError(
                "dtype float16 is not supported (the pipeline has no loss scaling): use bfloat16."
            )
        check_choice("dtype", dtype, WEIGHT_DTYPES)
        checked["dtype"] = dtype
    if kwargs.get("attn_implementation") is not None:
        check_choice("attn_implementation", kwargs["attn_implementation"], ATTN_IMPLEMENTATIONS)
    revision = kwargs.get("revision")
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise ValueError(f"model_revision must be a branch, tag or commit name, got {revision!r}.")
    if not isinstance(kwargs.get("trust_remote_code", False), bool):
        raise ValueError(f"trust_remote_code must be true or false, got {kwargs['trust_remote_code']!r}.")
    return checked


def check_streamed_training(max_steps: int, dataloader_num_workers: int) -> None:
    """A streamed training set has no length and its position goes into checkpoints."""
    if max_steps <= 0:
        raise ValueError("A streamed training set has no known length: set max_steps.")
    if dataloader_num_workers:
        raise ValueError(
            "A streamed training set is read in the training process (its position goes into checkpoints): "
            "set dataloader_num_workers=0."
        )


def check_merge_adapter(merge_adapter: bool, uses_adapters: bool) -> None:
    if merge_adapter and not uses_adapters:
        raise ValueError(
            "merge_adapter=True merges LoRA adapters into the model: it needs use_peft (a peft_config)."
        )


def looks_like_local_path(name: str) -> bool:
    """Whether a model or tokenizer name means a local folder (to be found here, never looked up on the Hub):
    it starts like a filesystem path (``/``, ``.``, ``~``), has more than one ``/`` or a backslash (Hub ids
    are ``name`` or ``owner/name``), or exists. Such a path must exist: a missing one never falls through to
    the Hub, where a stranger's repository of that name (with ``trust_remote_code``, its code) would be used.
    """
    return (
        os.path.exists(os.path.expanduser(name))
        or name.startswith(("/", ".", "~"))
        or name.count("/") > 1
        or "\\" in name
    )


# Timeouts beyond this are refused (timedelta and the backends overflow long before "forever").
MAX_TIMEOUT_S = 1e7
_INT64 = 2**63


def check_finite_numbers(values: dict) -> None:
    """Every float of ``values`` (option name -> value) is finite, and every int fits in 64 bits: ``inf`` or
    ``nan`` would otherwise pass a ``>= 0`` check (or fail one) and overflow or poison a run later."""
    for name, value in values.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}.")
        if isinstance(value, int) and not -_INT64 <= value < _INT64:
            raise ValueError(f"{name} must fit in 64 bits, got a number of {len(str(abs(value)))} digits.")


def check_timeout(name: str, seconds) -> None:
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise ValueError(
            f"{name} must be a positive number of seconds, at most {MAX_TIMEOUT_S:g}, got {seconds!r}."
        )
