"""The training and evaluation sets of a run: documents from :mod:`hf_noloco.data.sources`, tokenized and
laid into rows by :mod:`hf_noloco.data.packing` (or, streamed, by :mod:`hf_noloco.data.streaming`).

Every function here is deterministic: the same inputs give the same rows in the same order on every rank
and every machine, so each process of a multi-process job can call them (the caller may wrap them in
``main_process_first`` so that rank 0 fills the ``datasets`` cache and the others read it).
"""

from __future__ import annotations

import os

from datasets import Dataset

from hf_noloco.data.encoding import DocumentEncoder, dataset_format, make_encoder, set_pad_token
from hf_noloco.data.packing import encode_dataset, rows_of, truncation_report
from hf_noloco.data.sources import evaluation_split, load_splits, load_text_dataset
from hf_noloco.data.streaming import TokenStream


def _on_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def prepare_datasets(
    dataset_name: str,
    tokenizer,
    max_length: int,
    dataset_config: str | None = None,
    dataset_text_field: str = "text",
    validation_split_percentage: float = 5,
    dataset_num_proc: int | None = None,
    max_train_samples: int | None = None,
    seed: int = 42,
    *,
    max_eval_samples: int | None = None,
    packing: bool | None = None,
    packing_strategy: str | None = None,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    assistant_only_loss: bool = False,
    completion_only_loss: bool | None = None,
    pad_token: str | None = None,
    dataset_train_split: str = "train",
    dataset_test_split: str | None = None,
    data_files=None,
    data_dir: str | None = None,
    dataset_revision: str | None = None,
    dataset_mixture: dict | None = None,
    evaluation: bool = True,
) -> tuple[Dataset, Dataset | None]:
    """Loads ``dataset_name`` (or ``dataset_mixture``) and returns ``(train, eval)`` datasets of
    ``max_length``-token rows (``eval`` is ``None`` with ``evaluation=False``).

    The documents come from :func:`~hf_noloco.data.sources.load_splits` (the evaluation split, or a seeded
    carve-out of ``validation_split_percentage`` % of the training documents). Each side is tokenized and laid
    into rows as :func:`~hf_noloco.data.encoding.row_layout` says: wrapped (text and pre-tokenized rows, by
    default), best-fit-decreasing bins (``packing_strategy="bfd"``, the default when conversations or
    prompt/completion pairs are packed) or padded one per row (conversations and prompt/completion pairs, or
    ``packing=False``). Rows cut at ``max_length`` are counted and reported. ``max_train_samples`` /
    ``max_eval_samples`` keep the first that many train / eval rows. The tokenizer gets a padding token if it
    has none (:func:`~hf_noloco.data.encoding.set_pad_token`). The other options are
    :class:`~hf_noloco.DataArguments`'.
    """
    train_docs, eval_docs = load_splits(
        dataset_name,
        dataset_config,
        dataset_text_field,
        validation_split_percentage=validation_split_percentage,
        seed=seed,
        dataset_train_split=dataset_train_split,
        dataset_test_split=dataset_test_split,
        data_files=data_files,
        data_dir=data_dir,
        dataset_revision=dataset_revision,
        dataset_mixture=dataset_mixture,
    )
    encoder, layout = make_encoder(
        tokenizer,
        train_docs.column_names,
        dataset_text_field,
        packing=packing,
        add_bos=add_bos,
        add_eos=add_eos,
        assistant_only_loss=assistant_only_loss,
        completion_only_loss=completion_only_loss,
        max_length=max_length,
        packing_strategy=packing_strategy,
    )
    _check_same_format(eval_docs.column_names, encoder, dataset_name)
    pad_token_id = set_pad_token(tokenizer, pad_token)

    def build(docs: Dataset, what: str) -> Dataset:
        encoded = encode_dataset(docs, encoder, dataset_num_proc)
        if encoder.max_length is not None and _on_rank_zero():
            truncation_report(encoded, max_length, what)
        return rows_of(encoded, layout, max_length, pad_token_id, dataset_num_proc)

    train = build(train_docs, "Training rows")
    if max_train_samples is not None:
        train = train.select(range(min(max_train_samples, train.num_rows)))
    if not evaluation:
        return train, None
    try:
        eval_ = build(eval_docs, "Evaluation rows")
    except ValueError as e:
        raise ValueError(
            f"The evaluation documents are too few for one row ({e}) Raise validation_split_percentage or "
            "lower max_length."
        ) from e
    if max_eval_samples is not None:
        eval_ = eval_.select(range(min(max_eval_samples, eval_.num_rows)))
    return train, eval_


def _check_same_format(columns, encoder: DocumentEncoder, dataset_name: str) -> None:
    if columns is not None and dataset_format(columns, encoder.dataset_text_field) != encoder.fmt:
        raise ValueError(
            f"The dataset {dataset_name!r}'s evaluation split has columns {list(columns)}, of another format "
            f"than its training split ({encoder.fmt})."
        )


def prepare_streams(
    dataset_name: str,
    tokenizer,
    max_length: int,
    dataset_config: str | None = None,
    dataset_text_field: str = "text",
    validation_split_percentage: float = 5,
    max_train_samples: int | None = None,
    *,
    max_eval_samples: int | None = None,
    packing: bool | None = None,
    packing_strategy: str | None = None,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    assistant_only_loss: bool = False,
    completion_only_loss: bool | None = None,
    pad_token: str | None = None,
    dataset_train_split: str = "train",
    dataset_test_split: str | None = None,
    data_files=None,
    data_dir: str | None = None,
    dataset_revision: str | None = None,
    shuffle_dataset: bool = False,
    shuffle_buffer_size: int = 1000,
    seed: int = 42,
    evaluation: bool = True,
) -> tuple[TokenStream, TokenStream | None]:
    """``(train, eval)`` as :class:`~hf_noloco.data.streaming.TokenStream`: nothing is downloaded or
    tokenized ahead, each replica reads its own share when training starts (``eval`` is ``None`` with
    ``evaluation=False``).

    Evaluation reads the evaluation split (as :func:`~hf_noloco.data.sources.load_splits` picks it);
    without one, the rows of the training split that a hash of their content holds out
    (``validation_split_percentage`` % of them; the training stream skips those), which then needs
    ``max_eval_samples`` (held-out rows are spread over the whole stream) unless ``evaluation=False``.
    ``max_train_samples`` ends an epoch after that many training rows;
    ``max_eval_samples`` caps every evaluation. ``shuffle_dataset`` reads the training stream in a seeded,
    resumable order (see :class:`~hf_noloco.data.streaming.TokenStream`). Other options as in
    :func:`prepare_datasets`; rows are wrapped or padded (best-fit-decreasing bins need the whole dataset).
    """
    raw = load_text_dataset(
        dataset_name,
        dataset_config,
        dataset_text_field,
        split=None,
        streaming=True,
        data_files=data_files,
        data_dir=data_dir,
        dataset_revision=dataset_revision,
    )
    eval_split = evaluation_split(raw, dataset_name, dataset_train_split, dataset_test_split)
    train_source = raw[dataset_train_split]
    columns = train_source.column_names
    if columns is None:  # some streamed datasets learn their columns from the first row
        columns = list(next(iter(train_source)).keys())
    encoder, layout = make_encoder(
        tokenizer,
        columns,
        dataset_text_field,
        packing=packing,
        add_bos=add_bos,
        add_eos=add_eos,
        assistant_only_loss=assistant_only_loss,
        completion_only_loss=completion_only_loss,
        max_length=max_length,
        packing_strategy=packing_strategy,
    )
    if layout not in ("wrapped", "padded"):
        raise ValueError(
            f"packing_strategy={layout!r} needs the whole dataset to make its bins: a stream is wrapped or "
            "padded (packing: false)."
        )
    pad_token_id = set_pad_token(tokenizer, pad_token)
    holdout = None
    if eval_split is None:
        if not 0 < validation_split_percentage < 100:
            raise ValueError(
                f"The dataset {dataset_name!r} has no evaluation split, so one is held out of "
                f"{dataset_train_split!r}, but validation_split_percentage={validation_split_percentage} is "
                "not in (0, 100)."
            )
        if evaluation and max_eval_samples is None:
            raise ValueError(
                "Streaming a dataset without an evaluation split needs max_eval_samples when the run "
                "evaluates: the held-out rows are spread over the whole stream, which evaluation would "
                "otherwise read to the end."
            )
        holdout = validation_split_percentage
    else:
        _check_same_format(raw[eval_split].column_names, encoder, dataset_name)
    common = dict(
        encoder=encoder, max_length=max_length, packing=layout == "wrapped", pad_token_id=pad_token_id
    )
    train = TokenStream(
        train_source,
        max_rows=max_train_samples,
        repeat=True,
        holdout=None if holdout is None else (holdout, False),
        split=dataset_train_split,
        shuffle_seed=seed if shuffle_dataset else None,
        shuffle_buffer_size=shuffle_buffer_size,
        **common,
    )
    if not evaluation:
        return train, None
    evaluation_stream = TokenStream(
        train_source if holdout is not None else raw[eval_split],
        max_rows=max_eval_samples,
        repeat=False,
        holdout=None if holdout is None else (holdout, True),
        split=dataset_train_split if holdout is not None else eval_split,
        **common,
    )
    return train, evaluation_stream


def datasets_from_args(data_args, tokenizer, seed: int = 42, evaluation: bool = True):
    """``(train, eval)`` as a :class:`~hf_noloco.DataArguments` says: rows of a dataset, or streams with
    ``dataset_streaming``. ``evaluation=False`` (a run that never evaluates) builds no evaluation set and
    asks for no evaluation option."""
    options = dict(
        max_eval_samples=data_args.max_eval_samples,
        packing=data_args.packing,
        packing_strategy=data_args.packing_strategy,
        add_bos=data_args.add_bos,
        add_eos=data_args.add_eos,
        assistant_only_loss=data_args.assistant_only_loss,
        completion_only_loss=data_args.completion_only_loss,
        pad_token=data_args.pad_token,
        dataset_train_split=data_args.dataset_train_split,
        dataset_test_split=data_args.dataset_test_split,
        data_files=data_args.data_files,
        data_dir=data_args.data_dir,
        dataset_revision=data_args.dataset_revision,
        evaluation=evaluation,
    )
    if data_args.dataset_streaming:
        return prepare_streams(
            data_args.dataset_name,
            tokenizer,
            data_args.max_length,
            data_args.dataset_config,
            data_args.dataset_text_field,
            data_args.validation_split_percentage,
            data_args.max_train_samples,
            shuffle_dataset=data_args.shuffle_dataset,
            shuffle_buffer_size=data_args.shuffle_buffer_size,
            seed=seed,
            **options,
        )
    return prepare_datasets(
        data_args.dataset_name,
        tokenizer,
        data_args.max_length,
        data_args.dataset_config,
        data_args.dataset_text_field,
        data_args.validation_split_percentage,
        data_args.dataset_num_proc,
        data_args.max_train_samples,
        seed=seed,
        dataset_mixture=data_args.dataset_mixture,
        **options,
    )
