"""LoRA adapters added to one pipeline stage's own layers with PEFT's ``inject_adapter_in_model``, so that its
parameter names are PEFT's (``model.layers.3.self_attn.q_proj.lora_A.default.weight``, the frozen weight under
``base_layer``). Only the adapters require gradients: the inner optimizer, the outer optimizer (the only bytes
that cross the network at an outer step), the checkpoints and the replica divergence see nothing else.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_noloco.adapters.settings import ALL_LINEAR, peft_module
from hf_noloco.engine.stage import TIED_COPY, TIED_SOURCE, ties_embeddings

ADAPTER_NAME = "default"


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
    peft = peft_module()
    targets = resolve_target_modules(stage, stage.config, peft_config.target_modules)
    present = {name.rsplit(".", 1)[-1] for name, _ in stage.named_modules()}
    if not set(targets) & present:
        raise ValueError(
            f"lora_target_modules {targets} match no module of pipeline stage {stage.stage_index} (its "
            f"modules include {sorted(present - {''})[:12]}): every stage needs at least one adapter."
        )
    saved = list(peft_config.modules_to_save or [])
    tied = {name.split(".")[-2] for name in (TIED_SOURCE, TIED_COPY)}  # the tied matrix's two modules
    if ties_embeddings(stage.config) and any(m.rsplit(".", 1)[-1] in tied for m in saved):
        raise ValueError(
            f"lora_modules_to_save {saved} names the tied embedding matrix, which two stages hold as one "
            "tensor: train it with the whole model (no use_peft) instead."
        )
    # Modules to save that this stage does not hold are another stage's.
    present_modules = {name for name, _ in stage.named_modules()}
    here = [m for m in saved if any(n == m or n.endswith("." + m) for n in present_modules)]
    config = peft.LoraConfig(
        **{**peft_config.to_dict(), "target_modules": targets, "modules_to_save": here or None}
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + stage.stage_index)
        peft.inject_adapter_in_model(config, stage, adapter_name=ADAPTER_NAME)
    for name, param in stage.named_parameters():
        param.requires_grad_("lora_" in name or ".modules_to_save." in name)
    if not any(p.requires_grad for p in stage.parameters()):
        raise ValueError(f"No LoRA adapter was added to pipeline stage {stage.stage_index}.")
    return peft.LoraConfig(**{**config.to_dict(), "modules_to_save": saved or None})


def trainable_state_dict(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that train (the adapters), by their stage names."""
    return {name: p for name, p in stage.named_parameters() if p.requires_grad}


def adapter_numel(stage: nn.Module) -> int:
    return sum(p.numel() for p in stage.parameters() if p.requires_grad)
