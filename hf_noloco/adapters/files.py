"""The export of an adapter run: what ``PeftModel.save_pretrained`` writes (``adapter_config.json`` and
``adapter_model.safetensors`` with PEFT's key names, which ``PeftModel.from_pretrained(base, folder)`` loads),
or, with ``merge_adapter``, the base model with the adapters merged into it by PEFT's own
``merge_and_unload``.
"""

from __future__ import annotations

import os
import re
import tempfile

import torch

from hf_noloco.adapters.settings import peft_module
from hf_noloco.adapters.stage import ADAPTER_NAME
from hf_noloco.io.full_checkpoint import save_from_this_rank

_ADAPTER_KEY = re.compile(rf"\.{ADAPTER_NAME}(?=\.|$)")


def peft_key(name: str) -> str:
    """A stage's adapter tensor name as ``PeftModel.save_pretrained`` writes it: under ``base_model.model.``
    and without the adapter's name."""
    return "base_model.model." + _ADAPTER_KEY.sub("", name)


def save_adapter(output_dir: str, adapters: dict[str, torch.Tensor], config, base_model: str | None) -> None:
    """Writes a PEFT adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    config = peft_module().LoraConfig(**{**config.to_dict(), "base_model_name_or_path": base_model})
    config.inference_mode = True
    config.save_pretrained(output_dir)
    weights = {peft_key(name): t.contiguous() for name, t in adapters.items()}
    save_file(weights, os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt"})


def save_merged(output_dir: str, adapters: dict[str, torch.Tensor], config, base_folder: str) -> None:
    """Writes the base model (read from ``base_folder``) with the adapters merged into its weights, as an
    ordinary checkpoint, merged by PEFT's ``merge_and_unload``."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as folder:
        save_adapter(folder, adapters, config, base_folder)
        merged = peft_module().PeftModel.from_pretrained(base, folder).merge_and_unload()
    save_from_this_rank(merged, output_dir)
