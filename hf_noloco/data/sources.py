"""Where a run's rows come from: the built-in corpus, local files in any format `datasets` reads, a Hub
dataset, or a mixture of them; and which rows train and which evaluate.

`datasets.load_dataset` does the reading. This module decides what to hand it: for local files, the builder
`datasets` itself infers from their names (compressed ones included), one row per paragraph for ``.txt``
files, and the splits `datasets` reads from file names (``train*``, ``test*``, ``validation*``). Everything
is deterministic (the held-out rows come from a seeded shuffle), so every rank of a job gets the same rows.
"""

from __future__ import annotations

import os

import datasets
from datasets import Dataset, DatasetDict
from datasets.data_files import DataFilesDict, DataFilesList, get_data_patterns
from datasets.load import infer_module_for_data_files_list

from hf_noloco.data.arguments import BUILTIN_DATASET, is_local_dataset_path
from hf_noloco.data.corpus import builtin_corpus
from hf_noloco.data.encoding import dataset_format

# Splits that evaluate when none is named, in order of preference.
EVAL_SPLITS = ("validation", "test")


def _check_columns(dataset, dataset_text_field: str, what: str) -> None:
    """Checks that the dataset has a format :mod:`hf_noloco.data.encoding` reads; the error lists its
    columns. Streamed datasets may not know their columns until read (``None``: not checked yet)."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, dict):  # a DatasetDict: {split: columns}
        for split, split_columns in columns.items():
            if split_columns is not None:
                dataset_format(split_columns, dataset_text_field, f"{what} (its {split!r} split)")
    elif columns is not None:
        dataset_format(columns, dataset_text_field, what)


def _local_data_files(path: str, data_files, data_dir: str | None) -> dict[str, list[str]]:
    """``{split: files}`` of a local file or folder: ``data_files`` (globs, relative to the folder) if given,
    else every file of the folder, split by their names as `datasets` splits them."""
    if os.path.isfile(path):
        if data_files is not None or data_dir is not None:
            raise ValueError(f"data_files and data_dir select files in a folder; {path!r} is a file.")
        return {"train": [os.path.abspath(path)]}
    base = os.path.join(path, data_dir) if data_dir else path
    if data_files is None:
        try:
            patterns = get_data_patterns(base)
        except datasets.data_files.EmptyDatasetError:
            raise ValueError(f"The folder {path!r} holds no file to read.") from None
    elif isinstance(data_files, dict):
        patterns = {split: [f] if isinstance(f, str) else list(f) for split, f in data_files.items()}
    else:
        patterns = {"train": [data_files] if isinstance(data_files, str) else list(data_files)}
    try:
        found = DataFilesDict.from_patterns(patterns, base_path=base)
    except FileNotFoundError as exc:
        raise ValueError(f"No file of {path!r} matches {data_files or 'any pattern'}: {exc}") from None
    files = {
        str(split): sorted(f for f in names if not os.path.basename(f).startswith("."))
        for split, names in found.items()
    }
    if data_files is not None and not all(files.values()):
        empty = [split for split, names in files.items() if not names]
        raise ValueError(f"No file of {path!r} matches data_files={data_files!r} (for the split(s) {empty}).")
    if not any(files.values()):
        raise ValueError(f"The folder {path!r} holds no file to read.")
    return files


# The `datasets` builders whose files hold rows of text (its others read images, audio, benchmarks' task
# folders (``.md``), ...).
_ROW_BUILDERS = ("text", "json", "csv", "parquet", "arrow")


def _builder(files: dict[str, list[str]], what: str) -> tuple[str, dict]:
    """The `datasets` builder that reads ``files`` (as `datasets` infers it), and its options (a ``.tsv``
    file's tab separator): one builder for all of them, or a clear error."""
    modules = {}
    for names in files.values():
        for name in names:
            module, options = infer_module_for_data_files_list(DataFilesList([name], [None]))
            if module not in _ROW_BUILDERS:
                raise ValueError(
                    f"{what}: `datasets` reads no file like {os.path.basename(name)!r} as rows of text "
                    "(text, JSON/JSON Lines, CSV/TSV, Parquet, Arrow and their compressed forms are read)."
                )
            modules.setdefault((module, tuple(sorted(options.items()))), name)
    if len(modules) > 1:
        kinds = sorted({os.path.basename(name).split(".", 1)[-1] for name in modules.values()})
        raise ValueError(f"{what} mixes file types ({', '.join(kinds)}): give files of one type.")
    [(module, options)] = modules
    # A .txt file is one row per paragraph (text separated by blank lines), not one per line.
    return module, {"sample_by": "paragraph"} if module == "text" else dict(options)


def _read_local(builder: str, files: dict[str, list[str]], streaming: bool, options: dict, what: str):
    """``datasets.load_dataset`` of local files, with what makes it fail named in one line: empty files, or
    files that are not what their names say (the cause `datasets` wraps, e.g. the JSON error and where)."""
    names = [name for group in files.values() for name in group]
    empty = [name for name in names if os.path.getsize(name) == 0]
    if empty and len(empty) == len(names):
        raise ValueError(f"The dataset {what} is empty: {os.path.basename(empty[0])} holds no rows.")
    quiet = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its builders log the error we report below
    try:
        return datasets.load_dataset(builder, data_files=files, streaming=streaming, **options)
    except Exception as exc:  # noqa: BLE001 - `datasets` raises many types (and StopIteration): all named
        cause = exc
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        line = (str(cause).strip().splitlines() or [""])[0][:300]
        raise ValueError(
            f"{what} cannot be read as {builder} files ({type(cause).__name__}{': ' + line if line else ''})."
        ) from None
    finally:
        datasets.logging.set_verbosity(quiet)


def _clean_paragraphs(batch: dict[str, list], dataset_text_field: str) -> dict[str, list]:
    # The "text" builder keeps the newlines around a paragraph and empty pieces of runs of blank lines.
    texts = [t.strip() for t in batch[dataset_text_field]]
    return {dataset_text_field: [t for t in texts if t]}


def _is_saved_dataset(path: str) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json")
    )


def load_text_dataset(
    dataset_name: str,
    dataset_config: str | None = None,
    dataset_text_field: str = "text",
    split: str | None = "train",
    streaming: bool = False,
    *,
    data_files=None,
    data_dir: str | None = None,
    dataset_revision: str | None = None,
):
    """Loads a dataset by name: the built-in corpus, local files or a saved dataset, or a Hub dataset.

    Args:
        dataset_name: ``BUILTIN_DATASET`` (``"builtin:python-docs"``); a local file or folder of files of one
            type that `datasets` reads (a ``.txt`` file: one row per paragraph, stripped, empty ones dropped);
            a folder written by ``save_to_disk``; or a Hub dataset name.
        dataset_config: the Hub dataset's configuration (e.g. ``"wikitext-2-raw-v1"``).
        dataset_text_field: the text column; checked to exist unless the rows are in another format.
        split: the split to return, or ``None`` for every split (a `DatasetDict`).
        streaming: an iterable dataset instead of a downloaded one.
        data_files, data_dir: which files, as `datasets.load_dataset` takes them.
        dataset_revision: the Hub dataset's branch, tag or commit.

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: files `datasets` cannot read, a missing split, or no text column.
    """
    what = repr(dataset_name)
    if dataset_name == BUILTIN_DATASET:
        corpus = builtin_corpus()
        dataset = (
            datasets.IterableDatasetDict({"train": corpus.to_iterable_dataset()})
            if streaming
            else DatasetDict({"train": corpus})
        )
    elif is_local_dataset_path(dataset_name):
        path = os.path.expanduser(dataset_name)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"No such file or folder: {dataset_name!r} (resolved to {os.path.abspath(path)!r})."
            )
        if _is_saved_dataset(path):
            saved = datasets.load_from_disk(path)
            dataset = saved if isinstance(saved, DatasetDict) else DatasetDict({"train": saved})
            if streaming:
                dataset = datasets.IterableDatasetDict(
                    {name: d.to_iterable_dataset() for name, d in dataset.items()}
                )
        else:
            files = _local_data_files(path, data_files, data_dir)
            builder, options = _builder(files, what)
            dataset = _read_local(builder, files, streaming, options, what)
            if builder == "text":
                if dataset_text_field != "text":  # the text builder names its column "text"
                    dataset = dataset.rename_column("text", dataset_text_field)
                progress = {} if streaming else {"desc": "Paragraphs"}  # iterable datasets take no desc
                dataset = dataset.map(
                    _clean_paragraphs,
                    batched=True,
                    fn_kwargs={"dataset_text_field": dataset_text_field},
                    **progress,
                )
    else:
        dataset = datasets.load_dataset(
            dataset_name,
            dataset_config,
            data_files=data_files,
            data_dir=data_dir,
            revision=dataset_revision,
            streaming=streaming,
        )
    if split is not None:
        if split not in dataset:
            raise ValueError(f"The dataset {what} has no split {split!r}; its splits are {list(dataset)}.")
        dataset = dataset[split]
    _check_columns(dataset, dataset_text_field, what)
    return dataset


def load_mixture(mixture: dict, dataset_text_field: str = "text", seed: int = 42) -> DatasetDict:
    """The rows of a ``dataset_mixture`` (TRL's ``DatasetMixtureConfig``, as
    :func:`hf_noloco.data.arguments.mixture_values` checks it): each dataset's split, its ``columns``
    kept; with fractions, the first ``round(fraction * N)`` rows of each for the largest ``N`` that repeats no
    row (TRL's rule); concatenated in order. ``test_split_size`` holds rows out as ``"test"`` by a shuffle
    seeded with ``seed`` (TRL's own split is unseeded, so the ranks of a job would disagree)."""
    parts = []
    for entry in mixture["datasets"]:
        part = load_text_dataset(
            entry["path"],
            entry.get("name"),
            dataset_text_field,
            split=entry.get("split", "train"),
            data_files=entry.get("data_files"),
            data_dir=entry.get("data_dir"),
        )
        if entry.get("columns") is not None:
            part = part.select_columns(entry["columns"])
        parts.append(part)
    fractions = [entry.get("fraction") for entry in mixture["datasets"]]
    if fractions[0] is not None:
        weights = [float(f) / sum(float(f) for f in fractions) for f in fractions]
        total = min(len(part) / weight for part, weight in zip(parts, weights))
        parts = [part.select(range(round(weight * total))) for part, weight in zip(parts, weights)]
    formats = {dataset_format(part.column_names, dataset_text_field) for part in parts}
    if len(formats) > 1:
        raise ValueError(
            f"dataset_mixture: its datasets have different formats ({', '.join(sorted(formats))}); keep the "
            "same columns in each (`columns`)."
        )
    mixed = datasets.concatenate_datasets(parts)
    test_size = mixture.get("test_split_size")
    if test_size is None:
        return DatasetDict({"train": mixed})
    test_size = int(test_size) if float(test_size) >= 1 else float(test_size)
    return mixed.train_test_split(test_size=test_size, shuffle=True, seed=seed)


def evaluation_split(
    raw, dataset_name: str, dataset_train_split: str, dataset_test_split: str | None
) -> str | None:
    """The name of ``raw``'s split to evaluate on: ``dataset_test_split``, else the first of
    :data:`EVAL_SPLITS` it has (other than the training split), else ``None`` (one is held out). A split
    named but missing is a clear error listing those ``raw`` has."""
    for name, option, use in (
        (dataset_train_split, "dataset_train_split", "train on"),
        (dataset_test_split, "dataset_test_split", "evaluate on"),
    ):
        if name is not None and name not in raw:
            raise ValueError(
                f"The dataset {dataset_name!r} has no split {name!r} to {use}; its splits are {list(raw)} "
                f"({option})."
            )
    if dataset_test_split is not None:
        return dataset_test_split
    return next((name for name in EVAL_SPLITS if name in raw and name != dataset_train_split), None)


def load_splits(
    dataset_name: str,
    dataset_config: str | None = None,
    dataset_text_field: str = "text",
    validation_split_percentage: float = 5,
    seed: int = 42,
    *,
    dataset_train_split: str = "train",
    dataset_test_split: str | None = None,
    data_files=None,
    data_dir: str | None = None,
    dataset_revision: str | None = None,
    dataset_mixture: dict | None = None,
) -> tuple[Dataset, Dataset]:
    """The (train, eval) DOCUMENTS of a dataset (or of ``dataset_mixture``), before tokenization.

    Evaluates on ``dataset_test_split``; when it is ``None``, on the dataset's ``validation`` split, else its
    ``test`` split, else on ``validation_split_percentage`` % of the training documents (at least one),
    chosen by a shuffle seeded with ``seed``: documents, not rows, so no row holds text from both sides.
    """
    if dataset_mixture is not None:
        raw = load_mixture(dataset_mixture, dataset_text_field, seed)
        dataset_name = "dataset_mixture"
    else:
        raw = load_text_dataset(
            dataset_name,
            dataset_config,
            dataset_text_field,
            split=None,
            data_files=data_files,
            data_dir=data_dir,
            dataset_revision=dataset_revision,
        )
    eval_split = evaluation_split(raw, dataset_name, dataset_train_split, dataset_test_split)
    train = raw[dataset_train_split]
    if eval_split is not None:
        return train, raw[eval_split]
    if not 0 < validation_split_percentage < 100:
        raise ValueError(
            f"The dataset {dataset_name!r} has no evaluation split, so one is carved out of "
            f"{dataset_train_split!r}, but validation_split_percentage={validation_split_percentage} is "
            "not in (0, 100)."
        )
    if train.num_rows < 2:
        raise ValueError(
            f"The dataset {dataset_name!r} has {train.num_rows} document(s): too few to carve out an "
            "evaluation split."
        )
    num_eval = min(train.num_rows - 1, max(1, round(train.num_rows * validation_split_percentage / 100)))
    split = train.train_test_split(test_size=num_eval, shuffle=True, seed=seed)
    return split["train"], split["test"]
