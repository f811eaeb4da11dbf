"""The built-in corpus (CPython's own English documentation, no network needed) and the byte-level BPE
tokenizer a from-scratch run trains on its documents.

The built-in corpus, ``BUILTIN_DATASET``, is the English documentation that ships with every CPython: the
``pydoc`` topics (``pydoc_data.topics``), the docstrings of the standard library (read with ``ast``, so no
module is imported and nothing runs) and those of ``builtins``. It needs no network, which makes it the
default for a first run and for tests.
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator

import datasets
from datasets import Dataset

# Special tokens of the tokenizer trained by `train_bpe_tokenizer`.
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"

# Standard-library folders that Linux distributions ship as separate packages (python3-tk, idle, the test
# suite, ...) or that hold no prose (codec tables, vendored wheels). Skipping them keeps the built-in corpus
# the same on every installation of one Python version.
_SKIPPED_STDLIB_DIRS = frozenset(
    {
        "__pycache__",
        "__phello__",
        "dist-packages",
        "distutils",
        "encodings",
        "ensurepip",
        "idle_test",
        "idlelib",
        "lib-dynload",
        "lib2to3",
        "pydoc_data",  # read through its module, see `_topic_documents`
        "site-packages",
        "test",
        "tests",
        "tkinter",
        "turtledemo",
        "venv",
    }
)


# ----------------------------------------------------------------------------------------------------------
# The built-in corpus


def _topic_documents() -> list[str]:
    """One document per pydoc topic (the language reference sections `help("FOR")` shows), sorted by name."""
    from pydoc_data.topics import topics

    return [f"{name}\n\n{text.strip()}" for name, text in sorted(topics.items()) if text.strip()]


def _stdlib_module_files() -> list[tuple[str, str]]:
    """``(module name, path)`` of the pure-Python standard library, sorted by module name."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into skipped folders.
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_STDLIB_DIRS and not d.startswith("config-")]
        for filename in filenames:
            if not filename.endswith(".py") or filename.startswith("_sysconfigdata"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, filename), root)[: -len(".py")]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append((".".join(parts), os.path.join(dirpath, filename)))
    return sorted(found)


def _collect_docstrings(body: list[ast.stmt], prefix: str, out: list[str]) -> None:
    """Appends ``"name\\n\\ndocstring"`` for every class/function defined in ``body``, depth first.

    Only statements whose bodies define API (classes, functions, and the ``if``/``try`` blocks that
    choose an implementation) are visited: a full ``ast.walk`` costs twice as much for no extra prose.
    """
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}.{node.name}"
            doc = ast.get_docstring(node)
            if doc:
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                out.append(f"{kind} {name}\n\n{doc}")
            _collect_docstrings(node.body, name, out)
        elif isinstance(node, ast.If):
            _collect_docstrings(node.body, prefix, out)
            _collect_docstrings(node.orelse, prefix, out)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                _collect_docstrings(block, prefix, out)


def _module_documents() -> list[str]:
    """One document per standard-library module: its docstring and those of its classes and functions.

    The sources are parsed with `ast` rather than imported: importing every module would run code
    (``antigravity`` opens a browser) and depend on which C extensions the build has.
    """
    docs = []
    for module, path in _stdlib_module_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            source = f.read()
        try:
            tree = ast.parse(source)
        except SyntaxError:  # e.g. a file patched by a distribution; never fatal for a corpus
            continue
        parts = []
        module_doc = ast.get_docstring(tree)
        if module_doc:
            parts.append(module_doc)
        _collect_docstrings(tree.body, module, parts)
        if parts:
            docs.append(f"Help on module {module}:\n\n" + "\n\n".join(parts))
    return docs


def _builtins_document() -> str:
    """The docstrings of the built-in functions and types (``len``, ``str.split``, ...), one document."""
    import builtins

    # Slot wrappers (``__init__``, ``__lt__``...) repeat object's boilerplate docstrings on every type.
    boilerplate = {getattr(getattr(object, n, None), "__doc__", None) for n in dir(object)}
    parts = []
    for name in sorted(vars(builtins)):
        obj = getattr(builtins, name)
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)) or not obj.__doc__:
            continue
        parts.append(f"{name}\n\n{inspect.cleandoc(obj.__doc__)}")
        if inspect.isclass(obj):
            for attr, value in sorted(vars(obj).items()):
                doc = getattr(value, "__doc__", None)
                if attr.startswith("_") or not isinstance(doc, str) or doc in boilerplate:
                    continue
                parts.append(f"{name}.{attr}\n\n{inspect.cleandoc(doc)}")
    return "Help on module builtins:\n\n" + "\n\n".join(parts)


def _generate_builtin_corpus(python_version: str) -> Iterator[dict[str, str]]:
    # `python_version` is unused here but is part of `from_generator`'s cache key: each interpreter
    # version has its own documentation and so its own cached corpus.
    del python_version
    for text in (*_topic_documents(), _builtins_document(), *_module_documents()):
        yield {"text": text}


def builtin_corpus(cache_dir: str | None = None) -> Dataset:
    """The built-in corpus: CPython's own English documentation, as a `Dataset` with a ``text`` column.

    One row per document, in a fixed order: the pydoc topics (sorted by name), the ``builtins`` docstrings,
    then one document per standard-library module (sorted by module name). About 2 MB of text and ~500
    documents on CPython 3.11. Identical for one Python version on every machine, except where a
    distribution patched the standard library's docstrings.

    The corpus is written once into the ``datasets`` cache (``cache_dir``, default ``HF_DATASETS_CACHE``)
    and memory-mapped from there, so later tokenization is cached like any other dataset's.
    """
    version = ".".join(map(str, sys.version_info[:3]))
    return Dataset.from_generator(
        _generate_builtin_corpus,
        gen_kwargs={"python_version": version},
        features=datasets.Features({"text": datasets.Value("string")}),
        cache_dir=cache_dir,
    )


# ----------------------------------------------------------------------------------------------------------
# The tokenizer of a from-scratch run


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096, output_dir: str | None = None):
    """Trains a byte-level BPE tokenizer (GPT-2 style) on ``texts`` with the `tokenizers` library.

    For pretraining from scratch when no tokenizer is given. Byte-level means every string encodes
    (no unknown token) and ``decode(encode(text)) == text``. Special tokens: ``<s>`` (bos, id 0),
    ``</s>`` (eos, id 1), ``<pad>`` (pad, id 2). Nothing is added automatically on encode: packing appends
    the eos itself. Deterministic for the same texts and ``vocab_size``.

    Args:
        texts: training documents (a list, a generator, or a `Dataset` column).
        vocab_size: final vocabulary size including the 256 byte tokens and the 3 special tokens.
        output_dir: if given, the tokenizer is saved there with ``save_pretrained`` (so that
            ``AutoTokenizer.from_pretrained(output_dir)`` loads it, e.g. next to the model).

    Returns:
        A `transformers.PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special_tokens = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size={vocab_size} is too small for byte-level BPE (needs >= 259).")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        # All 256 bytes up front, so that text unseen in training (any language, emoji) still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((t for t in texts if t), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Cleanup would rewrite " ." as "." on decode and break the round trip.
        clean_up_tokenization_spaces=False,
    )
    if output_dir is not None:
        fast.save_pretrained(output_dir)
    return fast
