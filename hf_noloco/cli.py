"""The training command: ``hf-noloco-train recipe.yaml [--key value ...]`` (also ``recipes/train.py``).

Pretrains from a config (``model_config``) or fine-tunes a checkpoint (``model_name_or_path``) with
NoLoCo, on the built-in corpus unless ``dataset_name`` says otherwise, then evaluates, exports one ordinary
HF checkpoint with its model card into ``output_dir`` and optionally pushes it to the Hub.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field

import yaml
from transformers import HfArgumentParser

from .config import NoLoCoConfig
from .data import BUILTIN_DATASET, _looks_like_local_path


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


class ConfigError(ValueError):
    """A bad recipe or option: reported as one ``error: ...`` line and exit status 2, without a traceback."""


class _Parser(HfArgumentParser):
    """Errors name the bad option in one line, instead of printing the usage of every TrainingArguments
    field and exiting."""

    def error(self, message):
        message = re.sub(r"(--[\w]+)/--[\w-]+", r"\1", message).rstrip(".")  # drop the --dashed-alias
        if message.endswith("expected one argument"):
            message += " (a value starting with '-', such as -1e-8, is written --key=-1e-8)"
        raise ConfigError(f"{message[0].upper()}{message[1:]}. `hf-noloco-train --help` lists the valid options.")


def parse_args(argv: list[str]) -> tuple[ModelArguments, DataArguments, NoLoCoConfig]:
    """A recipe YAML (first argument, optional) plus ``--key value`` overrides; unknown keys are errors.

    Raises:
        ConfigError (a ValueError) for anything wrong with the recipe or the overrides, naming the option,
        before any process group, tokenizer or dataset work starts where possible.
    """
    parser = _Parser((ModelArguments, DataArguments, NoLoCoConfig))
    cli: list[str] = []
    if argv and argv[0].endswith((".yaml", ".yml")):
        cli = _recipe_to_cli(argv[0], parser)
        argv = argv[1:]
    # Everything is checked before the dataclasses are built: under a launch, building NoLoCoConfig joins the
    # process group, and an error before that needs no peer and cannot hang.
    values, unknown = parser.parse_known_args(cli + list(argv))
    if unknown:
        if not unknown[0].startswith("-"):
            raise ConfigError(
                f"Unexpected argument {unknown[0]!r}: give a recipe .yaml file first, then --key value overrides."
            )
        raise ConfigError(f"Unknown options: {' '.join(unknown)}. `hf-noloco-train --help` lists the valid ones.")
    _check_values(values)
    model_args, data_args, config = parser.parse_args_into_dataclasses(args=cli + list(argv))
    return model_args, data_args, config


def _recipe_to_cli(path: str, parser) -> list[str]:
    """The recipe's ``key: value`` pairs as ``--key value`` arguments, checked against the options' shapes."""
    if not os.path.isfile(path):
        raise ConfigError(f"Recipe file {path!r} does not exist.")
    try:
        with open(path) as f:
            recipe = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path} is not valid YAML{line}: {problem}.") from None
    recipe = {} if recipe is None else recipe
    if not isinstance(recipe, dict):
        raise ConfigError(f"{path} must hold a mapping of option names to values, got a {type(recipe).__name__}.")
    cli = []
    for key, value in recipe.items():
        action = parser._option_string_actions.get(f"--{key}") if isinstance(key, str) else None
        if action is None:
            raise ConfigError(f"{path}: unknown option {key!r}. `hf-noloco-train --help` lists the valid ones.")
        cli += _to_cli(key, value, action, path)
    return cli


def _to_cli(key: str, value, action, path: str) -> list[str]:
    if value is None:
        return []  # `key:` with nothing after it keeps the default
    if isinstance(value, dict):
        if action.type is not str:
            raise ConfigError(f"{path}: {key} takes a single value, got a mapping {value!r}.")
        return [f"--{key}", json.dumps(value)]
    if isinstance(value, list):
        if any(isinstance(v, (list, dict)) for v in value):
            raise ConfigError(f"{path}: {key} must be a list of plain values, got {value!r}.")
        if action.nargs in ("+", "*"):
            return [f"--{key}", *[str(v) for v in value]]
        if key == "report_to" and len(value) == 1:
            return [f"--{key}={value[0]}"]
        raise ConfigError(f"{path}: {key} takes one value, got the list {value!r}.")
    if isinstance(value, bool) and action.choices and "no" in action.choices:
        # YAML 1.1 reads a bare `no` as False: `eval_strategy: no` means the choice "no".
        return [f"--{key}={'yes' if value else 'no'}"]
    # --key=value: a negative number in scientific notation (-1e-8) would otherwise read as an option.
    return [f"--{key}={value}"]


def _check_values(v) -> None:
    """Settings that would otherwise fail late (after tokenizer training and dataset preparation) or deep inside
    torch, numpy or the Trainer with a message that does not name them. ``v``: the parsed options."""
    if (v.model_name_or_path is None) == (v.model_config is None):
        raise ConfigError("Give exactly one of model_name_or_path (fine-tune) or model_config (pretrain from scratch).")
    if v.block_size < 2:
        raise ConfigError(f"block_size must be at least 2, got {v.block_size}.")
    for name in ("max_train_samples", "preprocessing_num_proc"):
        value = getattr(v, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value}.")
    if not 0 <= v.validation_split_percentage < 100:
        raise ConfigError(f"validation_split_percentage must be in [0, 100), got {v.validation_split_percentage}.")
    path = os.path.expanduser(v.dataset_name)
    if v.dataset_name != BUILTIN_DATASET and _looks_like_local_path(path) and not os.path.exists(path):
        raise ConfigError(f"dataset_name: no such file or folder {v.dataset_name!r}.")

    kwargs = v.lr_scheduler_kwargs
    if isinstance(kwargs, str) and kwargs.strip():
        try:
            parsed = json.loads(kwargs)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ConfigError(f"lr_scheduler_kwargs must be a JSON object such as '{{\"num_cycles\": 2}}', got {kwargs!r}.")
    _check_report_to(v.report_to)
    if v.push_to_hub:
        from .hub import check_hub_settings

        check_hub_settings(True, v.hub_model_id, v.hub_token)
    resume = v.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() not in ("true", "last") and not os.path.isdir(resume):
        raise ConfigError(f"resume_from_checkpoint: no such checkpoint folder {resume!r}.")
    if v.model_config is not None:
        if v.tokenizer_name_or_path is None and v.tokenizer_vocab_size < 259:
            raise ConfigError(
                f"tokenizer_vocab_size must be at least 259 for a byte-level BPE tokenizer, got {v.tokenizer_vocab_size}."
            )
        _check_model_config(v.model_config, v.pipeline_stages, v.stage_boundaries, v.stage_balance)


def _check_report_to(report_to: str | None) -> None:
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    names = [] if report_to in (None, "none", "all") else [report_to]
    unknown = [name for name in names if name not in INTEGRATION_TO_CALLBACK]
    if unknown:
        raise ConfigError(
            f"report_to: unknown integration {unknown[0]!r}; use none, all, or one of "
            f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}."
        )


def _model_config_values(spec: str) -> dict:
    """model_config as a dict: a config.json path or a JSON object with a model_type."""
    if os.path.isfile(spec):
        try:
            with open(spec) as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"model_config: {spec} is not a readable JSON file ({exc}).") from None
    else:
        try:
            values = json.loads(spec)
        except json.JSONDecodeError:
            raise ConfigError(f"model_config is neither a config.json path nor a JSON dict: {spec!r}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"model_config must be a mapping of config fields (with a model_type), got {spec!r}.")
    if "model_type" not in values:
        raise ConfigError("model_config needs a model_type (e.g. llama, mistral, qwen2).")
    return values


_MODEL_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "head_dim")


def _check_model_config(
    spec: str, pipeline_stages: int, stage_boundaries: list[int] | None, stage_balance: str = "layers"
) -> None:
    """Builds the model on the meta device (no memory) and splits it as the trainer will: an unknown
    model_type, impossible sizes, a non-Llama architecture, stage boundaries outside the layers or tied
    embeddings over several stages all fail here, naming the setting."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .partition import check_llama_layout, split_model

    values = _model_config_values(spec)
    for name in _MODEL_SIZES:
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"model_config: {name} must be a positive integer, got {value!r}.")
    try:
        model_config = AutoConfig.for_model(**values)
    except Exception as exc:  # noqa: BLE001 - transformers' config validators raise several types
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        message = lines[-1] if lines else type(exc).__name__
        if "Unrecognized model identifier" in str(exc):
            message = f"unknown model_type {values['model_type']!r} (Llama-family types: llama, mistral, qwen2, qwen3)"
        raise ConfigError(f"model_config: {message}") from None
    heads, kv_heads = getattr(model_config, "num_attention_heads", None), getattr(model_config, "num_key_value_heads", None)
    hidden, head_dim = getattr(model_config, "hidden_size", None), getattr(model_config, "head_dim", None)
    if heads and hidden and head_dim is None and hidden % heads:
        raise ConfigError(f"model_config: hidden_size={hidden} is not a multiple of num_attention_heads={heads}.")
    if heads and kv_heads and heads % kv_heads:
        raise ConfigError(
            f"model_config: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}."
        )
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model_config: {str(exc).splitlines()[0]}") from None
    check_llama_layout(model)
    if pipeline_stages >= 1:  # otherwise NoLoCoConfig names the problem
        split_model(model, 0, pipeline_stages, stage_boundaries, stage_balance)


def _model_config(model_args: ModelArguments, tokenizer):
    from transformers import AutoConfig

    values = _model_config_values(model_args.model_config)
    config = AutoConfig.from_pretrained(model_args.model_config) if os.path.isfile(model_args.model_config) \
        else AutoConfig.for_model(**values)
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
    """Runs the command. A bad setting ends every rank with one ``error: ...`` line and exit status 2;
    HF_NOLOCO_TRACEBACK=1 shows the traceback instead."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        try:
            model_args, data_args, config = parse_args(argv)
        except ValueError as exc:  # argparse, TrainingArguments and our checks: all about the given settings
            raise ConfigError(str(exc)) from exc
        train(model_args, data_args, config)
    except (ValueError, FileNotFoundError) as exc:
        if os.environ.get("HF_NOLOCO_TRACEBACK") or not _is_user_error(exc):
            raise
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        where = f" (rank {os.environ.get('RANK', '?')} of {world_size})" if world_size > 1 else ""
        print(f"error{where}: {exc}", file=sys.stderr, flush=True)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # without it some gloo ranks abort noisily at exit
        sys.exit(2)


def _is_user_error(exc: BaseException) -> bool:
    """A ConfigError, or an error raised by hf_noloco's own checks (its messages are written for users). A
    ValueError from deep inside torch or transformers is a bug or an unforeseen case: keep its traceback."""
    if isinstance(exc, ConfigError):
        return True
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.dirname(os.path.abspath(tb.tb_frame.f_code.co_filename)) == os.path.dirname(os.path.abspath(__file__))


def train(model_args: ModelArguments, data_args: DataArguments, config: NoLoCoConfig) -> None:
    """Tokenizer, datasets, training, final evaluation, export (and push)."""
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
