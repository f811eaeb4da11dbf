"""The LoRA settings of a run: a ``peft.LoraConfig`` from TRL's option names (``lora_r``, ``lora_alpha``,
``lora_dropout``, ``lora_target_modules``), and the lines the logs, card and checkpoints record of it.

PEFT is an optional dependency; nothing here imports it before it is needed.
"""

from __future__ import annotations

from hf_noloco.rules import check_lora_values, check_lora_variant

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


def lora_config(
    r: int = 16,
    alpha: float = 32,
    dropout: float = 0.05,
    target_modules=None,
    *,
    use_dora: bool = False,
    use_rslora: bool = False,
    modules_to_save: list[str] | None = None,
    task_type: str = "CAUSAL_LM",
):
    """A ``peft.LoraConfig`` for a causal LM (TRL's ``ModelConfig`` option names: ``lora_r``, ``lora_alpha``,
    ``lora_dropout``, ``lora_target_modules``, ``use_dora``, ``use_rslora``, ``lora_modules_to_save``,
    ``lora_task_type``)."""
    check_lora_values(r, alpha, dropout, target_modules)
    check_lora_variant(task_type, modules_to_save)
    targets = target_modules
    if targets is not None and list(targets) == [ALL_LINEAR]:
        targets = ALL_LINEAR
    return peft_module().LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        task_type=task_type,
        use_dora=use_dora,
        use_rslora=use_rslora,
        modules_to_save=list(modules_to_save) if modules_to_save else None,
    )


def lora_config_of(model_args):
    """The ``LoraConfig`` of a :class:`~hf_noloco.launch.arguments.ModelArguments` with ``use_peft``, else
    ``None``."""
    if not model_args.use_peft:
        return None
    return lora_config(
        model_args.lora_r,
        model_args.lora_alpha,
        model_args.lora_dropout,
        model_args.lora_target_modules,
        use_dora=model_args.use_dora,
        use_rslora=model_args.use_rslora,
        modules_to_save=model_args.lora_modules_to_save,
        task_type=model_args.lora_task_type,
    )


def _variant(config) -> dict:
    """The LoRA variant's settings that are not plain LoRA's defaults."""
    variant = {"use_dora": bool(config.use_dora), "use_rslora": bool(config.use_rslora)}
    variant["modules_to_save"] = sorted(config.modules_to_save or [])
    return {k: v for k, v in variant.items() if v}


def adapter_summary(config) -> str:
    """One line for the model card and the logs."""
    targets = config.target_modules
    targets = ", ".join(sorted(targets)) if not isinstance(targets, str) else targets
    kind = "DoRA" if config.use_dora else "LoRA"
    line = f"{kind} r={config.r}, alpha={config.lora_alpha}, dropout={config.lora_dropout} on {targets}"
    if config.use_rslora:
        line += ", rank-stabilised scaling"
    if config.modules_to_save:
        line += f", training {', '.join(sorted(config.modules_to_save))} whole"
    return line


def adapter_record(config) -> dict | None:
    """What a checkpoint of an adapter run must share with the run that resumes it (a variant's settings only
    when set, so plain LoRA checkpoints keep their record)."""
    if config is None:
        return None
    targets = config.target_modules
    return {
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "target_modules": sorted(targets) if not isinstance(targets, str) else targets,
        **_variant(config),
    }
