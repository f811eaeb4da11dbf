"""Export: consensus of replicas, gather of stages, one loadable HF checkpoint; curves; model card."""

import json
import os

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, Qwen2Config

from hf_noloco.engine.loading import build_stage
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.io.card import plot_training_curves, render_model_card
from hf_noloco.io.full_checkpoint import (
    build_model_from_state_dict,
    gather_full_state_dict,
    save_consensus_checkpoint,
)
from hf_noloco.launch.local_launch import run_distributed

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tiny_llama():
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _tiny_qwen2():
    return Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _make_tokenizer(folder):
    """A tiny word-level fast tokenizer, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(20)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return folder


def _export_worker(out_dir, tokenizer_dir):
    """pp=2 x dp=2. Every replica starts from its own seed, so the replicas really differ."""
    mesh = PipelineMesh.build(2)
    results = {}
    for name, config, dtype in (
        ("llama", _tiny_llama(), torch.float32),
        ("qwen2", _tiny_qwen2(), torch.bfloat16),
    ):
        torch.manual_seed(1000 + 17 * mesh.replica + mesh.stage)
        stage = build_stage(config, mesh.stage, mesh.num_stages, dtype=dtype)
        before = {k: v.clone() for k, v in stage.state_dict().items()}
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if name == "llama" else None
        gen = GenerationConfig(max_new_tokens=7, do_sample=False) if name == "llama" else None
        mean_path = save_consensus_checkpoint(
            stage,
            mesh,
            config,
            os.path.join(out_dir, f"{name}-mean"),
            tokenizer=tokenizer,
            generation_config=gen,
        )
        rep1_path = save_consensus_checkpoint(
            stage, mesh, config, os.path.join(out_dir, f"{name}-rep1"), replica=1
        )
        unchanged = all(torch.equal(before[k], v) for k, v in stage.state_dict().items())
        results[name] = {"state": before, "paths": (mean_path, rep1_path), "stage_unchanged": unchanged}
    # dst need not be rank 0, nor in column 0.
    other = gather_full_state_dict(stage.state_dict() if mesh.replica == 0 else None, mesh, dst=3)
    results["dst3_keys"] = None if other is None else sorted(other)
    return mesh.stage, mesh.replica, results


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    tok = _make_tokenizer(str(out / "tokenizer"))
    results = run_distributed(_export_worker, 4, str(out), tok, timeout_s=120)
    return out, results


def _by_stage_replica(results, name):
    """{(stage, replica): state dict}."""
    return {(stage, replica): res[name]["state"] for stage, replica, res in results}


def _mean(a, b):
    return ((a.float() + b.float()) / 2).to(a.dtype)


@pytest.mark.parametrize("name,config_fn", [("llama", _tiny_llama), ("qwen2", _tiny_qwen2)])
def test_exported_checkpoint_is_replica_mean_and_matches_composed_stages(exported, name, config_fn):
    out, results = exported
    states = _by_stage_replica(results, name)
    # Only rank 0 (replica 0, stage 0) writes; the others return None.
    for stage, replica, res in results:
        expected = str(out / f"{name}-mean") if (stage, replica) == (0, 0) else None
        assert res[name]["paths"][0] == expected
        assert res[name]["stage_unchanged"]
    # The replicas really differ, so a mean is a real test.
    k = "model.embed_tokens.weight"
    assert not torch.equal(states[(0, 0)][k], states[(0, 1)][k])

    folder = out / f"{name}-mean"
    assert {"config.json", "model.safetensors", "generation_config.json"} <= set(os.listdir(folder))
    assert not [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth"))]
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.model_type == config_fn().model_type
    loaded = model.state_dict()
    expected = {}
    for stage in range(2):
        for key in states[(stage, 0)]:
            expected[key] = _mean(states[(stage, 0)][key], states[(stage, 1)][key])
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype, key
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)

    # Logits of the exported model == the consensus stages composed in this process.
    config = config_fn()
    dtype = expected[k].dtype
    stages = []
    for s in range(2):
        st = build_stage(config, s, 2, dtype=dtype)
        st.load_state_dict({key: expected[key] for key in st.state_dict()})
        stages.append(st.eval())
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        composed = stages[1](stages[0](ids))
        logits = model.eval()(ids).logits
    tol = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(logits, composed, **tol)

    # replica=1 exports replica 1 exactly.
    rep1 = AutoModelForCausalLM.from_pretrained(out / f"{name}-rep1").state_dict()
    for stage in range(2):
        for key, value in states[(stage, 1)].items():
            assert torch.equal(rep1[key], value), key


def test_export_saves_tokenizer_and_generation_config(exported):
    out, _ = exported
    folder = out / "llama-mean"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer("w1 w2")["input_ids"][-2:] == [4, 5]
    with open(folder / "generation_config.json") as f:
        assert json.load(f)["max_new_tokens"] == 7
    with open(folder / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]


def test_gather_to_another_rank(exported):
    _, results = exported
    for stage, replica, res in results:
        if (stage, replica) == (1, 1):  # global rank 3
            assert res["dst3_keys"] is not None and "lm_head.weight" in res["dst3_keys"]
            assert "model.embed_tokens.weight" in res["dst3_keys"]
        else:
            assert res["dst3_keys"] is None


def test_build_model_from_state_dict_keeps_tied_embeddings(tmp_path):
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(config)
    model = build_model_from_state_dict(config, source.state_dict())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, source(ids).logits)


def test_build_model_from_state_dict_rejects_missing_stage():
    config = _tiny_llama()
    state = AutoModelForCausalLM.from_config(config).state_dict()
    state = {k: v for k, v in state.items() if not k.startswith("model.layers.3.")}
    with pytest.raises(RuntimeError, match="model.layers.3"):
        build_model_from_state_dict(config, state)


# ------------------------------------------------------------------------------------------------ curves


LOG_HISTORY = [
    {"step": 10, "loss": 4.1, "learning_rate": 1e-3},
    {"step": 20, "loss": 3.5, "replica_divergence": 0.02},
    {"step": 20, "eval_loss": 3.4, "eval_perplexity": 30.0},
    {"step": 30, "loss": 3.0, "replica_divergence": 0.03},
    {"step": 30, "eval_loss": 3.0, "eval_perplexity": 20.1},
    {"step": 30, "train_runtime": 1.0, "train_loss": 3.5},
]


def test_plot_training_curves_writes_png(tmp_path):
    path = plot_training_curves(LOG_HISTORY, tmp_path / "curves.png")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    # Missing metrics (no eval, no divergence) still give a PNG, with "no data" panels.
    path = plot_training_curves([{"step": 1, "loss": 2.0}], tmp_path / "sub" / "only_loss.png")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    plot_training_curves([], tmp_path / "empty.png")


# ------------------------------------------------------------------------------------------------ card

SETTINGS = {
    "pipeline_stages": 2,
    "num_replicas": 4,
    "outer_optimizer": "noloco",
    "inner_steps": 50,
    "outer_lr": 0.7,
    "outer_momentum": 0.5,
    "outer_averaging": 0.7,
    "routing": "sample",
    "seed": 42,
}


def _metadata(readme):
    text = readme.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1]), text


def test_model_card_trained_from_scratch(tmp_path):
    plot = plot_training_curves(LOG_HISTORY, tmp_path / "training_curves.png")
    card = render_model_card(
        tmp_path,
        base_model=None,
        dataset="roneneldan/TinyStories",
        settings=SETTINGS,
        final_perplexity=20.1,
        replica_divergence=0.03,
        tokens_seen=1234567,
        plot_file=plot,
        repo_id="someone/tiny-noloco",
    )
    meta, text = _metadata(tmp_path / "README.md")
    assert card.data.library_name == "transformers"
    assert meta["library_name"] == "transformers"
    assert {"hf-noloco", "noloco"} <= set(meta["tags"])
    assert "base_model" not in meta
    assert meta["datasets"] == ["roneneldan/TinyStories"]
    metric = meta["model-index"][0]["results"][0]["metrics"][0]
    assert metric["type"] == "perplexity" and metric["value"] == pytest.approx(20.1)
    assert "trained from scratch" in text and "fine-tuned" not in text
    for expected in (
        "20.100",
        "0.03",
        "1,234,567",
        "(H) | 50",
        "(β) | 0.7",
        "(α) | 0.5",
        "(γ) | 0.7",
        "| 2 |",
        "| 4 |",
        "noloco",
        "sample",
        "Seed | 42",
        "](training_curves.png)",
        'from_pretrained("someone/tiny-noloco")',
        "mean of the replicas",
        "Exported weights | replica mean",
        "random replica of the next stage",
    ):
        assert expected in text, expected
    assert (tmp_path / "training_curves.png").read_bytes()[:8] == PNG_MAGIC


def test_model_card_from_base_model_without_eval(tmp_path):
    render_model_card(
        tmp_path,
        base_model="HuggingFaceTB/SmolLM2-135M",
        dataset="/data/my_corpus.jsonl",
        settings={**SETTINGS, "outer_optimizer": "diloco", "export_replica": 1},
        final_perplexity=None,
        replica_divergence=None,
        tokens_seen=100,
        plot_file=None,
    )
    meta, text = _metadata(tmp_path / "README.md")
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M"
    assert "datasets" not in meta  # a local path is not a Hub dataset id
    assert "model-index" not in meta
    assert "diloco" in meta["tags"]
    assert "[HuggingFaceTB/SmolLM2-135M](https://huggingface.co/HuggingFaceTB/SmolLM2-135M)" in text
    assert "trained from scratch" not in text and "/data/my_corpus.jsonl" in text
    assert "not measured" in text and "![" not in text
    assert "replica 1 of every stage" in text and "DiLoCo baseline" in text


def test_model_card_labels_every_setting_and_inherits_the_base_cards_terms(tmp_path):
    """A card for a run fine-tuned from a local checkpoint whose own card states a license and languages."""
    from hf_noloco.io.card import SETTING_LABELS

    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\nlanguage:\n- en\n- fr\n---\n# Base\n")
    settings = dict.fromkeys(SETTING_LABELS, 3)
    render_model_card(
        tmp_path / "out",
        base_model=str(base),
        base_model_folder=base,
        dataset="Salesforce/wikitext",
        dataset_config="wikitext-2-raw-v1",
        dataset_split="validation",
        settings=settings,
        final_perplexity=12.5,
        replica_divergence=None,
        tokens_seen=10,
        plot_file=None,
        wandb_url="https://wandb.ai/me/proj/runs/abc",
    )
    meta, text = _metadata(tmp_path / "out" / "README.md")
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en", "fr"]
    assert "base_model" not in meta  # a local folder is no Hub id
    assert f"a local checkpoint (`{base}`)" in text and "huggingface.co/" + str(base) not in text
    dataset = meta["model-index"][0]["results"][0]["dataset"]
    assert dataset == {
        "name": "Salesforce/wikitext",
        "type": "Salesforce/wikitext",
        "config": "wikitext-2-raw-v1",
        "split": "validation",
    }
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.endswith(" |")]
    labels = {row.split(" | ")[0][2:] for row in rows}
    assert set(SETTING_LABELS.values()) <= labels
    assert not set(SETTING_LABELS) & labels  # no raw key shown
    assert "(https://wandb.ai/me/proj/runs/abc)" in text
    import transformers

    assert f"- transformers: {transformers.__version__}" in text and "- torch: " in text
