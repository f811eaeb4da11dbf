"""LoRA through PEFT: adapters per stage, the only weights that train, cross the network and go into
checkpoints; the export loads with PEFT and reproduces the consensus; the merged export; the command line
end to end on a chat JSONL; clear errors."""

import json
import os
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from hf_noloco.engine.partition import split_model
from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.chat_fixtures import chat_tokenizer, write_chat_jsonl
from tests.helpers.paths import ROOT
from tests.helpers.runs import BLOCK, make_args
from tests.helpers.tiny_models import VOCAB, tiny_config, tiny_model

TARGETS = ["q_proj", "v_proj", "down_proj"]


def rows(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, BLOCK), generator=g).tolist()


def _lora_run(folder):
    from hf_noloco.adapters.settings import lora_config
    from hf_noloco.trainer import NoLoCoTrainer

    data = [[(i * 7 + j * (1 + i % 5)) % VOCAB for j in range(BLOCK)] for i in range(96)]
    train = Dataset.from_dict({"input_ids": data, "labels": data})
    peft_config = lora_config(r=4, alpha=8, dropout=0.0, target_modules=TARGETS)
    out = os.path.join(folder, "out")
    results = []
    for resume in (None, os.path.join(out, "checkpoint-3")):
        args = make_args(
            out,
            max_steps=6,
            eval_strategy="no",
            save_strategy="steps",
            save_steps=3,
            inner_steps=3,
            learning_rate=2e-2,
            logging_steps=1,
        )
        trainer = NoLoCoTrainer(
            os.path.join(folder, "base"), args, train_dataset=train, peft_config=peft_config
        )
        start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.train(resume_from_checkpoint=resume)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results.append(
            {
                "start": start,
                "end": {k: v.clone() for k, v in trainer.model.state_dict().items()},
                "losses": losses,
                "bytes_sent": trainer.outer.bytes_sent,
                "outer_steps": trainer.outer.outer_step_count,
                "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
                "logged_bytes": [
                    h["outer_bytes_sent_per_rank"] for h in trainer.state.log_history if "loss" in h
                ],
            }
        )
    trainer.save_model()  # the PEFT adapter
    trainer.args.merge_adapter = True
    trainer.save_model(os.path.join(folder, "merged"))
    trainer.end()
    return results


def test_lora_noloco_pp2_dp2_trains_gossips_and_exports_only_adapters(tmp_path, capsys):
    base = tiny_model("llama", layers=4, seed=9)
    base.save_pretrained(tmp_path / "base")
    results = run_distributed(_lora_run, 4, str(tmp_path), timeout_s=240)
    base_state = base.state_dict()
    for rank, (straight, resumed) in enumerate(results):
        # Only the adapters train; every frozen tensor is still the checkpoint's.
        assert straight["trainable"] and all("lora_" in n for n in straight["trainable"])
        changed = [n for n in straight["start"] if not torch.equal(straight["start"][n], straight["end"][n])]
        assert set(changed) == {n for n in straight["trainable"] if "lora_B" in n or "lora_A" in n}
        for name, tensor in straight["end"].items():
            if "lora_" not in name:
                assert torch.equal(tensor, base_state[name.replace(".base_layer", "")]), name
        # The outer step sends exactly the stage's adapters (fp32) to its partner: 2 outer steps in 6.
        adapter_bytes = sum(straight["end"][n].numel() * 4 for n in straight["trainable"])
        stage_bytes = sum(t.numel() * 4 for t in straight["end"].values())
        with capsys.disabled():
            print(
                f"\nrank {rank}: outer bytes per step {straight['bytes_sent'] // straight['outer_steps']}, "
                f"adapter size {adapter_bytes} bytes (the whole stage: {stage_bytes} bytes)"
            )
        assert straight["outer_steps"] == 2 and straight["bytes_sent"] == 2 * adapter_bytes
        assert straight["logged_bytes"][-1] > 0
        # Resume: 3 steps, a checkpoint of the adapters only, 3 steps = 6 straight steps.
        assert resumed["losses"] == straight["losses"]
        for name in straight["end"]:
            assert torch.equal(resumed["end"][name], straight["end"][name]), name
    assert results[0][0]["losses"][-1] < results[0][0]["losses"][0]
    saved = load_file(str(tmp_path / "out" / "checkpoint-3" / "stage-0-replica-0" / "model.safetensors"))
    assert set(saved) == set(results[0][0]["trainable"])

    # The export is a standard PEFT adapter of the consensus (mean of each stage's replicas).
    out = tmp_path / "out"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(os.listdir(out))
    assert "model.safetensors" not in os.listdir(out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (
        config["r"] == 4 and config["lora_alpha"] == 8 and sorted(config["target_modules"]) == sorted(TARGETS)
    )
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    consensus = [
        {n: (results[s][1]["end"][n] + results[2 + s][1]["end"][n]) / 2 for n in results[s][1]["end"]}
        for s in range(2)
    ]
    ids = torch.tensor([rows(2, 5)[0][:20], rows(2, 5)[1][:20]])
    expected = consensus_logits(tmp_path / "base", consensus, ids)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), out)
    with torch.no_grad():
        adapted = peft_model(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base")(ids).logits
    torch.testing.assert_close(adapted, expected, rtol=0, atol=1e-5)
    assert (adapted - plain).abs().max() > 1e-3  # the adapters do change the model
    # merge_adapter: an ordinary checkpoint with the adapters merged in.
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)
    assert "adapter_config.json" not in os.listdir(tmp_path / "merged")
    assert "LoRA adapter" in (out / "README.md").read_text()
    assert "merged" in (tmp_path / "merged" / "README.md").read_text()


def consensus_logits(base_folder, stage_states, ids):
    """The consensus stages composed by hand: each stage of the base model, given adapters and the mean of its
    replicas' tensors."""
    from transformers import AutoModelForCausalLM

    from hf_noloco.adapters.settings import lora_config
    from hf_noloco.adapters.stage import add_adapters

    model = AutoModelForCausalLM.from_pretrained(base_folder)
    hidden = ids
    for s, state in enumerate(stage_states):
        stage = split_model(model, s, 2)
        add_adapters(stage, lora_config(4, 8, 0.0, TARGETS))
        stage.load_state_dict(state)
        with torch.no_grad():
            hidden = stage(hidden)
    return hidden


def _tied(folder, stages):
    from hf_noloco.adapters.settings import lora_config
    from hf_noloco.trainer import NoLoCoTrainer

    data = rows(32, 1)
    args = make_args(
        os.path.join(folder, f"out{stages}"),
        pipeline_stages=stages,
        max_steps=2,
        eval_strategy="no",
        outer_optimizer="ddp",  # valid on both meshes: 2 replicas x 1 stage, 1 replica x 2 stages
    )
    try:
        trainer = NoLoCoTrainer(
            os.path.join(folder, "tied"),
            args,
            train_dataset=Dataset.from_dict({"input_ids": data, "labels": data}),
            peft_config=lora_config(4, 8, 0.0, ["q_proj"]),
        )
    except ValueError as exc:
        return str(exc)
    trainer.train()
    trainer.save_model()
    trainer.end()
    return "trained"


def test_tied_models_with_lora(tmp_path):
    config = tiny_config("llama", layers=2)
    config.tie_word_embeddings = True
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied")
    # Replicas only: the tied, frozen embeddings stay one tensor; it trains and exports.
    assert run_distributed(_tied, 2, str(tmp_path), 1, timeout_s=180) == ["trained"] * 2
    assert os.path.exists(tmp_path / "out1" / "adapter_model.safetensors")
    # Across pipeline stages: the two copies of the frozen tied matrix stay equal; it trains and exports.
    assert run_distributed(_tied, 2, str(tmp_path), 2, timeout_s=180) == ["trained"] * 2
    assert os.path.exists(tmp_path / "out2" / "adapter_model.safetensors")


def test_lora_settings_are_checked(tmp_path, monkeypatch):
    from hf_noloco.launch.arguments import ModelArguments
    from hf_noloco.launch.cli import check_recipe, parse_args

    base = tmp_path / "base"
    tiny_model("llama", 2).save_pretrained(base)
    common = [
        "--model_name_or_path",
        str(base),
        "--output_dir",
        str(tmp_path / "o"),
        "--outer_optimizer",
        "local",
    ]
    with pytest.raises(ValueError, match="lora_r must be a positive integer"):
        parse_args([*common, "--use_peft", "true", "--lora_r", "0"])
    with pytest.raises(ValueError, match=r"lora_dropout must be in \[0, 1\)"):
        parse_args([*common, "--use_peft", "true", "--lora_dropout", "1.5"])
    with pytest.raises(ValueError, match="merge_adapter=True merges LoRA adapters"):
        parse_args([*common, "--merge_adapter", "true"])
    with pytest.raises(ValueError, match="give model_name_or_path"):
        ModelArguments(model_config={"model_type": "llama"}, use_peft=True)
    # Adapters every stage must hold: lm_head exists on the last stage only.
    monkeypatch.setenv("WORLD_SIZE", "2")
    model_args, _, _ = check_recipe(
        [*common, "--use_peft", "true", "--pipeline_stages", "2", "--lora_target_modules", "q_proj", "o_proj"]
    )
    assert model_args.lora_target_modules == ["q_proj", "o_proj"]
    with pytest.raises(ValueError, match="match no module of pipeline stage 0"):
        check_recipe(
            [*common, "--use_peft", "true", "--pipeline_stages", "2", "--lora_target_modules", "lm_head"]
        )
    # PEFT is optional: without it, the error says how to install it.
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ValueError, match=r"pip install 'hf-noloco\[peft\]'"):
        ModelArguments(model_name_or_path=str(base), use_peft=True)


def test_chat_lora_fine_tune_from_the_command_line(tmp_path):
    """As a user runs it: a local chat JSONL, a local checkpoint with its chat tokenizer, LoRA, pp2 x dp2."""
    tokenizer = chat_tokenizer()
    model = tiny_model("llama", layers=4, seed=2)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    write_chat_jsonl(tmp_path / "chat.jsonl", 64)
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_DATASETS_CACHE=str(tmp_path / "c"))
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "recipes", "accelerate_configs", "cpu.yaml"),
        os.path.join(ROOT, "recipes", "train.py"),
        *("--model_name_or_path", str(tmp_path / "base"), "--dataset_name", str(tmp_path / "chat.jsonl")),
        *("--output_dir", str(tmp_path / "out"), "--pipeline_stages", "2", "--use_peft", "true"),
        *("--lora_r", "4", "--lora_target_modules", "all-linear", "--assistant_only_loss", "true"),
        *(
            "--max_length",
            "64",
            "--max_steps",
            "4",
            "--inner_steps",
            "2",
            "--per_device_train_batch_size",
            "4",
        ),
        *("--microbatch_size", "2", "--per_device_eval_batch_size", "4", "--report_to", "none"),
        *("--validation_split_percentage", "10", "--learning_rate", "1e-3", "--disable_tqdm", "true"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "LoRA adapter (PEFT), tokenizer and model card" in proc.stdout
    out = tmp_path / "out"
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), out)
    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template
    assert loaded(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, len(tokenizer))


VARIANTS = {
    "dora": dict(use_dora=True),
    "rslora": dict(use_rslora=True),
    "modules_to_save": dict(modules_to_save=["lm_head"]),
}


def _variant_runs(folder):
    from hf_noloco.adapters.settings import lora_config
    from hf_noloco.trainer import NoLoCoTrainer

    data = rows(32, 3)
    train = Dataset.from_dict({"input_ids": data, "labels": data})
    results = {}
    for name, variant in VARIANTS.items():
        out = os.path.join(folder, name)
        args = make_args(out, max_steps=3, eval_strategy="no", outer_optimizer="local", learning_rate=2e-2)
        peft_config = lora_config(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], **variant)
        trainer = NoLoCoTrainer(
            os.path.join(folder, "base"), args, train_dataset=train, peft_config=peft_config
        )
        start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.train()
        trainer.save_model()
        trainer.args.merge_adapter = True
        trainer.save_model(os.path.join(folder, f"{name}-merged"))
        end = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trained = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
        changed = sorted(n for n in trained if not torch.equal(start[n], end[n]))
        results[name] = {"end": end, "trained": trained, "changed": changed}
    trainer.end()  # once: it destroys the process group the next trainer would use
    return results


def test_lora_variants_train_and_export_as_peft_saves_them_at_pp2(tmp_path):
    """DoRA's magnitudes, rsLoRA's scaling and a trained lm_head copy (modules_to_save), at pp 2: each trains,
    and its export, loaded by PEFT onto the base model, computes what the trained stages compute."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_noloco.adapters.settings import lora_config
    from hf_noloco.adapters.stage import add_adapters

    tiny_model("llama", layers=4, seed=4).save_pretrained(tmp_path / "base")
    results = run_distributed(_variant_runs, 2, str(tmp_path), timeout_s=240)
    ids = torch.tensor(rows(2, 8))[:, :20]
    for name, variant in VARIANTS.items():
        stages = [results[s][name] for s in range(2)]
        assert stages[0]["changed"] == stages[0]["trained"] and stages[1]["changed"] == stages[1]["trained"]
        if name == "dora":
            assert any("lora_magnitude_vector" in n for n in stages[0]["trained"])
        if name == "modules_to_save":  # the last stage trains its copy of lm_head; the first has none
            assert "lm_head.modules_to_save.default.weight" in stages[1]["trained"]
            assert not any("modules_to_save" in n for n in stages[0]["trained"])
        # The stages composed by hand, with their trained tensors.
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        hidden = ids
        for s, stage_result in enumerate(stages):
            stage = split_model(model, s, 2)
            add_adapters(stage, lora_config(4, 8, 0.0, ["q_proj", "v_proj"], **variant))
            stage.load_state_dict(stage_result["end"])
            with torch.no_grad():
                hidden = stage(hidden)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        exported = PeftModel.from_pretrained(base, tmp_path / name)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-merged")
        with torch.no_grad():
            torch.testing.assert_close(exported(ids).logits, hidden, rtol=0, atol=1e-5)
            torch.testing.assert_close(merged(ids).logits, hidden, rtol=0, atol=1e-5)
        config = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert config["use_dora"] == (name == "dora") and config["use_rslora"] == (name == "rslora")
