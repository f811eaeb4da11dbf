"""The training command: ``hf-noloco-train --config recipe.yaml [--key value ...]`` (also
``recipes/train.py``).

Pretrains from a config (``model_config``) or fine-tunes a checkpoint (``model_name_or_path``) with NoLoCo, on
the built-in corpus unless ``dataset_name`` says otherwise, then evaluates, exports one ordinary HF checkpoint
with its model card into ``output_dir`` and optionally pushes it to the Hub.

A recipe's keys become the parser's defaults and the command line overrides them, as in TRL; the recipe may
also be given as the first argument. Every option is a field of :class:`~hf_noloco.config.ModelArguments`,
:class:`~hf_noloco.config.DataArguments` or :class:`~hf_noloco.config.NoLoCoConfig`, and its ``--help`` text
is that field's docstring entry.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import functools
import gc
import logging
import os
import re
import sys
import time
import types
import typing

import yaml
from transformers import HfArgumentParser

from hf_noloco.config import NoLoCoConfig, check_config
from hf_noloco.data.arguments import FORMER_DATA_NAMES, DataArguments
from hf_noloco.launch.arguments import ModelArguments, model_config_values
from hf_noloco.resilience.membership import ReplicaDropped
from hf_noloco.resilience.preemption import PREEMPTED_EXIT_STATUS
from hf_noloco.rules import check_merge_adapter, check_model_init_kwargs, check_streamed_training

MODEL_SOURCES = ("model_name_or_path", "model_config")
# A folder holding none of these has no tokenizer (transformers would look further, and say less).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
# Options whose values are never shown in an error (nor those of options the parser does not know).
_SECRET_WORDS = ("token", "secret", "password", "api_key")


class ConfigError(ValueError):
    """A bad recipe or option: reported as one ``error: ...`` line and exit status 2, without a traceback."""


class NoLoCoArgumentParser(HfArgumentParser):
    """``HfArgumentParser`` over the command's three dataclasses, with a recipe YAML as defaults.

    Errors name the bad option in one line (a :class:`ConfigError`) instead of printing the usage of every
    TrainingArguments field and exiting.
    """

    def __init__(self):
        # No abbreviations: `--max_step` must be an error, not silently `--max_steps`.
        super().__init__(
            (ModelArguments, DataArguments, NoLoCoConfig), prog="hf-noloco-train", allow_abbrev=False
        )
        self.add_argument(
            "--config",
            metavar="RECIPE",
            help="A recipe YAML: its keys are defaults, which the options given on the command line "
            "override. It may also be given as the first argument.",
        )
        self.field_types = {}
        for dtype in self.dataclass_types:
            hints = typing.get_type_hints(dtype)  # once per class: it evaluates every annotation of the MRO
            self.field_types.update({f.name: hints[f.name] for f in dataclasses.fields(dtype) if f.init})

    def _parse_dataclass_field(self, parser, field):
        # A bare `--flag` means true for a `bool | None` option too (TRL's command lines write `--packing`):
        # HfArgumentParser gives that form only to options whose default is a bool.
        if field.type == bool | None and field.default is None and "nargs" not in field.metadata:
            field = copy.copy(field)
            field.metadata = types.MappingProxyType({**field.metadata, "nargs": "?", "const": True})
        super()._parse_dataclass_field(parser, field)

    def error(self, message):
        message = re.sub(r"(--[\w]+)/--[\w-]+", r"\1", message).rstrip(".")  # drop the --dashed-alias
        option = re.match(r"argument (--[\w-]+)", message)
        secret = option and any(word in option.group(1).lower() for word in _SECRET_WORDS)
        if secret and "invalid" in message:  # argparse shows the value it refused
            message = f"argument {option.group(1)}: invalid value (not shown)"
        if message.endswith("expected one argument"):
            message += " (a value starting with '-', such as -1e-8, is written --key=-1e-8)"
        raise ConfigError(
            f"{message[0].upper()}{message[1:]}. `hf-noloco-train --help` lists the valid options."
        )

    def parse(self, argv: list[str]) -> argparse.Namespace:
        """The options of ``argv``: a recipe (``--config`` or first argument) as defaults, then the rest."""
        argv = list(argv)
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        known, argv = pre.parse_known_args(argv)
        recipe_path = known.config
        if recipe_path is None and argv and argv[0].endswith((".yaml", ".yml")):
            recipe_path, argv = argv[0], argv[1:]
        if recipe_path is not None:
            recipe = self._read_recipe(recipe_path)
            given = {a[2:].split("=")[0] for a in argv if a.startswith("--")}
            if given & set(MODEL_SOURCES):  # a model source on the command line replaces the recipe's
                recipe = {k: v for k, v in recipe.items() if k not in MODEL_SOURCES}
            recipe = _without_overridden_names(recipe, given)
            self.set_defaults(
                **{k: self._default(k, v, recipe_path) for k, v in recipe.items() if v is not None}
            )
        namespace, unknown = self.parse_known_args(argv)
        if unknown:
            if not unknown[0].startswith("-"):
                raise ConfigError(
                    f"Unexpected argument {unknown[0]!r}: give a recipe .yaml file first (or --config "
                    "RECIPE), then --key value overrides."
                )
            names = [a.split("=")[0] for a in unknown if a.startswith("-")]
            hint = self._suggestion(names[0].lstrip("-"))
            raise ConfigError(
                f"Unknown options: {' '.join(names)} (their values are not shown).{hint} `hf-noloco-train "
                "--help` lists the valid ones."
            )
        return namespace

    def build(self, dtype, namespace: argparse.Namespace):
        """One of the dataclasses, from the parsed options (its ``__post_init__`` checks them)."""
        return dtype(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(dtype) if f.init})

    def _read_recipe(self, path: str) -> dict:
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
            raise ConfigError(
                f"{path} must hold a mapping of option names to values, got a {type(recipe).__name__}."
            )
        for key in recipe:
            if not isinstance(key, str) or key not in self.field_types:
                raise ConfigError(
                    f"{path}: unknown option {key!r}.{self._suggestion(str(key))} `hf-noloco-train --help` "
                    "lists the valid ones."
                )
        return recipe

    def _suggestion(self, name: str) -> str:
        close = difflib.get_close_matches(name, list(self.field_types), n=1)
        return f" Did you mean {close[0]!r}?" if close else ""

    def _default(self, key: str, value, path: str):
        """A recipe value as a parser default. Scalars become text, so argparse converts (and checks) them as
        if typed on the command line; lists and mappings go where the option's type takes them."""
        kinds = _kinds(self.field_types[key])
        if isinstance(value, dict):
            if dict not in kinds:
                raise ConfigError(f"{path}: {key} takes a single value, got a mapping {value!r}.")
            return value
        if isinstance(value, list):
            if list not in kinds:
                raise ConfigError(f"{path}: {key} takes one value, got the list {value!r}.")
            if any(isinstance(v, (list, dict)) for v in value):
                raise ConfigError(f"{path}: {key} must be a list of plain values, got {value!r}.")
            element = kinds[list]
            try:
                return [
                    element(v) if element in (int, float) and not isinstance(v, bool) else v for v in value
                ]
            except ValueError:
                raise ConfigError(
                    f"{path}: {key} must be a list of {element.__name__} values, got {value!r}."
                ) from None
        if isinstance(value, bool) and bool not in kinds:
            # YAML 1.1 reads a bare `no` as False: `eval_strategy: no` means the choice "no".
            return "no" if value is False else str(value)
        return str(value)


# An option's former names (their dataclass turns each into the new one, refusing the two given together).
ALIASES = {**FORMER_DATA_NAMES, "gradient_checkpointing": "activation_checkpointing"}


def _without_overridden_names(recipe: dict, given: set[str]) -> dict:
    """The recipe without the options the command line gives under another of their names: the command line
    wins, whichever name each source uses (both names in one source stay an error of the dataclass)."""
    overridden = set()
    for old, new in ALIASES.items():
        if old in given and new not in given:
            overridden.add(new)
        elif new in given and old not in given:
            overridden.add(old)
    return {k: v for k, v in recipe.items() if k not in overridden}


def _kinds(annotation) -> dict:
    """What a field's type accepts, as ``{kind: element type}``: ``dict``, ``list`` (with its element type),
    ``bool``, or ``str`` for every other scalar."""
    kinds = {}
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    args = typing.get_args(annotation) if union else (annotation,)
    for arg in args:
        origin = typing.get_origin(arg) or arg
        if origin is dict:
            kinds[dict] = None
        elif origin is list:
            element = typing.get_args(arg)
            kinds[list] = element[0] if element else str
        elif arg is bool:
            kinds[bool] = None
        elif arg is not type(None):
            kinds[str] = None
    return kinds


def parse_args(argv: list[str]) -> tuple[ModelArguments, DataArguments, NoLoCoConfig]:
    """A recipe plus ``--key value`` overrides, as the three settings dataclasses.

    Everything is checked before the process group is joined (building ``NoLoCoConfig`` joins it when
    launched): a bad setting fails the same way on every rank, and needs no peer.

    Raises:
        ValueError (a :class:`ConfigError` for the command line itself) naming the bad option.
    """
    parser = NoLoCoArgumentParser()
    if any(a.split("=")[0] == "--hub_token" for a in argv) and os.environ.get("RANK", "0") == "0":
        print(
            "warning: --hub_token puts the token on the command line, where other users of this machine can "
            "read it (ps, /proc); set the HF_TOKEN environment variable (or run `hf auth login`) instead.",
            file=sys.stderr,
        )
    model_args, data_args, namespace = _parse_and_check(parser, argv)
    return model_args, data_args, parser.build(NoLoCoConfig, namespace)


def _parse_and_check(parser: NoLoCoArgumentParser, argv: list[str]):
    namespace = parser.parse(argv)
    model_args = parser.build(ModelArguments, namespace)
    data_args = parser.build(DataArguments, namespace)
    namespace.model_init_kwargs = merged_model_init_kwargs(model_args, namespace.model_init_kwargs)
    check_config(namespace)  # what NoLoCoConfig checks, before it joins the process group
    check_combination(model_args, data_args, namespace)
    if model_args.model_config is not None:
        check_model_config(model_args.model_config, namespace)
    return model_args, data_args, namespace


def check_combination(model_args: ModelArguments, data_args: DataArguments, settings) -> None:
    """Checks of options that belong to different dataclasses."""
    if data_args.dataset_streaming:
        check_streamed_training(settings.max_steps, settings.dataloader_num_workers)
        if model_args.tokenizer_name_or_path is None and model_args.model_name_or_path is None:
            raise ValueError(
                "dataset_streaming=True needs a tokenizer (tokenizer_name_or_path): training one from "
                "scratch would read the corpus before training."
            )
    check_merge_adapter(settings.merge_adapter, model_args.use_peft)


def merged_model_init_kwargs(model_args: ModelArguments, given) -> dict | None:
    """``model_init_kwargs`` with the model options of :class:`ModelArguments` added (as TRL scripts do);
    a value given both ways must agree."""
    merged = check_model_init_kwargs(given)
    for key, value in model_args.model_init_kwargs().items():
        if key in merged and merged[key] != value:
            raise ConfigError(
                f"model_init_kwargs sets {key}={merged[key]!r} but the model options set {value!r}: "
                "give it once."
            )
        merged[key] = value
    return merged or None


def check_recipe(argv: list[str], model_config: dict | None = None):
    """A dry run of a recipe: every option is parsed and checked as ``hf-noloco-train`` does, and the
    model is built on the meta device (no memory, no weights), split into this run's stages and given its
    LoRA adapters. Set ``WORLD_SIZE`` to the launch's number of processes. ``model_config`` stands in for
    the ``config.json`` of ``model_name_or_path`` (without it, that file is read from the folder or the Hub).

    Returns:
        ``(model_args, data_args, settings)``: the settings are the parsed options, checked as
        :class:`~hf_noloco.config.NoLoCoConfig` checks them but not built into one (which would join the
        launch's process group).
    """
    model_args, data_args, config = _parse_and_check(NoLoCoArgumentParser(), argv)
    if model_args.model_name_or_path is not None:
        if model_config is None:
            from transformers import AutoConfig

            model_config = AutoConfig.from_pretrained(
                model_args.model_name_or_path,
                revision=model_args.model_revision,
                trust_remote_code=model_args.trust_remote_code,
            ).to_dict()
        from hf_noloco.adapters.settings import lora_config_of

        check_model_config(model_config_values(model_config), config, lora_config_of(model_args))
    return model_args, data_args, config


def check_model_config(values: dict, settings, peft_config=None) -> None:
    """Builds the model on the meta device (no memory) and splits it as the trainer will (with LoRA adapters
    when ``peft_config`` is given): an unknown ``model_type``, impossible sizes, a non-Llama architecture,
    stage boundaries outside the layers or adapter targets missing from a stage fail here, naming the
    setting."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_noloco.engine.partition import check_llama_layout, split_model

    config = _auto_config(values)
    heads, kv_heads = (
        getattr(config, "num_attention_heads", None),
        getattr(config, "num_key_value_heads", None),
    )
    hidden, head_dim = getattr(config, "hidden_size", None), getattr(config, "head_dim", None)
    if heads and hidden and head_dim is None and hidden % heads:
        raise ValueError(
            f"model_config: hidden_size={hidden} is not a multiple of num_attention_heads={heads}."
        )
    if heads and kv_heads and heads % kv_heads:
        raise ValueError(
            f"model_config: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}."
        )
    trust = (getattr(settings, "model_init_kwargs", None) or {}).get("trust_remote_code", False)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"model_config: {str(exc).splitlines()[0]}") from None
    check_llama_layout(model)
    if peft_config is not None:
        from hf_noloco.adapters.stage import add_adapters

    for stage_index in range(settings.pipeline_stages):
        stage = split_model(
            model, stage_index, settings.pipeline_stages, settings.stage_boundaries, settings.stage_balance
        )
        if peft_config is not None:
            with torch.device("meta"):
                add_adapters(stage, peft_config)


def _auto_config(values: dict):
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**values)
    except Exception as exc:  # noqa: BLE001 - transformers' config validators raise several types
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        message = lines[-1] if lines else type(exc).__name__
        if "Unrecognized model identifier" in str(exc):
            family = "llama, mistral, qwen2, qwen3"
            message = f"unknown model_type {values['model_type']!r} (Llama-family types: {family})"
        raise ValueError(f"model_config: {message}") from None


def _model_config(model_args: ModelArguments, tokenizer):
    """The from-scratch model's config, with the tokenizer's vocabulary and special tokens."""
    config = _auto_config(model_args.model_config)
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    return config


def _tokenizer(model_args: ModelArguments, data_args: DataArguments, config: NoLoCoConfig):
    tokenizer = _load_tokenizer(model_args, data_args, config)
    if model_args.chat_template_path is not None:
        tokenizer.chat_template = _chat_template(model_args.chat_template_path)
    return tokenizer


def _chat_template(path: str) -> str:
    """The template of ``chat_template_path``: a Jinja file's text, or a tokenizer's own template."""
    from transformers import AutoTokenizer

    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = getattr(AutoTokenizer.from_pretrained(path), "chat_template", None)
    if not template:
        raise ValueError(f"chat_template_path: the tokenizer {path!r} has no chat template.")
    return template


def _load_tokenizer(model_args: ModelArguments, data_args: DataArguments, config: NoLoCoConfig):
    from transformers import AutoTokenizer

    from hf_noloco.data.corpus import train_bpe_tokenizer
    from hf_noloco.data.datasets import documents

    name = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if name is not None:
        same_repo = model_args.tokenizer_name_or_path in (None, model_args.model_name_or_path)
        revision = model_args.model_revision if same_repo else None
        if os.path.isdir(name) and not any(os.path.exists(os.path.join(name, f)) for f in TOKENIZER_FILES):
            raise ValueError(
                f"No tokenizer could be loaded from {name!r}: the folder holds none of "
                f"{', '.join(TOKENIZER_FILES)}; give tokenizer_name_or_path, or pretrain from scratch "
                "(model_config) to train one."
            )
        try:
            return AutoTokenizer.from_pretrained(
                name, revision=revision, trust_remote_code=model_args.trust_remote_code
            )
        except Exception as exc:  # noqa: BLE001 - tokenizers and transformers raise many types; all named
            cause = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            raise ValueError(
                f"No tokenizer could be loaded from {name!r} ({type(exc).__name__}: {cause}). Give "
                "tokenizer_name_or_path, or pretrain from scratch (model_config) to train one."
            ) from None
    # From scratch: rank 0 trains a BPE tokenizer on the training documents; the others load it.
    folder = os.path.join(config.output_dir, "tokenizer")
    if config.joining:  # a column joining a live run loads the run's (its stand-in group has no barrier)
        for name in ("tokenizer_config.json", "tokenizer.json"):
            wait_for_file(os.path.join(folder, name), config.ddp_timeout)
        return AutoTokenizer.from_pretrained(folder)
    with config.main_process_first(desc="tokenizer"):
        if config.process_index == 0:
            train_docs, _ = documents(data_args, config.seed)
            if data_args.dataset_text_field not in train_docs.column_names:
                raise ValueError(
                    "A tokenizer is trained from scratch on text documents: the dataset has no "
                    f"{data_args.dataset_text_field!r} column (its columns are {train_docs.column_names}); "
                    "give tokenizer_name_or_path."
                )
            return train_bpe_tokenizer(
                train_docs[data_args.dataset_text_field], model_args.tokenizer_vocab_size, folder
            )
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        # Rank 0 failed before it wrote the tokenizer: the same documents give this rank the same error.
        documents(data_args, config.seed)
        raise ValueError(f"Rank 0 did not write the tokenizer trained from scratch into {folder}.")
    return AutoTokenizer.from_pretrained(folder)


def wait_for_file(path: str, timeout: float) -> None:
    started = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - started > timeout:
            raise FileNotFoundError(f"{path} did not appear within {timeout:g}s (the run writes it first).")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    """Runs the command. A bad setting ends every rank with one ``error: ...`` line and exit status 2;
    HF_NOLOCO_TRACEBACK=1 shows the traceback instead."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        model_args, data_args, config = parse_args(argv)
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
    """An error raised by hf_noloco's own checks, argparse's or TrainingArguments' (their messages are written
    for users). A ValueError from deep inside torch or transformers is a bug or an unforeseen case: keep its
    traceback."""
    if isinstance(exc, ConfigError):
        return True
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    raiser = os.path.abspath(tb.tb_frame.f_code.co_filename)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return raiser.startswith(package + os.sep) or raiser.endswith(
        os.path.join("transformers", "training_args.py")
    )


def train(model_args: ModelArguments, data_args: DataArguments, config: NoLoCoConfig) -> None:
    """Tokenizer, datasets, training, final evaluation, export (and push)."""
    if "wandb" in config.report_to and not _wandb_configured():
        os.environ.setdefault("WANDB_MODE", "offline")  # never prompt a user who is not logged in
        os.environ.setdefault("WANDB_DIR", config.output_dir)
    from hf_noloco.adapters.settings import lora_config_of
    from hf_noloco.data.datasets import datasets_from_args
    from hf_noloco.trainer import NoLoCoTrainer

    tokenizer = _tokenizer(model_args, data_args, config)
    evaluation = config.eval_strategy != "no"  # a run that never evaluates builds no evaluation set
    prepare = functools.partial(
        datasets_from_args, data_args, tokenizer, seed=config.seed, evaluation=evaluation
    )
    if data_args.dataset_streaming:  # nothing to prepare ahead: each replica reads its shard as it trains
        train_set, eval_set = prepare()
    else:
        with config.main_process_first(desc="dataset"):  # rank 0 fills the datasets cache, the others read it
            train_set, eval_set = prepare()
    model = model_args.model_name_or_path or _model_config(model_args, tokenizer)
    trainer = NoLoCoTrainer(
        model,
        config,
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        data_args=data_args,
        peft_config=lora_config_of(model_args),
    )
    # What start-up made (modules, configs, the datasets' metadata) lives to the end: out of the collector's
    # sight, a full collection walks only what training allocates.
    gc.freeze()
    resume = config.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = True  # the newest checkpoint in output_dir
    elif isinstance(resume, str) and resume.lower() == "auto":
        resume = "auto"  # that one if any, else a fresh start
    try:
        trainer.train(resume_from_checkpoint=resume)
        if trainer.parts.preemption.stopped:  # a checkpoint was written: no evaluation, no export
            trainer.end()
            sys.exit(PREEMPTED_EXIT_STATUS)
        metrics = trainer.evaluate() if eval_set is not None else {}
        if config.push_to_hub:
            url = trainer.push_to_hub()
        else:
            trainer.save_model()
            url = None
    except ReplicaDropped as exc:  # on_replica_loss="continue": the others train on without this column
        trainer.close_watchers()
        logging.getLogger("hf_noloco").warning("%s; this process leaves the run.", exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no collective, no process-group teardown: the others no longer wait for this rank
    if trainer.is_world_process_zero():
        if "eval_perplexity" in metrics:  # an evaluation interrupted by a lost replica has none
            print(
                f"\nFinal eval perplexity {metrics['eval_perplexity']:.2f} after {trainer.state.global_step} "
                "steps."
            )
        what = {"model": "Model", "adapter": "LoRA adapter (PEFT)", "merged": "Model (LoRA adapters merged)"}
        print(f"{what[trainer.export_kind]}, tokenizer and model card: {os.path.abspath(config.output_dir)}")
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
