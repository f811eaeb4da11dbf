"""Rows to tokens and labels: chat masks against the chat template, prompt/completion pairs, bos/eos, padding,
empty rows, pre-tokenized rows; and the same through `prepare_datasets` on local files."""

import json

import datasets
import pytest
from datasets import Dataset

from hf_noloco.data import datasets as data
from hf_noloco.data.encoding import (
    IGNORE_INDEX,
    dataset_format,
    make_encoder,
    set_pad_token,
    tokenizer_adds_bos,
)
from hf_noloco.data.packing import encode_dataset, pack_wrapped, pad_dataset, rows_of
from hf_noloco.data.sources import load_text_dataset
from tests.helpers.chat_fixtures import CHATML, LLAMA3, chat_tokenizer, conversations, write_chat_jsonl

datasets.disable_progress_bars()


@pytest.fixture(autouse=True)
def _isolated_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


@pytest.fixture(scope="module")
def chatml():
    return chat_tokenizer(CHATML)


def wrap(dataset, tokenizer, max_length):
    """The rows of ``packing_strategy: wrapped`` (the default for text and pre-tokenized rows)."""
    encoder, layout = make_encoder(tokenizer, dataset.column_names, packing=True)
    assert layout == "wrapped"
    return pack_wrapped(encode_dataset(dataset, encoder), max_length)


def test_formats_are_read_from_the_columns():
    assert dataset_format(["messages", "text"]) == "messages"
    assert dataset_format(["prompt", "completion", "id"]) == "prompt_completion"
    assert dataset_format(["input_ids", "labels"]) == "tokens"
    assert dataset_format(["body"], dataset_text_field="body") == "text"
    with pytest.raises(ValueError, match=r"no text column 'text'; its columns are \['prompt'\]"):
        dataset_format(["prompt"])


def test_assistant_mask_matches_the_chat_templates_own_token_by_token(chatml):
    """The reference is transformers' own assistant mask, from the template's {% generation %} markers (which
    the encoder does not use): the same ids, and labels exactly on the assistant tokens."""
    encoder, layout = make_encoder(chatml, ["messages"], assistant_only_loss=True, max_length=4096)
    assert layout == "padded"  # conversations are padded unless packing is asked for
    checked = 0
    for messages in conversations(30):
        reference = chatml.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, labels = encoder({"messages": messages})
        assert ids == reference["input_ids"]
        assert [label != IGNORE_INDEX for label in labels] == [bool(m) for m in reference["assistant_masks"]]
        assert all(label in (IGNORE_INDEX, token) for label, token in zip(labels, ids))
        checked += sum(reference["assistant_masks"])
    assert checked > 300
    # Without assistant_only_loss the whole conversation is trained on.
    everything, _ = make_encoder(chatml, ["messages"], max_length=4096)
    ids, labels = everything({"messages": conversations(1)[0]})
    assert labels == ids


def test_assistant_mask_without_generation_markers_covers_replies_and_their_end_of_turn():
    tokenizer = chat_tokenizer(LLAMA3)  # Llama-3's layout has no generation markers
    encoder, _ = make_encoder(tokenizer, ["messages"], assistant_only_loss=True, max_length=4096)
    for messages in conversations(12):
        ids, labels = encoder({"messages": messages})
        trained = tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])
        replies = "".join(m["content"] + "<|eot_id|>" for m in messages if m["role"] == "assistant")
        assert trained == replies
        assert ids[0] == tokenizer.bos_token_id and labels[0] == IGNORE_INDEX  # the template's own bos


def test_prompt_completion_trains_on_the_completion_only(chatml):
    encoder, layout = make_encoder(chatml, ["prompt", "completion"], max_length=4096)
    assert layout == "padded" and encoder.completion_only_loss  # TRL's default for this format
    ids, labels = encoder({"prompt": "The quick brown", "completion": " fox jumps."})
    prompt = chatml("The quick brown", add_special_tokens=False)["input_ids"]
    completion = chatml(" fox jumps.", add_special_tokens=False)["input_ids"]
    assert ids == prompt + completion + [chatml.eos_token_id]
    assert labels == [IGNORE_INDEX] * len(prompt) + completion + [chatml.eos_token_id]
    # Conversational prompt/completion: the completion is the assistant's reply, rendered by the template.
    messages = conversations(3)[1]
    ids, labels = encoder({"prompt": messages[:-1], "completion": messages[-1:]})
    assert ids == chatml.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert chatml.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX]) == (
        messages[-1]["content"] + "<|im_end|>\n"
    )
    whole, _ = make_encoder(chatml, ["prompt", "completion"], completion_only_loss=False, max_length=64)
    assert whole({"prompt": "a", "completion": " b"})[1] == whole({"prompt": "a", "completion": " b"})[0]


def test_bos_and_eos_follow_the_tokenizer_unless_told(chatml):
    text = {"text": "seven wizards"}
    body = chatml("seven wizards", add_special_tokens=False)["input_ids"]
    assert not tokenizer_adds_bos(chatml)  # like GPT-2's and Qwen's
    encoder, layout = make_encoder(chatml, ["text"])
    assert layout == "wrapped" and encoder({"text": "seven wizards"})[0] == body + [chatml.eos_token_id]
    encoder, _ = make_encoder(chatml, ["text"], add_bos=True, add_eos=False)
    assert encoder(text)[0] == [chatml.bos_token_id] + body
    # A tokenizer that adds its bos itself (as Llama's) gets one by default.
    from tokenizers import processors

    llama_like = chat_tokenizer(CHATML)
    llama_like.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", llama_like.bos_token_id)]
    )
    assert tokenizer_adds_bos(llama_like)
    encoder, _ = make_encoder(llama_like, ["text"])
    assert encoder(text)[0] == [llama_like.bos_token_id] + body + [llama_like.eos_token_id]


def test_empty_and_whitespace_rows_are_dropped(chatml):
    encoder, _ = make_encoder(chatml, ["text"])
    assert (
        encoder({"text": ""}) is None
        and encoder({"text": " \n\t "}) is None
        and encoder({"text": None}) is None
    )
    chat, _ = make_encoder(chatml, ["messages"], assistant_only_loss=True, max_length=16)
    assert chat({"messages": []}) is None
    # Truncated before the first reply: nothing left to train on.
    assert chat({"messages": conversations(4)[3]}) is None
    packed = wrap(Dataset.from_dict({"text": ["", "a b", "   ", "c"]}), chatml, 1)
    stream = [t for row in packed["input_ids"] for t in row]
    assert stream.count(chatml.eos_token_id) == 2  # one per non-empty document


def test_pre_tokenized_rows_are_used_as_they_are(chatml):
    rows = {"input_ids": [[5, 6, 7], [8, 9], []], "labels": [[5, -100, 7], [8, 9], []]}
    packed = wrap(Dataset.from_dict(rows), chatml, 2)
    assert packed["input_ids"][:] == [[5, 6], [7, 8]]  # no bos, no eos, nothing re-tokenized
    assert packed["labels"][:] == [[5, -100], [7, 8]]


def test_a_tokenizer_without_pad_token_pads_with_eos(chatml):
    tokenizer = chat_tokenizer(CHATML)
    tokenizer.pad_token = None
    assert set_pad_token(tokenizer) == tokenizer.eos_token_id and tokenizer.pad_token == tokenizer.eos_token
    assert set_pad_token(tokenizer, "<|im_end|>") == tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        set_pad_token(tokenizer, "<nope>")


def test_options_that_do_not_fit_the_data_are_refused(chatml):
    with pytest.raises(ValueError, match="packing_strategy='wrapped' is not supported for messages rows"):
        make_encoder(chatml, ["messages"], packing=True, packing_strategy="wrapped")
    with pytest.raises(ValueError, match="not supported for prompt/completion rows"):
        make_encoder(chatml, ["prompt", "completion"], packing=True, packing_strategy="wrapped")
    # Packed conversations: best-fit-decreasing bins by default; a strategy given alone packs too.
    assert make_encoder(chatml, ["messages"], packing=True)[1] == "bfd"
    assert make_encoder(chatml, ["messages"], packing_strategy="bfd_split")[1] == "bfd_split"
    assert make_encoder(chatml, ["prompt", "completion"], packing_strategy="bfd")[1] == "bfd"
    assert make_encoder(chatml, ["text"], packing_strategy="bfd")[1] == "bfd"
    with pytest.raises(ValueError, match="assistant_only_loss needs a `messages` column"):
        make_encoder(chatml, ["text"], assistant_only_loss=True)
    with pytest.raises(ValueError, match="completion_only_loss needs `prompt` and `completion`"):
        make_encoder(chatml, ["messages"], completion_only_loss=True)
    no_template = chat_tokenizer(CHATML)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        make_encoder(no_template, ["messages"])


def test_chat_jsonl_is_padded_and_masked_token_by_token(tmp_path, chatml):
    """The dataset a chat fine-tune trains on: every row exactly max_length long, attention on the real tokens
    only, and labels on the assistant tokens only, as the template's own mask says."""
    convs = write_chat_jsonl(tmp_path / "chat.jsonl", 40)
    (tmp_path / "eval.jsonl").write_text("")
    train, evaluation = data.prepare_datasets(
        str(tmp_path / "chat.jsonl"), chatml, 96, validation_split_percentage=10, assistant_only_loss=True
    )
    assert train.column_names == ["input_ids", "labels", "attention_mask"]
    by_ids = {}
    for messages in convs:
        reference = chatml.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        by_ids[tuple(reference["input_ids"][:96])] = reference["assistant_masks"][:96]
    rows = list(train) + list(evaluation)
    assert len(rows) >= 35  # rows truncated before any reply are dropped, the others kept
    for row in rows:
        length = sum(row["attention_mask"])
        assert len(row["input_ids"]) == len(row["labels"]) == 96
        assert row["attention_mask"] == [1] * length + [0] * (96 - length)
        assert row["input_ids"][length:] == [chatml.pad_token_id] * (96 - length)
        mask = by_ids[tuple(row["input_ids"][:length])]
        assert [label != IGNORE_INDEX for label in row["labels"]] == [bool(m) for m in mask] + [False] * (
            96 - length
        )


def test_text_rows_can_be_padded_one_per_row(tmp_path, chatml):
    path = tmp_path / "docs.jsonl"
    docs = ["first document here", "", "second one", "third and last document"]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    encoder, layout = make_encoder(chatml, ["text"], packing=False, max_length=8)
    assert layout == "padded"
    train = pad_dataset(encode_dataset(load_text_dataset(str(path)), encoder), 8, chatml.pad_token_id)
    assert train.num_rows == 3
    for row, doc in zip(train, [d for d in docs if d]):
        ids = chatml(doc, add_special_tokens=False)["input_ids"] + [chatml.eos_token_id]
        assert row["input_ids"][: sum(row["attention_mask"])] == ids[:8]


def test_max_eval_samples_caps_evaluation(tmp_path, chatml):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document number {i} " * 5}) + "\n" for i in range(200)))
    _, full = data.prepare_datasets(str(path), chatml, 8, validation_split_percentage=20)
    _, capped = data.prepare_datasets(
        str(path), chatml, 8, validation_split_percentage=20, max_eval_samples=7
    )
    assert full.num_rows > 7 and capped["input_ids"][:] == full["input_ids"][:7]


def test_packed_conversations_are_whole_and_never_attend_to_each_other(chatml):
    """``packing: true`` on conversations: best-fit-decreasing bins of whole conversations. Each is a segment
    whose position ids restart at 0 (so attention never crosses it), with the labels it has alone (its first
    one -100: it predicts nothing of the one before); every conversation once; padding only after the last."""
    convs = conversations(40)
    max_length = 128
    encoder, layout = make_encoder(
        chatml, ["messages"], packing=True, assistant_only_loss=True, max_length=max_length
    )
    assert layout == "bfd"  # the default strategy for packed conversations
    rows = rows_of(encode_dataset(Dataset.from_dict({"messages": convs}), encoder), layout, max_length, 0)
    expected = []
    for messages in convs:
        reference = chatml.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = reference["input_ids"][:max_length], reference["assistant_masks"][:max_length]
        labels = [IGNORE_INDEX] + [token if m else IGNORE_INDEX for token, m in zip(ids[1:], mask[1:])]
        if any(label != IGNORE_INDEX for label in labels):
            expected.append((tuple(ids), tuple(labels)))
    found = []
    for row in rows:
        length = sum(row["attention_mask"])
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"]) == max_length
        assert row["attention_mask"] == [1] * length + [0] * (max_length - length)
        assert row["input_ids"][length:] == [0] * (max_length - length)
        assert row["labels"][length:] == [IGNORE_INDEX] * (max_length - length)
        assert row["position_ids"][length:] == list(range(max_length - length))
        starts = [i for i, p in enumerate(row["position_ids"][:length]) if p == 0] + [length]
        for start, end in zip(starts, starts[1:]):
            assert row["position_ids"][start:end] == list(range(end - start))
            found.append((tuple(row["input_ids"][start:end]), tuple(row["labels"][start:end])))
    assert sorted(found) == sorted(expected) and len(expected) > 30
    assert len(rows) < len(expected)  # packed: several conversations share a row
