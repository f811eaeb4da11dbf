"""Every recipe passes its dry check: options parsed and checked, the model built on the meta device, split
into the recipe's stages and given its adapters (`cli.check_recipe`), with as many processes as its launch
line starts. Hub models are stood in for by their published config.json (the tests have no network)."""

import glob
import os
import re

import pytest
import torch

from hf_noloco.launch.cli import check_recipe
from tests.helpers.paths import ROOT

RECIPES = sorted(
    path
    for path in glob.glob(os.path.join(ROOT, "recipes", "*", "*.yaml"))
    if os.path.basename(os.path.dirname(path)) != "accelerate_configs"
)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


# The config.json each Hub model publishes (the fields that shape the model).
PUBLISHED_CONFIGS = {
    "Qwen/Qwen2.5-0.5B-Instruct": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "Qwen/Qwen2.5-0.5B": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    "meta-llama/Llama-3.2-1B": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": True,
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
    },
}


def launch_processes(recipe: str) -> int:
    """The number of processes of the accelerate config its launch line (first comment lines) names."""
    config = re.search(r"--config_file (\S+\.yaml)", read(recipe)).group(1)
    return int(re.search(r"num_processes: (\d+)", read(os.path.join(ROOT, config))).group(1))


def test_every_recipe_is_covered():
    names = {os.path.relpath(r, os.path.join(ROOT, "recipes")) for r in RECIPES}
    assert {
        "llama-125m/noloco-c4.yaml",
        "qwen2.5-0.5b/chat-lora-noloco.yaml",
        "llama-3.2-1b/finetune-noloco.yaml",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: os.path.relpath(r, os.path.join(ROOT, "recipes")))
def test_recipe_passes_its_dry_check(recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(launch_processes(recipe)))
    model_id = re.search(r"^model_name_or_path: (\S+)", read(recipe), re.M)
    published = PUBLISHED_CONFIGS[model_id.group(1)] if model_id else None
    model_args, data_args, settings = check_recipe([recipe, "--output_dir", str(tmp_path)], published)
    assert os.path.relpath(recipe, ROOT) in read(
        os.path.join(ROOT, "recipes", "README.md")
    )  # its launch line is in recipes/README.md
    if data_args.dataset_streaming:
        assert data_args.max_eval_samples is not None and settings.max_steps > 0
    tokenizer = model_args.tokenizer_name_or_path or ""
    assert "meta-llama/" not in tokenizer  # no gated tokenizer for a model trained from scratch


def test_c4_recipe_streams_with_an_open_tokenizer_and_capped_evaluation(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    recipe = os.path.join(ROOT, "recipes", "llama-125m", "noloco-c4.yaml")
    model_args, data_args, settings = check_recipe([recipe, "--output_dir", str(tmp_path)])
    assert data_args.dataset_streaming and data_args.dataset_num_proc is None
    assert model_args.tokenizer_name_or_path == "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"
    assert data_args.max_eval_samples == 1024 and settings.ddp_timeout == 600


def test_the_chat_lora_recipe_sends_its_adapters_only(tmp_path, monkeypatch):
    """What the recipe's comment says: about 35 MB of fp32 adapters cross the network, not the 2 GB model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_noloco.adapters.settings import lora_config_of
    from hf_noloco.adapters.stage import add_adapters
    from hf_noloco.engine.partition import split_model

    monkeypatch.setenv("WORLD_SIZE", "8")
    recipe = os.path.join(ROOT, "recipes", "qwen2.5-0.5b", "chat-lora-noloco.yaml")
    published = PUBLISHED_CONFIGS["Qwen/Qwen2.5-0.5B-Instruct"]
    model_args, data_args, _ = check_recipe([recipe, "--output_dir", str(tmp_path)], published)
    assert model_args.use_peft and data_args.assistant_only_loss
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**published))
        total = sum(p.numel() for p in model.parameters())
        stage = split_model(model, 0, 1)
        add_adapters(stage, lora_config_of(model_args))
    adapter = sum(p.numel() for p in stage.parameters() if p.requires_grad)
    assert 34e6 < adapter * 4 < 36e6 and 1.9e9 < total * 4 < 2.0e9
    # Over 2 stages too: the tied embeddings and lm_head then sit on different stages (frozen, under LoRA).
    _, _, split = check_recipe([recipe, "--output_dir", str(tmp_path), "--pipeline_stages", "2"], published)
    assert split.pipeline_stages == 2
