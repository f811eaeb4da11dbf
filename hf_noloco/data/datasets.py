"""The training and evaluation sets of a run: documents from :mod:`hf_noloco.data.sources`, tokenized and
laid into rows by :mod:`hf_noloco.data.packing` (or, streamed, by :mod:`hf_noloco.data.streaming`), as one
:class:`~hf_noloco.data.arguments.DataArguments` says (or its options, given one by one).

Every function here is deterministic: the same inputs give the same rows in the same order on every rank
and every machine, so each process of a multi-process job can call them (the caller may wrap them in
``main_process_first`` so that rank 0 fills the ``datasets`` cache and the others read it).
"""

from __future__ import annotations

import os

import pyarrow.compute as pc
from datasets import Dataset

from hf_noloco.data.arguments import DataArguments
from hf_noloco.data.encoding import (
    DocumentEncoder,
    dataset_format,
    make_encoder,
    set_eos_token,
    set_pad_token,
)
from hf_noloco.data.packing import encode_dataset, rows_of, truncation_report
from hf_noloco.data.sources import evaluation_split, load_splits, load_text_dataset
from hf_noloco.data.streaming import TokenStream


def _on_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _data_arguments(
    data: DataArguments | str, max_length: int | None, options: dict, **fixed
) -> DataArguments:
    """``data`` itself, or the :class:`DataArguments` of a dataset name and its options given one by one."""
    if isinstance(data, DataArguments):
        if max_length is not None or options:
            raise TypeError(
                "Give the data's options in its DataArguments, or a dataset name and the options."
            )
        return data
    given = {"max_length": max_length} if max_length is not None else {}
    return DataArguments(dataset_name=data, **given, **options, **fixed)


def _encoder(data: DataArguments, tokenizer, columns, packing: bool | None = None):
    return make_encoder(
        tokenizer,
        columns,
        data.dataset_text_field,
        packing=data.packing if packing is None else packing,
        add_bos=data.add_bos,
        add_eos=data.add_eos,
        assistant_only_loss=data.assistant_only_loss,
        completion_only_loss=data.completion_only_loss,
        max_length=data.max_length,
        packing_strategy=data.packing_strategy,
    )


def documents(data: DataArguments, seed: int = 42) -> tuple[Dataset, Dataset]:
    """The training and evaluation documents ``data`` names, before tokenization
    (:func:`~hf_noloco.data.sources.load_splits`)."""
    return load_splits(
        data.dataset_name,
        data.dataset_config,
        data.dataset_text_field,
        validation_split_percentage=data.validation_split_percentage,
        seed=seed,
        dataset_train_split=data.dataset_train_split,
        dataset_test_split=data.dataset_test_split,
        data_files=data.data_files,
        data_dir=data.data_dir,
        dataset_revision=data.dataset_revision,
        dataset_mixture=data.dataset_mixture,
    )


def prepare_datasets(
    data: DataArguments | str,
    tokenizer,
    max_length: int | None = None,
    *,
    seed: int = 42,
    evaluation: bool = True,
    **options,
) -> tuple[Dataset, Dataset | None]:
    """``(train, eval)`` datasets of ``max_length``-token rows, as the :class:`DataArguments` ``data`` says
    (or a dataset name, ``max_length`` and the other options of :class:`DataArguments` by name); ``eval`` is
    ``None`` with ``evaluation=False``.

    The documents come from :func:`~hf_noloco.data.sources.load_splits` (the evaluation split, or a seeded
    carve-out of ``validation_split_percentage`` % of the training documents). Each side is tokenized and laid
    into rows as :func:`~hf_noloco.data.encoding.row_layout` says: wrapped (text and pre-tokenized rows, by
    default), best-fit-decreasing bins (``packing_strategy="bfd"``, the default when conversations or
    prompt/completion pairs are packed) or padded one per row (conversations and prompt/completion pairs, or
    ``packing=False``). Rows cut at ``max_length`` are counted and reported. ``max_train_samples`` /
    ``max_eval_samples`` keep the first that many train / eval rows. The tokenizer gets a padding token if it
    has none (:func:`~hf_noloco.data.encoding.set_pad_token`).
    """
    data = _data_arguments(data, max_length, options)
    train_docs, eval_docs = documents(data, seed)
    if data.skip_prepare_dataset:
        train = prepared_rows(train_docs, "training")
        evaluated = prepared_rows(eval_docs, "evaluation") if evaluation else None
        return _first(train, data.max_train_samples), _first(evaluated, data.max_eval_samples)
    train_encoder, _ = _encoder(data, tokenizer, train_docs.column_names)
    _check_same_format(eval_docs.column_names, train_encoder, data.dataset_name)
    train = _first(rows_from_documents(train_docs, tokenizer, data, "Training rows"), data.max_train_samples)
    if not evaluation:
        return train, None
    try:
        eval_ = rows_from_documents(eval_docs, tokenizer, data, "Evaluation rows", evaluation=True)
    except ValueError as e:
        raise ValueError(
            f"The evaluation documents are too few for one row ({e}) Raise validation_split_percentage or "
            "lower max_length."
        ) from e
    return train, _first(eval_, data.max_eval_samples)


def rows_from_documents(
    docs: Dataset, tokenizer, data: DataArguments, what: str = "Training rows", evaluation: bool = False
) -> Dataset:
    """Documents (text, conversations, prompt/completion pairs or token ids, as their columns say) laid into
    the pipeline's rows as ``data`` says (the evaluation rows as ``eval_packing`` says). The tokenizer gets
    ``eos_token`` and a padding token (:func:`~hf_noloco.data.encoding.set_pad_token`)."""
    set_eos_token(tokenizer, data.eos_token)
    pad_token_id = set_pad_token(tokenizer, data.pad_token)
    packing = data.eval_packing if evaluation else None
    encoder, layout = _encoder(data, tokenizer, docs.column_names, packing)
    encoded = encode_dataset(docs, encoder, data.dataset_num_proc)
    if encoder.max_length is not None and _on_rank_zero():
        truncation_report(encoded, data.max_length, what)
    multiple = data.pad_to_multiple_of
    return rows_of(
        encoded, layout, data.max_length, pad_token_id, data.dataset_num_proc, pad_to_multiple_of=multiple
    )


def is_pipeline_rows(dataset) -> bool:
    """Whether ``dataset`` holds rows the pipeline takes as they are: ``input_ids`` all of one length."""
    columns = getattr(dataset, "column_names", None) or []
    if not isinstance(dataset, Dataset) or "input_ids" not in columns or len(dataset) == 0:
        return False
    lengths = pc.list_value_length(dataset.data.column("input_ids")).to_numpy(zero_copy_only=False)
    return bool((lengths == lengths[0]).all())


def _first(rows: Dataset | None, n: int | None) -> Dataset | None:
    return rows.select(range(min(n, rows.num_rows))) if rows is not None and n is not None else rows


PREPARED_COLUMNS = ("input_ids", "labels", "attention_mask", "position_ids")


def prepared_rows(rows: Dataset, what: str) -> Dataset:
    """Rows the pipeline takes as they are (``dataset_kwargs: {skip_prepare_dataset: true}``): their
    ``input_ids`` (and ``labels``, ``attention_mask``, ``position_ids`` if present), all of one length."""
    if "input_ids" not in rows.column_names:
        raise ValueError(
            f"skip_prepare_dataset: the {what} rows have no input_ids column (their columns are "
            f"{rows.column_names}); prepared rows are token ids."
        )
    rows = rows.select_columns([c for c in PREPARED_COLUMNS if c in rows.column_names])
    lengths = set(pc.list_value_length(rows.data.column("input_ids")).to_numpy(zero_copy_only=False).tolist())
    if len(lengths) > 1:
        raise ValueError(
            f"skip_prepare_dataset: the {what} rows have {len(lengths)} lengths ({sorted(lengths)[:5]}...); "
            "every batch of a pipeline has one shape, so prepared rows must all have one length."
        )
    return rows


def _check_same_format(columns, encoder: DocumentEncoder, dataset_name: str) -> None:
    if columns is not None and dataset_format(columns, encoder.dataset_text_field) != encoder.fmt:
        raise ValueError(
            f"The dataset {dataset_name!r}'s evaluation split has columns {list(columns)}, of another format "
            f"than its training split ({encoder.fmt})."
        )


def prepare_streams(
    data: DataArguments | str,
    tokenizer,
    max_length: int | None = None,
    *,
    seed: int = 42,
    evaluation: bool = True,
    **options,
) -> tuple[TokenStream, TokenStream | None]:
    """``(train, eval)`` as :class:`~hf_noloco.data.streaming.TokenStream`, as ``data`` says (a
    :class:`DataArguments` with ``dataset_streaming``, or a dataset name and options as in
    :func:`prepare_datasets`): nothing is downloaded or tokenized ahead, each replica reads its own share when
    training starts (``eval`` is ``None`` with ``evaluation=False``).

    Evaluation reads the evaluation split (as :func:`~hf_noloco.data.sources.load_splits` picks it);
    without one, the rows of the training split that a hash of their content holds out
    (``validation_split_percentage`` % of them; the training stream skips those), which then needs
    ``max_eval_samples`` (held-out rows are spread over the whole stream) unless ``evaluation=False``.
    ``max_train_samples`` ends an epoch after that many training rows;
    ``max_eval_samples`` caps every evaluation. ``shuffle_dataset`` reads the training stream in a seeded,
    resumable order (see :class:`~hf_noloco.data.streaming.TokenStream`). Rows are wrapped or padded
    (best-fit-decreasing bins need the whole dataset).
    """
    data = _data_arguments(data, max_length, options, dataset_streaming=True)
    raw = load_text_dataset(
        data.dataset_name,
        data.dataset_config,
        data.dataset_text_field,
        split=None,
        streaming=True,
        data_files=data.data_files,
        data_dir=data.data_dir,
        dataset_revision=data.dataset_revision,
    )
    name, train_split = data.dataset_name, data.dataset_train_split
    eval_split = evaluation_split(raw, name, train_split, data.dataset_test_split)
    train_source = raw[train_split]
    columns = train_source.column_names
    if columns is None:  # some streamed datasets learn their columns from the first row
        columns = list(next(iter(train_source)).keys())
    set_eos_token(tokenizer, data.eos_token)
    encoder, layout = _encoder(data, tokenizer, columns)
    if layout not in ("wrapped", "padded"):
        raise ValueError(
            f"packing_strategy={layout!r} needs the whole dataset to make its bins: a stream is wrapped or "
            "padded (packing: false)."
        )
    pad_token_id = set_pad_token(tokenizer, data.pad_token)
    holdout = None
    if eval_split is None:
        percentage = data.validation_split_percentage
        if not 0 < percentage < 100:
            raise ValueError(
                f"The dataset {name!r} has no evaluation split, so one is held out of {train_split!r}, but "
                f"validation_split_percentage={percentage} is not in (0, 100)."
            )
        if evaluation and data.max_eval_samples is None:
            raise ValueError(
                "Streaming a dataset without an evaluation split needs max_eval_samples when the run "
                "evaluates: the held-out rows are spread over the whole stream, which evaluation would "
                "otherwise read to the end."
            )
        holdout = percentage
    else:
        _check_same_format(raw[eval_split].column_names, encoder, name)
    common = dict(
        encoder=encoder, max_length=data.max_length, packing=layout == "wrapped", pad_token_id=pad_token_id
    )
    train = TokenStream(
        train_source,
        max_rows=data.max_train_samples,
        repeat=True,
        holdout=None if holdout is None else (holdout, False),
        split=train_split,
        shuffle_seed=seed if data.shuffle_dataset else None,
        shuffle_buffer_size=data.shuffle_buffer_size,
        **common,
    )
    if not evaluation:
        return train, None
    evaluation_stream = TokenStream(
        train_source if holdout is not None else raw[eval_split],
        max_rows=data.max_eval_samples,
        repeat=False,
        holdout=None if holdout is None else (holdout, True),
        split=train_split if holdout is not None else eval_split,
        **common,
    )
    return train, evaluation_stream


def datasets_from_args(data: DataArguments, tokenizer, seed: int = 42, evaluation: bool = True):
    """``(train, eval)`` as a :class:`~hf_noloco.DataArguments` says: rows of a dataset, or streams with
    ``dataset_streaming``. ``evaluation=False`` (a run that never evaluates) builds no evaluation set and
    asks for no evaluation option."""
    prepare = prepare_streams if data.dataset_streaming else prepare_datasets
    return prepare(data, tokenizer, seed=seed, evaluation=evaluation)
