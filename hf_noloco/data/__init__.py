"""Datasets, tokens and streams: what a NoLoCo run trains and evaluates on.

- :mod:`~hf_noloco.data.sources`: documents from the Hub, local files (any format ``datasets`` loads), saved
  datasets, mixtures and the built-in corpus, split into training and evaluation documents.
- :mod:`~hf_noloco.data.encoding`: one row to tokens and labels (text, token ids, chat, prompt/completion).
- :mod:`~hf_noloco.data.packing`: encoded documents to rows: wrapped, best-fit-decreasing bins, or padded.
- :mod:`~hf_noloco.data.datasets`: the training and evaluation sets of a run (:func:`prepare_datasets`,
  :func:`prepare_streams`, :func:`datasets_from_args`).
- :mod:`~hf_noloco.data.streaming`: streamed, sharded, shuffled, resumable rows.
- :mod:`~hf_noloco.data.corpus`: the built-in corpus and the BPE tokenizer of a from-scratch run.
"""

from hf_noloco.data.corpus import builtin_corpus, train_bpe_tokenizer
from hf_noloco.data.datasets import datasets_from_args, prepare_datasets, prepare_streams
from hf_noloco.data.sources import load_splits

__all__ = [
    "builtin_corpus",
    "datasets_from_args",
    "load_splits",
    "prepare_datasets",
    "prepare_streams",
    "train_bpe_tokenizer",
]
