"""A recipe written for TRL's SFT script (`ScriptArguments`, `SFTConfig`, `ModelConfig` keys) runs with
`hf-noloco-train` unchanged, once the NoLoCo keys are added: TRL's own parser reads the TRL part, our command
trains on all of it, packed, from a Hub-style folder with TRL's split names and a chat template file."""

import json
import os
import subprocess
import sys

import yaml

from tests.helpers.chat_fixtures import chat_tokenizer, conversations
from tests.helpers.paths import ROOT
from tests.helpers.tiny_models import tiny_model

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _recipe(tmp_path) -> tuple[dict, dict]:
    """The TRL keys and the NoLoCo keys of the recipe."""
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = None  # the template comes from chat_template_path
    model = tiny_model("llama", layers=4, seed=2)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    data = tmp_path / "chats" / "data"
    data.mkdir(parents=True)
    for split, convs in (("train_sft", conversations(80)), ("test_sft", conversations(12, seed=100))):
        with open(data / f"{split}-00000-of-00001.jsonl", "w") as f:
            for messages in convs:
                f.write(json.dumps({"messages": messages}) + "\n")
    trl_keys = {
        "model_name_or_path": str(tmp_path / "base"),
        "dataset_name": str(tmp_path / "chats"),
        "dataset_train_split": "train_sft",
        "dataset_test_split": "test_sft",
        "chat_template_path": str(tmp_path / "template.jinja"),
        "max_length": 128,
        "packing": True,
        "packing_strategy": "bfd",
        "padding_free": True,
        "assistant_only_loss": True,
        "dataset_num_proc": 1,
        "learning_rate": 1.0e-3,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "max_steps": 4,
        "logging_steps": 2,
        "eval_strategy": "steps",
        "eval_steps": 4,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 7,
        "bf16": False,  # SFTConfig defaults to bf16, which a CPU cannot run
        "output_dir": str(tmp_path / "out"),
    }
    noloco_keys = {"pipeline_stages": 2, "microbatch_size": 2, "inner_steps": 2}
    return trl_keys, noloco_keys


def test_a_trl_sft_recipe_runs_unchanged_with_the_noloco_keys(tmp_path):
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    trl_keys, noloco_keys = _recipe(tmp_path)
    trl_only = tmp_path / "trl.yaml"
    trl_only.write_text(yaml.safe_dump(trl_keys))
    # TRL's own parser takes every key of the TRL part (it refuses keys it does not know).
    script, sft, model = TrlParser((ScriptArguments, SFTConfig, ModelConfig)).parse_args_and_config(
        ["--config", str(trl_only)]
    )
    assert (
        sft.max_length == 128 and sft.packing_strategy == "bfd" and script.dataset_train_split == "train_sft"
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**trl_keys, **noloco_keys}))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_DATASETS_CACHE=str(tmp_path / "c"))
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "recipes", "accelerate_configs", "cpu.yaml"),
        os.path.join(ROOT, "recipes", "train.py"),
        "--config",
        str(recipe),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Final eval perplexity" in proc.stdout  # evaluated on test_sft
    out = tmp_path / "out"
    assert (out / "model.safetensors").exists()
    exported = json.loads((out / "tokenizer_config.json").read_text()).get("chat_template")
    if exported is None:  # transformers 5 may write the template beside the tokenizer
        exported = (out / "chat_template.jinja").read_text()
    assert exported == TEMPLATE
    card = (out / "README.md").read_text()
    assert "bfd" in card  # the rows the run trained on, as the card records them
