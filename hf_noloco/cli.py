"""The training command: ``hf-noloco-train recipe.yaml [--key value ...]`` (also ``recipes/train.py``).

Pretrains from a config (``model_config``) or fine-tunes a checkpoint (``model_name_or_path``) with
NoLoCo, on the built-in corpus unless ``dataset_name`` says otherwise, then evaluates, exports one ordinary
HF checkpoint with its model card into ``output_dir`` and optionally pushes it to the Hub.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

import yaml

from .config import NoLoCoConfig
from .data import BUILTIN_DATASET


@dataclass
class ModelArguments:
    """Which model to train."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub id or local folder of a Llama-family checkpoint to fine-tune."}
    )
    model_config: str | None = field(
        default=None,
        metadata={"help": "Pretrain from scratch: a config dict (JSON, with model_type) or a path to a config.json."},
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer to use. Default: the checkpoint's, or (from scratch) a byte-level BPE "
                          "tokenizer trained on the training text."},
    )
    tokenizer_vocab_size: int = field(default=4096, metadata={"help": "Vocabulary of the trained BPE tokenizer."})


@dataclass
class DataArguments:
    """Which text to train on."""

    dataset_name: str = field(
        default=BUILTIN_DATASET,
        metadata={"help": "Hub dataset name, a local .txt/.json/.jsonl/.parquet file or folder, or "
                          f"{BUILTIN_DATASET!r} (CPython's documentation, no network needed)."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    block_size: int = field(default=256, metadata={"help": "Tokens per packed training sequence."})
    validation_split_percentage: float = field(
        default=5, metadata={"help": "Share of documents held out when the dataset has no validation split."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only this many training blocks."})
    preprocessing_num_proc: int | None = field(default=None, metadata={"help": "Processes for tokenization."})


def parse_args(argv: list[str]) -> tuple[ModelArguments, DataArguments, NoLoCoConfig]:
    """A recipe YAML (first argument, optional) plus ``--key value`` overrides; unknown keys are errors."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser((ModelArguments, DataArguments, NoLoCoConfig))
    cli: list[str] = []
    if argv and argv[0].endswith((".yaml", ".yml")):
        with open(argv[0]) as f:
            recipe = yaml.safe_load(f) or {}
        if not isinstance(recipe, dict):
            raise ValueError(f"{argv[0]} must hold a mapping of option names to values.")
        for key, value in recipe.items():
            cli += _to_cli(key, value)
        argv = argv[1:]
    # Unknown keys fail here, before the dataclasses are built (building NoLoCoConfig joins the process group).
    _, unknown = parser.parse_known_args(cli + list(argv))
    if unknown:
        raise ValueError(f"Unknown options: {' '.join(unknown)}. `hf-noloco-train --help` lists the valid ones.")
    model_args, data_args, config = parser.parse_args_into_dataclasses(args=cli + list(argv))
    if (model_args.model_name_or_path is None) == (model_args.model_config is None):
        raise ValueError("Give exactly one of model_name_or_path (fine-tune) or model_config (pretrain from scratch).")
    if data_args.block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {data_args.block_size}.")
    return model_args, data_args, config


def _to_cli(key: str, value) -> list[str]:
    if isinstance(value, dict):
        return [f"--{key}", json.dumps(value)]
    if isinstance(value, list):
        return [f"--{key}", *[str(v) for v in value]]
    if value is None:
        return []
    return [f"--{key}", str(value)]


def _model_config(model_args: ModelArguments, tokenizer):
    from transformers import AutoConfig

    spec = model_args.model_config
    if os.path.isfile(spec):
        config = AutoConfig.from_pretrained(spec)
    else:
        try:
            values = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model_config is neither a config.json path nor a JSON dict: {spec!r}") from exc
        if "model_type" not in values:
            raise ValueError("model_config needs a model_type (e.g. llama, mistral, qwen2).")
        config = AutoConfig.for_model(**values)
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    return config


def _tokenizer(model_args, data_args, config: NoLoCoConfig):
    from transformers import AutoTokenizer

    from .data import load_splits, train_bpe_tokenizer

    name = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if name is not None:
        try:
            return AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"No tokenizer could be loaded from {name!r}: give tokenizer_name_or_path, or pretrain from "
                "scratch (model_config) to train one."
            ) from exc
    # From scratch: rank 0 trains a BPE tokenizer on the training documents; the others load it.
    folder = os.path.join(config.output_dir, "tokenizer")
    with config.main_process_first(desc="tokenizer"):
        if config.process_index == 0:
            train_docs, _ = load_splits(data_args.dataset_name, data_args.dataset_config, data_args.text_column,
                                        data_args.validation_split_percentage, seed=config.seed)
            return train_bpe_tokenizer(train_docs[data_args.text_column], model_args.tokenizer_vocab_size, folder)
    return AutoTokenizer.from_pretrained(folder)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    model_args, data_args, config = parse_args(argv)
    if "wandb" in config.report_to and not _wandb_configured():
        os.environ.setdefault("WANDB_MODE", "offline")  # never prompt a user who is not logged in
        os.environ.setdefault("WANDB_DIR", config.output_dir)

    from .data import prepare_datasets
    from .trainer import NoLoCoTrainer

    tokenizer = _tokenizer(model_args, data_args, config)
    with config.main_process_first(desc="dataset"):
        train_set, eval_set = prepare_datasets(
            data_args.dataset_name, tokenizer, data_args.block_size, data_args.dataset_config, data_args.text_column,
            data_args.validation_split_percentage, data_args.preprocessing_num_proc, data_args.max_train_samples,
            seed=config.seed,
        )
    model = model_args.model_name_or_path or _model_config(model_args, tokenizer)
    trainer = NoLoCoTrainer(
        model, config, train_dataset=train_set, eval_dataset=eval_set, processing_class=tokenizer,
        dataset_name=data_args.dataset_name,
    )
    resume = config.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = True  # the newest checkpoint in output_dir
    trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    if config.push_to_hub:
        url = trainer.push_to_hub()
    else:
        trainer.save_model()
        url = None
    if trainer.is_world_process_zero():
        print(f"\nFinal eval perplexity {metrics['eval_perplexity']:.2f} after {trainer.state.global_step} steps.")
        print(f"Model, tokenizer and model card: {os.path.abspath(config.output_dir)}")
        print(f"Training curves: {os.path.join(os.path.abspath(config.output_dir), 'training_curves.png')}")
        if os.environ.get("WANDB_MODE") == "offline" and "wandb" in config.report_to:
            wandb_dir = os.path.join(os.path.abspath(os.environ.get("WANDB_DIR", ".")), "wandb")
            print(f"wandb offline run: {wandb_dir} (upload it with `wandb sync`)")
        if url:
            print(f"Pushed to {url}")
    trainer.end()


def _wandb_configured() -> bool:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return True
    netrc = os.path.expanduser("~/.netrc")
    return os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read()


if __name__ == "__main__":
    main()
