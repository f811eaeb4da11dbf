"""TRL's SFTConfig data options and command-line forms, with TRL's meanings: eos_token, pad_to_multiple_of,
eval_packing, dataset_kwargs (skip_prepare_dataset), truncation_mode; bare boolean flags and a former option
name given on the command line over the recipe."""

import json

import pytest
from datasets import Dataset

from hf_noloco import data
from hf_noloco.data.arguments import DataArguments
from hf_noloco.launch.cli import NoLoCoArgumentParser
from tests.helpers.chat_fixtures import chat_tokenizer, write_chat_jsonl


@pytest.fixture(autouse=True)
def _quiet_datasets(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def chatml():
    return chat_tokenizer()


def test_eos_token_becomes_the_tokenizers_end_of_text_token(tmp_path, chatml):
    path = tmp_path / "chat.jsonl"
    write_chat_jsonl(path, 20)
    tokenizer = chat_tokenizer()
    data.prepare_datasets(str(path), tokenizer, 64, eos_token="<|im_end|>", validation_split_percentage=20)
    assert tokenizer.eos_token == "<|im_end|>"
    with pytest.raises(ValueError, match="eos_token '<nope>' is not in the tokenizer's vocabulary"):
        data.prepare_datasets(str(path), chat_tokenizer(), 64, eos_token="<nope>")


def test_pad_to_multiple_of_pads_rows_with_padding_and_refuses_wrapped_rows_it_would_cut(tmp_path, chatml):
    path = tmp_path / "chat.jsonl"
    write_chat_jsonl(path, 30)
    plain, _ = data.prepare_datasets(str(path), chatml, 60, validation_split_percentage=20, packing=False)
    padded, _ = data.prepare_datasets(
        str(path), chatml, 60, validation_split_percentage=20, packing=False, pad_to_multiple_of=16
    )
    assert len(plain[0]["input_ids"]) == 60 and len(padded[0]["input_ids"]) == 64
    for short, long in zip(plain, padded):  # the same content, then padding that nothing attends to
        assert long["input_ids"][:60] == short["input_ids"] and long["labels"][60:] == [-100] * 4
        assert long["attention_mask"][60:] == [0] * 4
    bins, _ = data.prepare_datasets(
        str(path), chatml, 60, validation_split_percentage=20, packing_strategy="bfd", pad_to_multiple_of=16
    )
    assert {len(r) for r in bins["input_ids"]} == {64} and {len(r) for r in bins["position_ids"]} == {64}
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(f"Paragraph {i} " + "word " * 40 for i in range(40)))
    with pytest.raises(ValueError, match=r"max_length \(60\) must be a multiple of it \(e.g. 64\)"):
        data.prepare_datasets(str(text), chatml, 60, pad_to_multiple_of=16)
    rows, _ = data.prepare_datasets(str(text), chatml, 64, pad_to_multiple_of=16)
    assert {len(r) for r in rows["input_ids"]} == {64}


def test_eval_packing_lays_out_the_evaluation_rows_on_their_own(tmp_path, chatml):
    path = tmp_path / "chat.jsonl"
    write_chat_jsonl(path, 40)
    train, evaluation = data.prepare_datasets(
        str(path), chatml, 96, validation_split_percentage=25, packing=True, eval_packing=False
    )
    assert "position_ids" in train.column_names  # best-fit-decreasing bins
    assert "position_ids" not in evaluation.column_names and "attention_mask" in evaluation.column_names
    _, same = data.prepare_datasets(str(path), chatml, 96, validation_split_percentage=25, packing=True)
    assert "position_ids" in same.column_names  # None: as the training rows


def test_skip_prepare_dataset_takes_the_rows_as_they_are(tmp_path, chatml):
    folder = tmp_path / "rows"
    rows = {"input_ids": [[i, i + 1, i + 2, i + 3] for i in range(20)], "extra": list(range(20))}
    Dataset.from_dict(rows).save_to_disk(str(folder))
    train, evaluation = data.prepare_datasets(
        str(folder), chatml, 4, validation_split_percentage=10, dataset_kwargs={"skip_prepare_dataset": True}
    )
    assert train.column_names == ["input_ids"] and len(train) + len(evaluation) == 20
    kept = list(train["input_ids"]) + list(evaluation["input_ids"])
    assert sorted(map(tuple, kept)) == sorted(map(tuple, rows["input_ids"]))
    ragged = tmp_path / "ragged"
    Dataset.from_dict({"input_ids": [[1, 2, 3], [1, 2]] * 5}).save_to_disk(str(ragged))
    with pytest.raises(ValueError, match="must all have one length"):
        data.prepare_datasets(str(ragged), chatml, 4, dataset_kwargs='{"skip_prepare_dataset": true}')


def test_the_options_that_cannot_apply_are_refused_by_name():
    with pytest.raises(ValueError, match="truncation_mode='keep_end' is not supported"):
        DataArguments(truncation_mode="keep_end")
    with pytest.raises(ValueError, match="dataset_kwargs takes one key, skip_prepare_dataset"):
        DataArguments(dataset_kwargs={"num_proc": 2})
    with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive integer or 'auto'"):
        DataArguments(pad_to_multiple_of=0)
    assert DataArguments(pad_to_multiple_of="auto").pad_to_multiple_of is None  # TRL's default
    assert DataArguments(pad_to_multiple_of="8").pad_to_multiple_of == 8  # as the command line gives it


def test_bare_flags_and_a_former_name_on_the_command_line(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        json.dumps({"model_config": {"model_type": "llama"}, "max_length": 128, "packing": False})
    )

    def parsed(*argv):  # as the command parses its line: once, with a parser of its own
        parser = NoLoCoArgumentParser()
        return parser.build(DataArguments, parser.parse([str(recipe), *argv]))

    namespace = NoLoCoArgumentParser().parse(
        [str(recipe), "--packing", "--completion_only_loss", "--use_peft"]
    )
    assert namespace.packing is True and namespace.completion_only_loss is True and namespace.use_peft is True
    assert parsed("--packing", "false").packing is False
    # The command line wins over the recipe, whichever name each uses.
    assert parsed("--block_size", "64").max_length == 64
    recipe.write_text(json.dumps({"model_config": {"model_type": "llama"}, "block_size": 128}))
    assert parsed("--max_length", "32").max_length == 32
    # Both names in one source is still an error.
    with pytest.raises(ValueError, match="block_size is the former name of max_length"):
        parsed("--max_length", "32", "--block_size", "16")
