"""What a fine-tuner sets besides the method: the weights' dtype, the attention implementation, the
checkpoint's own code (trust_remote_code), its generation config, torch.compile, best-checkpoint tracking;
and the Trainer arguments NoLoCoTrainer cannot honour, refused. One-process runs (pp=1) on local tiny
checkpoints."""

import json
import os
import textwrap

import pytest
import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from hf_noloco.config import NoLoCoConfig
from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.tiny_models import VOCAB, tiny_model

SEQ = 16


def _data(rows=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = ((torch.arange(SEQ) * 7 + torch.randint(0, VOCAB, (rows, 1), generator=g)) % VOCAB).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _args(out, **overrides):
    settings = dict(
        output_dir=out,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        max_steps=6,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        outer_optimizer="local",
        seed=1,
    )
    settings.update(overrides)
    return NoLoCoConfig(**settings)


def _run(model, args, **kwargs):
    from hf_noloco.trainer import NoLoCoTrainer

    trainer = NoLoCoTrainer(model, args, train_dataset=_data(), **kwargs)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


# ------------------------------------------------------------------------------------------- dtype, attention


def _bf16_and_attention(folder):
    results = {}
    for name, init in {
        "float32": {},
        "bfloat16": {"dtype": "bfloat16"},
        "bfloat16-pure": {"dtype": "bfloat16"},
        "eager": {"attn_implementation": "eager"},
    }.items():
        master = "none" if name == "bfloat16-pure" else "float32"
        args = _args(os.path.join(folder, name), model_init_kwargs=init, max_steps=12, master_weights=master)
        trainer, losses = _run(folder, args)
        first = next(trainer.model.parameters())
        state = trainer.optimizer.state[first]
        results[name] = dict(
            losses=losses,
            dtype=first.dtype,
            adam_dtype=state["exp_avg"].dtype,
            attn=trainer.model.config._attn_implementation,
        )
        trainer.save_model(os.path.join(folder, f"export-{name}"))
        if name == "bfloat16":
            trainer.save_model(os.path.join(folder, "export-bf16-as-fp32"))
            trainer.args.export_dtype = "float32"
            trainer.save_model(os.path.join(folder, "export-bf16-as-fp32"))
    trainer.end()
    return results


def test_bf16_weights_train_and_export_in_bf16_and_attention_is_chosen(tmp_path):
    tiny_model("llama", 2, seed=2).save_pretrained(tmp_path)
    [results] = run_distributed(_bf16_and_attention, 1, str(tmp_path), timeout_s=240)
    assert results["float32"]["dtype"] == torch.float32 and results["float32"]["attn"] == "sdpa"
    bf16, pure = results["bfloat16"], results["bfloat16-pure"]
    assert bf16["dtype"] == bf16["adam_dtype"] == torch.float32  # float32 masters (master_weights's default)
    assert pure["dtype"] == torch.bfloat16 and pure["adam_dtype"] == torch.bfloat16  # weights and AdamW state
    for run in (bf16, pure):
        assert run["losses"][-1] < 0.8 * run["losses"][0], run["losses"]  # it trains
    assert results["eager"]["attn"] == "eager"
    assert results["eager"]["losses"] == pytest.approx(results["float32"]["losses"], rel=1e-4)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export-bfloat16")
    assert exported.dtype == torch.bfloat16
    assert json.loads((tmp_path / "export-bfloat16" / "config.json").read_text())["dtype"] == "bfloat16"
    told = AutoModelForCausalLM.from_pretrained(tmp_path / "export-bf16-as-fp32")
    assert told.dtype == torch.float32
    for (name, a), b in zip(exported.state_dict().items(), told.state_dict().values()):
        assert torch.equal(a, b.to(torch.bfloat16)), name  # the float32 masters, and their bf16 rounding
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "export-float32").dtype == torch.float32


# ---------------------------------------------------------------------------------------- trust_remote_code

_CONFIG_CODE = """
from transformers import {base}Config


class Tiny{name}Config({base}Config):
    model_type = "tiny{lower}"
"""
_MODEL_CODE = """
from transformers import {base}
from .configuration_tiny{lower} import Tiny{name}Config


class Tiny{name}ForCausalLM({base}):
    config_class = Tiny{name}Config
"""


def _remote_checkpoint(folder, name, base_config, base_model, model):
    """A folder whose config names its own code (auto_map), as a Hub repository with custom code does."""
    lower = name.lower()
    os.makedirs(folder)
    model.save_pretrained(folder)
    fmt = dict(name=name, lower=lower, base=base_config)
    with open(os.path.join(folder, f"configuration_tiny{lower}.py"), "w") as f:
        f.write(textwrap.dedent(_CONFIG_CODE.format(**fmt)))
    with open(os.path.join(folder, f"modeling_tiny{lower}.py"), "w") as f:
        f.write(textwrap.dedent(_MODEL_CODE.format(**{**fmt, "base": base_model})))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["model_type"] = f"tiny{lower}"
    config["auto_map"] = {
        "AutoConfig": f"configuration_tiny{lower}.Tiny{name}Config",
        "AutoModelForCausalLM": f"modeling_tiny{lower}.Tiny{name}ForCausalLM",
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def _remote_code(folder):
    from hf_noloco.trainer import NoLoCoTrainer

    errors = {}
    for name, trust in (("llamalike", False), ("gptlike", True)):
        try:
            init = {"trust_remote_code": True} if trust else {}
            NoLoCoTrainer(
                os.path.join(folder, name), _args(os.path.join(folder, "o"), model_init_kwargs=init)
            )
        except ValueError as exc:
            errors[name] = str(exc)
    args = _args(os.path.join(folder, "run"), model_init_kwargs={"trust_remote_code": True})
    trainer, losses = _run(os.path.join(folder, "llamalike"), args)
    cls = type(trainer.model.model.layers["0"]).__name__
    trainer.save_model(os.path.join(folder, "export"))
    trainer.end()
    return errors, losses, cls


def test_trust_remote_code_runs_a_llama_like_class_and_refuses_others(tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # not the user's cache
    from transformers import GPT2Config, GPT2LMHeadModel

    llama = tiny_model("llama", 2, seed=4)
    _remote_checkpoint(str(tmp_path / "llamalike"), "LlamaLike", "Llama", "LlamaForCausalLM", llama)
    gpt = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB))
    _remote_checkpoint(str(tmp_path / "gptlike"), "GptLike", "GPT2", "GPT2LMHeadModel", gpt)
    errors, losses, layer_class = run_distributed(_remote_code, 1, str(tmp_path), timeout_s=240)[0]
    assert "trust_remote_code" in errors["llamalike"]  # transformers' own refusal to run code unasked
    message = errors["gptlike"]
    assert (
        "TinyGptLikeForCausalLM (its own code, from" in message and "not a Llama-family causal LM" in message
    )
    assert "model.embed_tokens" in message
    assert losses[-1] < losses[0] and layer_class == "LlamaDecoderLayer"
    exported = tmp_path / "export"
    assert (exported / "modeling_tinyllamalike.py").exists()  # the export carries the code it needs
    config = AutoConfig.from_pretrained(exported, trust_remote_code=True)
    assert type(config).__name__ == "TinyLlamaLikeConfig"


# ------------------------------------------------------------------------- generation config, revision, misc


def _generation_config_and_refusals(folder):
    from hf_noloco.trainer import NoLoCoTrainer

    errors = {}
    attempts = {
        "revision_of_folder": lambda: NoLoCoTrainer(
            folder, _args(os.path.join(folder, "o"), model_init_kwargs={"revision": "v2"})
        ),
        "model_init": lambda: NoLoCoTrainer(
            folder, _args(os.path.join(folder, "o")), model_init=lambda: None
        ),
        "kwargs_for_instance": lambda: NoLoCoTrainer(
            tiny_model("llama", 2), _args(os.path.join(folder, "o"), model_init_kwargs={"dtype": "bfloat16"})
        ),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except ValueError as exc:
            errors[name] = str(exc)
    # torch_compile compiles each decoder layer (the eager backend: same arithmetic, quick to compile).
    plain, plain_losses = _run(folder, _args(os.path.join(folder, "plain")))
    compiled, compiled_losses = _run(
        folder, _args(os.path.join(folder, "compiled"), torch_compile=True, torch_compile_backend="eager")
    )
    layers_compiled = all(
        layer._compiled_call_impl is not None for layer in compiled.model.model.layers.values()
    )
    compiled.save_model(os.path.join(folder, "export"))
    # metric_for_best_model: the best checkpoint is recorded and outlives save_total_limit.
    best_dir = os.path.join(folder, "best")
    best, _ = _run(
        folder,
        _args(
            best_dir,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            save_total_limit=1,
            metric_for_best_model="loss",
            greater_is_better=True,  # the first evaluation's loss, the highest, is the "best"
        ),
        eval_dataset=_data(8, seed=1),
    )
    best_checkpoint = best.state.best_model_checkpoint
    compiled.end()
    return (
        errors,
        plain_losses,
        compiled_losses,
        layers_compiled,
        best_checkpoint,
        sorted(os.listdir(best_dir)),
    )


def test_generation_config_is_carried_and_unsupported_inputs_are_refused(tmp_path):
    tiny_model("llama", 2, seed=6).save_pretrained(tmp_path)
    GenerationConfig(eos_token_id=[3, 5, 7], temperature=0.6, do_sample=True).save_pretrained(tmp_path)
    errors, plain, compiled, layers_compiled, best, folders = run_distributed(
        _generation_config_and_refusals, 1, str(tmp_path), timeout_s=300
    )[0]
    assert "model_revision='v2' applies to Hub models" in errors["revision_of_folder"]
    assert "model_init is not supported" in errors["model_init"]
    assert "model_init_kwargs only applies" in errors["kwargs_for_instance"]
    assert layers_compiled and compiled == pytest.approx(plain, rel=1e-5)
    generation = GenerationConfig.from_pretrained(tmp_path / "export")
    assert generation.eos_token_id == [3, 5, 7] and generation.temperature == 0.6  # the Llama-3 way
    assert json.loads((tmp_path / "export" / "config.json").read_text())["use_cache"] is True
    assert best == str(tmp_path / "best" / "checkpoint-2")
    # save_total_limit=1 would have deleted it at step 4; at the end the Trainer keeps the best one only.
    assert [f for f in folders if f.startswith("checkpoint-")] == ["checkpoint-2"]
