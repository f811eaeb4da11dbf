"""What a TRL user types runs as typed: the TRL documentation's `trl sft` command line with `hf-noloco-train`
in its place (bare --packing, gradient accumulation, --eos_token, LoRA), and the README's Python example, an
SFTTrainer-shaped chat fine-tune of one's own checkpoint on conversations made from CPython's help texts."""

import json
import os
import re
import subprocess
import sys

from transformers import AutoModelForCausalLM, LlamaConfig

from tests.helpers.chat_fixtures import chat_tokenizer, write_chat_jsonl
from tests.helpers.paths import ROOT
from tests.helpers.tiny_models import tiny_model


def _environment(tmp_path) -> dict:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TMPDIR=str(tmp_path),
        PYTHONPATH=ROOT,
        HF_DATASETS_CACHE=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
    )


def _torchrun(processes: int, *command: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        *command,
    ]


def test_the_trl_sft_command_line_runs_with_hf_noloco_train_in_place_of_trl_sft(tmp_path):
    tokenizer = chat_tokenizer()
    model = tiny_model("llama", layers=2, seed=1)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(tmp_path / "Qwen2-0.5B")
    tokenizer.save_pretrained(tmp_path / "Qwen2-0.5B")
    write_chat_jsonl(tmp_path / "capybara.jsonl", 160)
    # The SFT example of TRL's documentation, pointed at local files; `trl sft` becomes `hf-noloco-train`.
    trl_line = (
        f"--model_name_or_path {tmp_path / 'Qwen2-0.5B'} --dataset_name {tmp_path / 'capybara.jsonl'} "
        "--learning_rate 2.0e-5 --num_train_epochs 1 --packing --per_device_train_batch_size 2 "
        "--gradient_accumulation_steps 8 --eos_token <|im_end|> --eval_strategy steps --eval_steps 100 "
        f"--use_peft --lora_r 32 --lora_alpha 16 --output_dir {tmp_path / 'Qwen2-0.5B-SFT'}"
    ).split()
    command = _torchrun(2, os.path.join(ROOT, "recipes", "train.py"), *trl_line)
    done = subprocess.run(command, env=_environment(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "Qwen2-0.5B-SFT"
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 32 and config["lora_alpha"] == 16  # a LoRA adapter, as trl sft --use_peft exports
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert re.search(r"Final eval perplexity [\d.]+", done.stdout)
    card = (out / "README.md").read_text()
    assert "| Gradient accumulation (batches per step) | 8 |" in card
    assert "| Global batch (sequences per step) | 32 |" in card  # 2 rows x 8 batches x 2 replicas


def _readme_example() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme.split("## Use it from Python", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_python_example_runs_as_written(tmp_path):
    from pydoc_data.topics import topics

    from hf_noloco.data.corpus import train_bpe_tokenizer

    # A stand-in for the first command's export (a tokenizer trained from scratch, as the command trains it).
    folder = tmp_path / "outputs" / "llama-tiny-noloco"
    tokenizer = train_bpe_tokenizer(list(topics.values())[:40], vocab_size=300, output_dir=str(folder))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    (tmp_path / "chat.py").write_text(_readme_example())
    done = subprocess.run(
        _torchrun(4, "chat.py"),
        cwd=tmp_path,
        env=_environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "outputs" / "llama-tiny-chat"
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.config.num_hidden_layers == 2 and (out / "README.md").exists()
    assert "assistant" in (out / "chat_template.jinja").read_text()  # the chat template went with it
