"""One dataset row to ``(input_ids, labels)``: raw text, pre-tokenized rows, chat conversations and
prompt/completion pairs.

A dataset's format is read from its columns, as TRL's ``SFTTrainer`` reads it:

- ``messages`` (a list of ``{"role", "content"}``): a conversation, rendered with the tokenizer's chat
  template. With ``assistant_only_loss`` only the assistant turns are trained on (every other label is -100).
- ``prompt`` and ``completion``: strings, or lists of messages (rendered with the chat template). With
  ``completion_only_loss`` (the default for this format) only the completion is trained on.
- ``input_ids`` (and optionally ``labels``): already tokenized, used as they are.
- the ``dataset_text_field`` column: raw text, with a beginning- and an end-of-text token as
  ``add_bos``/``add_eos`` say.

Rows that hold nothing to train on (empty or whitespace-only text, an empty conversation, no token left to
predict after truncation) are dropped: the encoder returns ``None`` for them.

Which tokens a chat turn owns is found by rendering the conversation up to each assistant turn (with the
generation prompt) and up to its end: the characters in between are the turn, and every token overlapping
them is trained on. That needs no ``{% generation %}`` markers in the template (most chat templates, Qwen's
and Llama's among them, have none) and covers the turn's end-of-turn token, so the model learns to stop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

IGNORE_INDEX = -100

FORMATS = ("messages", "prompt_completion", "tokens", "text")


def dataset_format(columns: Sequence[str], dataset_text_field: str = "text", what: str = "") -> str:
    """The format of a dataset with these columns: ``messages``, ``prompt_completion``, ``tokens`` or
    ``text`` (checked in that order), or a clear error naming the columns (and the dataset, ``what``)."""
    columns = list(columns)
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if "input_ids" in columns:
        return "tokens"
    if dataset_text_field in columns:
        return "text"
    name = f" {what}" if what else ""
    raise ValueError(
        f"The dataset{name} has no text column {dataset_text_field!r}; its columns are {columns}. Name the "
        "right one with dataset_text_field, or give a `messages` column (conversations), `prompt` and "
        "`completion` columns, or an `input_ids` column (pre-tokenized)."
    )


def default_packing(fmt: str) -> bool:
    """Text and pre-tokenized documents are packed by default; conversations and prompt/completion pairs are
    padded, one per row, so that attention never crosses two of them."""
    return fmt in ("text", "tokens")


def tokenizer_adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts its beginning-of-text token first when asked for special tokens (Llama's
    does, GPT-2's and Qwen's do not)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return with_special[:1] == [bos] and without[:1] != [bos]


def set_pad_token(tokenizer, pad_token: str | None = None) -> int:
    """Gives the tokenizer its padding token and returns its id: ``pad_token`` if given, else the tokenizer's
    own, else its end-of-text token (the usual choice; padding is masked out of attention and loss, so its
    value never reaches the model). The tokenizer is saved with the export, padding token included."""
    if pad_token is not None:
        if pad_token not in tokenizer.get_vocab():
            raise ValueError(f"pad_token {pad_token!r} is not in the tokenizer's vocabulary.")
        tokenizer.pad_token = pad_token
    elif tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                "The tokenizer has neither a padding token nor an end-of-text token to pad with: set "
                "pad_token."
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer.pad_token_id


def set_eos_token(tokenizer, eos_token: str | None) -> None:
    """Makes ``eos_token`` the tokenizer's end-of-text token (TRL's ``eos_token``); ``None`` keeps its own."""
    if eos_token is None or eos_token == tokenizer.eos_token:
        return
    if eos_token not in tokenizer.get_vocab():
        raise ValueError(f"eos_token {eos_token!r} is not in the tokenizer's vocabulary.")
    tokenizer.eos_token = eos_token


@dataclass
class DocumentEncoder:
    """Encodes one row of a dataset of format ``fmt`` (see :func:`dataset_format`); picklable, so
    ``Dataset.map(num_proc=...)`` can use it. Build it with :func:`make_encoder`, which resolves the
    defaults and checks the options against the format and the tokenizer.

    Attributes:
        tokenizer: a fast tokenizer (chat formats need its character offsets).
        fmt: the dataset format.
        dataset_text_field: the raw-text column (format ``text``).
        add_bos, add_eos: put the tokenizer's beginning- / end-of-text token around each text document (and
            each plain prompt/completion pair). Never applied to pre-tokenized rows or chat templates, which
            carry their own.
        assistant_only_loss, completion_only_loss: train only on assistant turns / completions.
        max_length: truncate each row to this many tokens (padded rows); ``None``: keep whole (packing).
    """

    tokenizer: object
    fmt: str
    dataset_text_field: str = "text"
    add_bos: bool = False
    add_eos: bool = True
    assistant_only_loss: bool = False
    completion_only_loss: bool = False
    max_length: int | None = None

    def __call__(self, row: Mapping) -> tuple[list[int], list[int]] | None:
        encoded = self.encode(row)
        return None if encoded is None else encoded[:2]

    def encode(self, row: Mapping) -> tuple[list[int], list[int], bool] | None:
        """``(input_ids, labels, whether max_length cut the row)``, or ``None`` for a row with nothing to
        train on."""
        if self.fmt == "text":
            encoded = self._text(row[self.dataset_text_field])
        elif self.fmt == "tokens":
            encoded = self._tokens(row)
        elif self.fmt == "messages":
            encoded = self._messages(row["messages"], _tools(row))
        else:
            encoded = self._prompt_completion(row["prompt"], row["completion"], _tools(row))
        if encoded is None:
            return None
        ids, labels = encoded
        truncated = self.max_length is not None and len(ids) > self.max_length
        if truncated:
            ids, labels = ids[: self.max_length], labels[: self.max_length]
        # A row teaches something only if some position has a next token to predict (labels[1:], as the
        # loss shifts them).
        if not any(label != IGNORE_INDEX for label in labels[1:]):
            return None
        return ids, labels, truncated

    # --------------------------------------------------------------------------------------------- formats

    def _wrap(self, ids: list[int]) -> list[int]:
        bos = [self.tokenizer.bos_token_id] if self.add_bos else []
        eos = [self.tokenizer.eos_token_id] if self.add_eos else []
        return bos + ids + eos

    def _text(self, text) -> tuple[list[int], list[int]] | None:
        if not isinstance(text, str) or not text.strip():
            return None
        ids = self._wrap(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids, list(ids)

    def _tokens(self, row: Mapping) -> tuple[list[int], list[int]] | None:
        ids = list(row["input_ids"] or [])
        labels = row.get("labels")
        labels = list(ids) if labels is None else list(labels)
        if len(labels) != len(ids):
            raise ValueError(
                f"A pre-tokenized row has {len(ids)} input_ids but {len(labels)} labels: they must match."
            )
        return (ids, labels) if ids else None

    def _render(self, messages, add_generation_prompt: bool = False, tools=None) -> str:
        _check_chat_template(self.tokenizer)
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja raises its own types for a template's own checks
            raise ValueError(f"The chat template failed on a conversation: {exc}") from exc

    def _labelled(self, text: str, spans: list[tuple[int, int]] | None) -> tuple[list[int], list[int]]:
        """Tokens of ``text``; labels -100 outside ``spans`` (character ranges), or nowhere when ``None``."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        if spans is None:
            return ids, list(ids)
        labels = []
        for token, (start, end) in zip(ids, encoded["offset_mapping"]):
            inside = any(start < span_end and end > span_start for span_start, span_end in spans)
            labels.append(token if inside else IGNORE_INDEX)
        return ids, labels

    def _prefix_length(self, full: str, prefix: str, what: str) -> int:
        if not full.startswith(prefix):
            raise ValueError(
                f"The chat template renders {what} differently inside the whole conversation, so the tokens "
                "of each turn cannot be told apart: train on the whole conversation "
                "(assistant_only_loss=False, completion_only_loss=False), or use a template that renders "
                "turns the same wherever they are."
            )
        return len(prefix)

    def _messages(self, messages, tools=None) -> tuple[list[int], list[int]] | None:
        if not messages:
            return None
        full = self._render(messages, tools=tools)
        spans = None
        if self.assistant_only_loss:
            spans = []
            for i, message in enumerate(messages):
                if message.get("role") != "assistant":
                    continue
                before = self._render(messages[:i], add_generation_prompt=True, tools=tools)
                start = self._prefix_length(full, before, "the turns before a reply")
                end = self._prefix_length(
                    full, self._render(messages[: i + 1], tools=tools), "a conversation's start"
                )
                spans.append((start, end))
        return self._labelled(full, spans)

    def _prompt_completion(self, prompt, completion, tools=None) -> tuple[list[int], list[int]] | None:
        if isinstance(prompt, str) != isinstance(completion, str):
            raise ValueError(
                "prompt and completion must both be strings or both be lists of messages, got "
                f"{type(prompt).__name__} and {type(completion).__name__}."
            )
        if isinstance(prompt, str):
            if not completion.strip():
                return None
            prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            completion_ids = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
            ids = self._wrap(prompt_ids + completion_ids)
            if not self.completion_only_loss:
                return ids, list(ids)
            masked = len(prompt_ids) + (1 if self.add_bos else 0)
            return ids, [IGNORE_INDEX] * masked + ids[masked:]
        if not completion:
            return None
        full = self._render(list(prompt) + list(completion), tools=tools)
        spans = None
        if self.completion_only_loss:
            prompt_text = self._render(prompt, add_generation_prompt=True, tools=tools)
            spans = [(self._prefix_length(full, prompt_text, "the prompt"), len(full))]
        return self._labelled(full, spans)


def _tools(row: Mapping):
    """A chat row's ``tools`` (TRL's column for tool-calling conversations), decoded when stored as JSON."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise ValueError(f"A row's `tools` is a string but not JSON: {exc}") from None
    return tools or None


def _check_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "The dataset holds conversations (messages) but the tokenizer has no chat template: use a chat "
            "model's tokenizer (tokenizer_name_or_path), or set tokenizer.chat_template."
        )


def row_layout(fmt: str, packing: bool | None = None, packing_strategy: str | None = None) -> str:
    """How the rows of a dataset of format ``fmt`` fill a row of ``max_length`` tokens: ``"wrapped"`` (one
    stream cut into rows, attention crossing documents), ``"bfd"`` / ``"bfd_split"`` (best-fit-decreasing bins
    of whole documents, position ids restarting at each), or ``"padded"`` (one document per row). The
    defaults: wrapped for text and pre-tokenized rows, padded for conversations and prompt/completion pairs,
    bfd when those are packed; a ``packing_strategy`` given with ``packing=None`` packs."""
    chat = fmt in ("messages", "prompt_completion")
    if packing is None:
        packing = default_packing(fmt) or packing_strategy is not None
    if not packing:
        return "padded"
    strategy = packing_strategy or ("bfd" if chat else "wrapped")
    if strategy == "wrapped" and chat:
        raise ValueError(
            f"packing_strategy='wrapped' is not supported for {fmt.replace('_', '/')} rows: wrapped rows let "
            "attention cross from one conversation into the next. Use packing_strategy: bfd (rows of whole "
            "conversations that never attend to each other), or no packing."
        )
    return strategy


def make_encoder(
    tokenizer,
    columns: Sequence[str],
    dataset_text_field: str = "text",
    packing: bool | None = None,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    assistant_only_loss: bool = False,
    completion_only_loss: bool | None = None,
    max_length: int | None = None,
    packing_strategy: str | None = None,
) -> tuple[DocumentEncoder, str]:
    """The encoder for a dataset with ``columns``, and its :func:`row_layout`. ``None`` options take their
    defaults: a beginning-of-text token when the tokenizer adds one; an end-of-text token after every
    document; completion-only loss for prompt/completion rows. Options that do not fit the format or the
    tokenizer are clear errors. Rows are cut at ``max_length`` unless the layout uses every token
    (``wrapped``, ``bfd_split``)."""
    fmt = dataset_format(columns, dataset_text_field)
    chat = fmt in ("messages", "prompt_completion")
    layout = row_layout(fmt, packing, packing_strategy)
    if assistant_only_loss and fmt != "messages":
        raise ValueError(
            f"assistant_only_loss needs a `messages` column (conversations); this dataset's format is {fmt}."
        )
    if completion_only_loss and fmt != "prompt_completion":
        raise ValueError(
            f"completion_only_loss needs `prompt` and `completion` columns; this dataset's format is {fmt}."
        )
    completion_only_loss = (
        fmt == "prompt_completion" if completion_only_loss is None else completion_only_loss
    )
    add_bos = tokenizer_adds_bos(tokenizer) if add_bos is None else add_bos
    add_eos = True if add_eos is None else add_eos
    if add_bos and tokenizer.bos_token_id is None:
        raise ValueError("add_bos=True, but the tokenizer has no beginning-of-text (bos) token.")
    if add_eos and tokenizer.eos_token_id is None and fmt in ("text", "prompt_completion"):
        raise ValueError(
            "The tokenizer has no end-of-text (eos) token, which ends every document (and separates packed "
            "documents): set tokenizer.eos_token, or add_eos=False."
        )
    if chat:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "Chat and prompt/completion rows need a fast tokenizer (its character offsets place the "
                "turns)."
            )
        if fmt == "messages":
            _check_chat_template(tokenizer)
    encoder = DocumentEncoder(
        tokenizer=tokenizer,
        fmt=fmt,
        dataset_text_field=dataset_text_field,
        add_bos=add_bos,
        add_eos=add_eos,
        assistant_only_loss=assistant_only_loss,
        completion_only_loss=completion_only_loss,
        max_length=None if layout in ("wrapped", "bfd_split") else max_length,
    )
    return encoder, layout


def pad_row(ids: list[int], labels: list[int], length: int, pad_token_id: int) -> dict[str, list[int]]:
    """One padded row of exactly ``length`` tokens (right padding: attention mask 0, labels -100)."""
    missing = length - len(ids)
    return {
        "input_ids": ids + [pad_token_id] * missing,
        "labels": labels + [IGNORE_INDEX] * missing,
        "attention_mask": [1] * len(ids) + [0] * missing,
    }


def packed_row(
    ids: list[int], labels: list[int], seq_lengths: Sequence[int], length: int, pad_token_id: int
) -> dict[str, list[int]]:
    """One bin of whole sequences (``ids`` and ``labels`` concatenated, ``seq_lengths`` each) as a row of
    exactly ``length`` tokens. Position ids restart at every sequence, so that attention (HF's mask functions
    read sequence boundaries from them) never crosses one; the label of each sequence's first token is
    -100, so no sequence is trained to predict the next one's start. The padding after the last sequence is
    a sequence of its own (labels -100; attention mask 0 marks it, for counting only)."""
    missing = length - len(ids)
    positions = [p for n in seq_lengths for p in range(n)] + list(range(missing))
    labels = [IGNORE_INDEX if p == 0 else label for p, label in zip(positions, labels)]
    return {
        "input_ids": ids + [pad_token_id] * missing,
        "labels": labels + [IGNORE_INDEX] * missing,
        "attention_mask": [1] * len(ids) + [0] * missing,
        "position_ids": positions,
    }


def row_fingerprint(row: Mapping, fmt: str, dataset_text_field: str = "text") -> bytes:
    """The bytes that identify a row's content (which side of a held-out split it falls on)."""
    if fmt == "text":
        value = row[dataset_text_field]
        return value.encode() if isinstance(value, str) else b""
    keys = {
        "messages": ("messages",),
        "prompt_completion": ("prompt", "completion"),
        "tokens": ("input_ids",),
    }
    return json.dumps([row[k] for k in keys[fmt]], sort_keys=True, default=str).encode()
