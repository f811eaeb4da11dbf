"""The LoRA settings of a run: a ``peft.LoraConfig`` from TRL's option names (``lora_r``, ``lora_alpha``,
``lora_dropout``, ``lora_target_modules``), and the lines the logs, card and checkpoints record of it.

PEFT is an optional dependency; nothing here imports it before it is needed.
"""

from __future__ import annotations

from hf_noloco.rules import check_lora_values

PEFT_INSTALL_HINT = "pip install 'hf-noloco[peft]'"
ALL_LINEAR = "all-linear"


def peft_module():
    """The ``peft`` package, or an ``ImportError`` that says how to install it."""
    try:
        import peft
    except ImportError:
        raise ImportError(
            f"LoRA needs the PEFT library, an optional dependency: {PEFT_INSTALL_HINT}."
        ) from None
    return peft


def require_peft() -> None:
    """Refuses LoRA settings, before anything else, where PEFT is not installed."""
    try:
        peft_module()
    except ImportError as exc:
        raise ValueError(f"use_peft: {exc}") from None


def lora_config(r: int = 16, alpha: float = 32, dropout: float = 0.05, target_modules=None):
    """A ``peft.LoraConfig`` for a causal LM (TRL's ``ModelConfig`` option names: ``lora_r``, ``lora_alpha``,
    ``lora_dropout``, ``lora_target_modules``)."""
    check_lora_values(r, alpha, dropout, target_modules)
    targets = target_modules
    if targets is not None and list(targets) == [ALL_LINEAR]:
        targets = ALL_LINEAR
    return peft_module().LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM"
    )


def lora_config_of(model_args):
    """The ``LoraConfig`` of a :class:`~hf_noloco.launch.arguments.ModelArguments` with ``use_peft``, else
    ``None``."""
    if not model_args.use_peft:
        return None
    return lora_config(
        model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout, model_args.lora_target_modules
    )


def adapter_summary(config) -> str:
    """One line for the model card and the logs."""
    targets = config.target_modules
    targets = ", ".join(sorted(targets)) if not isinstance(targets, str) else targets
    return f"LoRA r={config.r}, alpha={config.lora_alpha}, dropout={config.lora_dropout} on {targets}"


def adapter_record(config) -> dict | None:
    """What a checkpoint of an adapter run must share with the run that resumes it."""
    if config is None:
        return None
    targets = config.target_modules
    return {
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "target_modules": sorted(targets) if not isinstance(targets, str) else targets,
    }
