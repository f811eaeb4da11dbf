"""What ``NoLoCoTrainer`` refuses before it joins anything: inputs it cannot honour, named in one line."""

from __future__ import annotations

from hf_noloco.data.arguments import DataArguments
from hf_noloco.data.datasets import is_pipeline_rows, rows_from_documents
from hf_noloco.data.streaming import TokenStream
from hf_noloco.engine.fidelity import forms_of_rows
from hf_noloco.rules import check_merge_adapter, check_streamed_training


def check_trainer_inputs(model, args, train_dataset, peft_config, kwargs: dict) -> None:
    check_merge_adapter(args.merge_adapter, peft_config is not None)
    if peft_config is not None:
        if args.on_replica_loss == "continue":
            raise ValueError("on_replica_loss='continue' does not support LoRA adapters (use_peft) yet.")
        if type(peft_config).__name__ != "LoraConfig":
            raise TypeError(f"peft_config must be a peft.LoraConfig, got {type(peft_config).__name__}.")
        if not isinstance(model, str):
            raise ValueError(
                "LoRA adapters fine-tune a pretrained checkpoint: pass its Hub id or folder as the model "
                "(the export refers to it, and merge_adapter reads its weights)."
            )
    if isinstance(train_dataset, TokenStream):
        check_streamed_training(args.max_steps, args.dataloader_num_workers)
        if args.joining:
            raise ValueError(
                "column_launch --join resumes its replica's shard at the run's step, which a dataset gives "
                "and a stream does not (its position is its replica's own, lost with it): resume the run "
                "from its newest checkpoint instead (on_replica_loss docs)."
            )
    if kwargs.get("model_init") is not None:
        raise ValueError(
            "model_init is not supported by NoLoCoTrainer: each process builds only its own stage from the "
            "model (a Hub id, a folder, a config or an instance), given as `model`."
        )


def check_dataset_size(dataset, needed: int) -> None:
    if dataset is not None and hasattr(dataset, "__len__") and len(dataset) < needed:
        raise ValueError(
            f"The training set has {len(dataset)} samples, fewer than one batch per replica ({needed}: "
            "replicas x per_device_train_batch_size). Use more data or a smaller batch."
        )


def proof_forms(train_dataset, eval_dataset, custom_collator: bool) -> set[str] | None:
    """The input forms this run feeds its stages (what :func:`~hf_noloco.engine.fidelity.verify_split`
    proves), or ``None`` (every form) when a user's collator or a dataset without known columns leaves them
    open."""
    if custom_collator:
        return None
    evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    evals = [d for d in evals if d is not None]
    forms = set()
    for dataset in [train_dataset, *evals]:
        if dataset is None:
            continue
        if isinstance(dataset, TokenStream):
            forms.add("unpadded" if dataset.packing else "padded")
            continue
        columns = getattr(dataset, "column_names", None)
        if not columns:
            return None
        forms.add(forms_of_rows(columns))
    if evals:
        forms.add("evaluation")
    return forms or None


def pipeline_datasets(train_dataset, eval_dataset, tokenizer, data_args: DataArguments | None):
    """``(train, eval)`` as the pipeline takes them, prepared as TRL's ``SFTTrainer`` prepares what it is
    given: rows of token ids of one length and streams as they are; raw rows (text, conversations,
    prompt/completion pairs, token ids of any length) tokenized and laid into rows as ``hf-noloco-train``
    lays them, by ``data_args``' options (``DataArguments()``'s when none). ``eval`` may be a dict of
    datasets, as the Trainer takes it."""
    data = data_args or DataArguments()

    def prepared(dataset, what: str, evaluation: bool):
        if dataset is None or isinstance(dataset, TokenStream) or is_pipeline_rows(dataset):
            return dataset
        if tokenizer is None:
            raise ValueError(
                f"The {what} set has columns {getattr(dataset, 'column_names', None)}, not rows of token ids "
                "of one length: give processing_class (the tokenizer) to tokenize it."
            )
        return rows_from_documents(dataset, tokenizer, data, f"{what.capitalize()} rows", evaluation)

    if isinstance(eval_dataset, dict):
        evaluated = {name: prepared(d, f"evaluation ({name})", True) for name, d in eval_dataset.items()}
    else:
        evaluated = prepared(eval_dataset, "evaluation", True)
    return prepared(train_dataset, "training", False), evaluated
