"""The tied-checkpoint recipe (recipes/qwen2.5-0.5b/finetune-noloco.yaml) launched as a user would, with the
Hub model replaced by a local tiny tied Qwen2 checkpoint: 2 stages x 2 replicas, bf16 weights, activation
checkpointing, chunked loss. The loss falls, and the export is one bf16 tied checkpoint that carries the base
model's generation config."""

import ast
import json
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from hf_noloco.data.corpus import train_bpe_tokenizer
from tests.helpers.paths import ROOT
from tests.helpers.tiny_models import tiny_config

RECIPE = os.path.join(ROOT, "recipes", "qwen2.5-0.5b", "finetune-noloco.yaml")


def _corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)][:60]


def test_tied_recipe_finetunes_a_local_tied_checkpoint(tmp_path):
    docs = _corpus()
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs))
    base = tmp_path / "tiny-qwen2"
    tokenizer = train_bpe_tokenizer(docs, vocab_size=320, output_dir=str(base))
    config = tiny_config("qwen2", 4)
    config.tie_word_embeddings = True
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    GenerationConfig(eos_token_id=[1, 2], max_new_tokens=64).save_pretrained(base)  # a list, as Llama-3's
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", TMPDIR=str(tmp_path))
    env.update(HF_DATASETS_CACHE=str(tmp_path / "datasets"), HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "recipes", "accelerate_configs", "cpu.yaml"),
        "--num_processes",
        "4",
        os.path.join(ROOT, "recipes", "train.py"),
        "--config",
        RECIPE,
        "--model_name_or_path",
        str(base),
        "--dataset_name",
        str(tmp_path / "corpus.txt"),
        "--dataset_config",
        "",
        "--max_length",
        "32",
        "--dataset_num_proc",
        "1",
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "4",
        "--learning_rate",
        "1e-2",
        "--warmup_steps",
        "0",
        "--max_steps",
        "16",
        "--inner_steps",
        "8",
        "--logging_steps",
        "1",
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        "--loss_chunk_tokens",
        "24",  # microbatches of 2 x 32 positions: three chunks
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logs = [ast.literal_eval(line) for line in proc.stdout.splitlines() if line.startswith("{'loss'")]
    losses = [float(entry["loss"]) for entry in logs]
    assert len(losses) == 16 and sum(losses[-3:]) < 0.9 * sum(losses[:3]), losses  # it learns

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16  # exported in the training dtype
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    saved = json.loads((out / "config.json").read_text())
    assert saved["tie_word_embeddings"] is True and saved["dtype"] == "bfloat16"
    generation = GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == [1, 2] and generation.max_new_tokens == 64
    card = (out / "README.md").read_text()
    assert "tiny-qwen2" in card
