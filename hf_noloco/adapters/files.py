"""The export of an adapter run: what ``PeftModel.save_pretrained`` writes (``adapter_config.json`` and
``adapter_model.safetensors`` with PEFT's key names, which ``PeftModel.from_pretrained(base, folder)`` loads),
or, with ``merge_adapter``, the base model with the adapters merged into it by PEFT's own
``merge_and_unload``.

The key names are PEFT's own: the gathered tensors go through ``get_peft_model_state_dict`` of a PEFT model
of the same configuration built on the meta device (no memory), so every variant (DoRA's magnitudes, the
copies of ``modules_to_save``) is named as PEFT names it.
"""

from __future__ import annotations

import os
import tempfile

import torch

from hf_noloco.adapters.settings import peft_module
from hf_noloco.adapters.stage import ADAPTER_NAME
from hf_noloco.io.full_checkpoint import save_from_this_rank


def peft_state_dict(adapters: dict[str, torch.Tensor], config, model_config, trust_remote_code=False) -> dict:
    """The adapters (by the stages' names, the model's own) by the names ``PeftModel.save_pretrained``
    writes them under."""
    from transformers import AutoModelForCausalLM

    peft = peft_module()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
        shell = peft.get_peft_model(model, peft.LoraConfig(**config.to_dict()), adapter_name=ADAPTER_NAME)
    named = {f"base_model.model.{name}": t.contiguous() for name, t in adapters.items()}
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(shell, state_dict=named, adapter_name=ADAPTER_NAME)


def save_adapter(
    output_dir: str,
    adapters: dict[str, torch.Tensor],
    config,
    base_model: str | None,
    model_config,
    trust_remote_code: bool = False,
) -> None:
    """Writes a PEFT adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    weights = peft_state_dict(adapters, config, model_config, trust_remote_code)
    config = peft_module().LoraConfig(**{**config.to_dict(), "base_model_name_or_path": base_model})
    config.inference_mode = True
    config.save_pretrained(output_dir)
    save_file(weights, os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt"})


def save_merged(output_dir: str, adapters: dict[str, torch.Tensor], config, base_folder: str) -> None:
    """Writes the base model (read from ``base_folder``) with the adapters merged into its weights, as an
    ordinary checkpoint, merged by PEFT's ``merge_and_unload``."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as folder:
        save_adapter(folder, adapters, config, base_folder, base.config)
        merged = peft_module().PeftModel.from_pretrained(base, folder).merge_and_unload()
    save_from_this_rank(merged, output_dir)
