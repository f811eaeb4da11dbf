"""Datasets, tokens and streams: what a NoLoCo run trains and evaluates on.

- :mod:`~hf_noloco.data.datasets`: loading (Hub, local files, the built-in corpus), packing, padding, and the
  training and evaluation sets of a run (:func:`prepare_datasets`, :func:`prepare_streams`,
  :func:`datasets_from_args`).
- :mod:`~hf_noloco.data.encoding`: one row to tokens and labels (text, token ids, chat, prompt/completion).
- :mod:`~hf_noloco.data.streaming`: streamed, sharded, resumable blocks.
- :mod:`~hf_noloco.data.corpus`: the built-in corpus and the BPE tokenizer of a from-scratch run.
"""

from hf_noloco.data.corpus import builtin_corpus, train_bpe_tokenizer
from hf_noloco.data.datasets import datasets_from_args, load_splits, prepare_datasets, prepare_streams

__all__ = [
    "builtin_corpus",
    "datasets_from_args",
    "load_splits",
    "prepare_datasets",
    "prepare_streams",
    "train_bpe_tokenizer",
]
