"""LoRA adapters on pipeline stages, through PEFT: added to each stage's own layers, trained alone, exported
as a standard PEFT adapter or merged into the base model.

PEFT is an optional dependency (``pip install 'hf-noloco[peft]'``); nothing here imports it before it is
needed. Each stage gets adapters with PEFT's own ``inject_adapter_in_model``, so its parameter names are
PEFT's (``model.layers.3.self_attn.q_proj.lora_A.default.weight``, the frozen weight under ``base_layer``).
Only the adapters require gradients: the inner optimizer, the outer optimizer (the only bytes that cross the
network at an outer step), the checkpoints and the replica divergence see nothing else.

The export writes what ``PeftModel.save_pretrained`` writes (``adapter_config.json`` and
``adapter_model.safetensors`` with PEFT's key names), so ``PeftModel.from_pretrained(base, folder)`` loads it;
or, with ``merge_adapter``, the base model with the adapters merged into it, by PEFT's own
``merge_and_unload``.
"""

from __future__ import annotations

import os
import re
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from hf_noloco.engine.buffers import flatten, unflatten_into
from hf_noloco.engine.comm import peer_call
from hf_noloco.io.export import save_from_this_rank
from hf_noloco.rules import PEFT_INSTALL_HINT, check_export_replica, check_lora_values

ADAPTER_NAME = "default"
ALL_LINEAR = "all-linear"
_ADAPTER_KEY = re.compile(rf"\.{ADAPTER_NAME}(?=\.|$)")


def _peft():
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
        _peft()
    except ImportError as exc:
        raise ValueError(f"use_peft: {exc}") from None


def lora_config(r: int = 16, alpha: float = 32, dropout: float = 0.05, target_modules=None):
    """A ``peft.LoraConfig`` for a causal LM (TRL's ``ModelConfig`` option names: ``lora_r``, ``lora_alpha``,
    ``lora_dropout``, ``lora_target_modules``)."""
    check_lora_values(r, alpha, dropout, target_modules)
    targets = target_modules
    if targets is not None and list(targets) == [ALL_LINEAR]:
        targets = ALL_LINEAR
    return _peft().LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM"
    )


def lora_config_of(model_args):
    """The ``LoraConfig`` of a :class:`~hf_noloco.config.ModelArguments` with ``use_peft``, else ``None``."""
    if not model_args.use_peft:
        return None
    return lora_config(
        model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout, model_args.lora_target_modules
    )


def resolve_target_modules(stage: nn.Module, config, target_modules) -> list[str]:
    """The module names that get adapters: ``target_modules`` as given, every linear layer of the decoder
    layers for ``"all-linear"``, PEFT's default for the architecture for ``None``."""
    if target_modules is None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        model_type = config.get_text_config().model_type
        if model_type not in defaults:
            raise ValueError(
                f"PEFT has no default LoRA target modules for model_type {model_type!r}: set "
                "lora_target_modules (e.g. q_proj v_proj)."
            )
        return sorted(defaults[model_type])
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    if list(target_modules) == [ALL_LINEAR]:
        return sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in stage.model.layers.named_modules()
                if isinstance(module, nn.Linear)
            }
        )
    return sorted(target_modules)


def add_adapters(stage: nn.Module, peft_config, seed: int = 0):
    """Adds LoRA adapters to ``stage`` in place and freezes everything else. Returns the ``LoraConfig`` with
    its target modules resolved (what the export records). The adapters' initialisation depends on ``seed``
    and the stage only, and leaves the global random state as it was."""
    peft = _peft()
    targets = resolve_target_modules(stage, stage.config, peft_config.target_modules)
    present = {name.rsplit(".", 1)[-1] for name, _ in stage.named_modules()}
    if not set(targets) & present:
        raise ValueError(
            f"lora_target_modules {targets} match no module of pipeline stage {stage.stage_index} (its "
            f"modules include {sorted(present - {''})[:12]}): every stage needs at least one adapter."
        )
    config = peft.LoraConfig(**{**peft_config.to_dict(), "target_modules": targets})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + stage.stage_index)
        peft.inject_adapter_in_model(config, stage, adapter_name=ADAPTER_NAME)
    for name, param in stage.named_parameters():
        param.requires_grad_("lora_" in name)
    if not any(p.requires_grad for p in stage.parameters()):
        raise ValueError(f"No LoRA adapter was added to pipeline stage {stage.stage_index}.")
    return config


def trainable_state_dict(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that train (the adapters), by their stage names."""
    return {name: p for name, p in stage.named_parameters() if p.requires_grad}


def adapter_numel(stage: nn.Module) -> int:
    return sum(p.numel() for p in stage.parameters() if p.requires_grad)


def peft_key(name: str) -> str:
    """A stage's adapter tensor name as ``PeftModel.save_pretrained`` writes it: under ``base_model.model.``
    and without the adapter's name."""
    return "base_model.model." + _ADAPTER_KEY.sub("", name)


@torch.no_grad()
def consensus_adapters(stage: nn.Module, mesh, replica: int | None = None) -> dict[str, torch.Tensor]:
    """The mean of the stage's adapters over its replicas (or replica ``replica``'s), as CPU float32 tensors.
    Collective over ``mesh.replica_group``: one message, the adapters being small."""
    check_export_replica(replica, mesh.num_replicas)
    tensors = trainable_state_dict(stage)
    device = mesh.device if dist.get_backend() == "nccl" else torch.device("cpu")  # NCCL moves CUDA tensors
    flat = flatten(list(tensors.values()), torch.float32).to(device)
    if mesh.num_replicas > 1:
        if replica is None:
            with peer_call("the adapters' consensus"):
                dist.all_reduce(flat, group=mesh.replica_group)
            flat.div_(mesh.num_replicas)
        else:
            with peer_call("the adapters' consensus"):
                dist.broadcast(flat, src=mesh.rank_of(replica, mesh.stage), group=mesh.replica_group)
    out = {name: torch.empty(t.shape, dtype=torch.float32) for name, t in tensors.items()}
    unflatten_into(list(out.values()), flat.cpu())
    return out


def save_adapter(output_dir: str, adapters: dict[str, torch.Tensor], config, base_model: str | None) -> None:
    """Writes a PEFT adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    config = _peft().LoraConfig(**{**config.to_dict(), "base_model_name_or_path": base_model})
    config.inference_mode = True
    config.save_pretrained(output_dir)
    weights = {peft_key(name): t.contiguous() for name, t in adapters.items()}
    save_file(weights, os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt"})


def save_merged(output_dir: str, adapters: dict[str, torch.Tensor], config, base_folder: str) -> None:
    """Writes the base model (read from ``base_folder``) with the adapters merged into its weights, as an
    ordinary checkpoint, merged by PEFT's ``merge_and_unload``."""
    from transformers import AutoModelForCausalLM

    peft = _peft()
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as folder:
        save_adapter(folder, adapters, config, base_folder)
        merged = peft.PeftModel.from_pretrained(base, folder).merge_and_unload()
    save_from_this_rank(merged, output_dir)


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
