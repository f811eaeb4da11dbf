"""The command line: recipes as defaults (TRL's --config form, or positional), overrides, help texts."""

import dataclasses
import os
import re

import pytest
import yaml

from hf_noloco.config import NoLoCoConfig
from hf_noloco.data.arguments import DataArguments
from hf_noloco.docstrings import docstring_entries, is_package_field
from hf_noloco.launch.arguments import ModelArguments
from hf_noloco.launch.cli import NoLoCoArgumentParser, parse_args
from tests.helpers.paths import ROOT
from tests.helpers.tiny_models import tiny_model

TINY_RECIPE = os.path.join(ROOT, "recipes", "llama-tiny", "noloco.yaml")


def _recipe(tmp_path, **overrides) -> str:
    """The tiny recipe as one process runs it (pp=1, no sync), with ``overrides``."""
    with open(TINY_RECIPE) as f:
        recipe = yaml.safe_load(f)
    recipe.update(
        pipeline_stages=1, outer_optimizer="local", output_dir=str(tmp_path / "out"), report_to="none"
    )
    recipe.update(overrides)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def _settings(parsed) -> dict:
    return {f"{type(d).__name__}.{f.name}": getattr(d, f.name) for d in parsed for f in dataclasses.fields(d)}


def test_config_option_and_positional_recipe_parse_alike(tmp_path):
    recipe = _recipe(tmp_path)
    positional = parse_args([recipe, "--max_steps", "20", "--routing", "fixed"])
    trl_style = parse_args(["--config", recipe, "--max_steps", "20", "--routing", "fixed"])
    equals = parse_args([f"--config={recipe}", "--max_steps=20", "--routing=fixed"])
    assert _settings(positional) == _settings(trl_style) == _settings(equals)
    model_args, data_args, config = trl_style
    assert config.max_steps == 20 and config.routing == "fixed"  # the command line wins
    assert config.learning_rate == 2.0e-3 and data_args.max_length == 128  # the recipe's values
    assert model_args.model_config["hidden_size"] == 128  # a YAML mapping stays a mapping


def test_a_model_source_on_the_command_line_replaces_the_recipes(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    tiny_model("llama", 2).save_pretrained(checkpoint)
    recipe = _recipe(tmp_path)  # pretrains from model_config
    model_args, _, _ = parse_args(["--config", recipe, "--model_name_or_path", str(checkpoint)])
    assert model_args.model_name_or_path == str(checkpoint) and model_args.model_config is None
    # And the other way round: a recipe that fine-tunes, pretrained from a config given on the command line.
    finetune = _recipe(tmp_path, model_name_or_path=str(checkpoint), model_config=None)
    model_args, _, _ = parse_args(
        [finetune, '--model_config={"model_type": "llama", "num_hidden_layers": 2}']
    )
    assert model_args.model_name_or_path is None and model_args.model_config["num_hidden_layers"] == 2


def test_recipe_values_are_converted_and_checked_like_command_line_text(tmp_path):
    _, _, config = parse_args(
        [_recipe(tmp_path, adam_epsilon="1e-7", stage_boundaries=None, eval_strategy=False)]
    )
    assert config.adam_epsilon == 1e-7  # YAML reads 1e-7 as text; argparse converts it
    assert config.eval_strategy == "no"  # YAML 1.1 reads `no` as False
    with pytest.raises(ValueError, match=r"Did you mean 'learning_rate'\?"):
        parse_args([_recipe(tmp_path, learning_rte=0.1)])
    with pytest.raises(ValueError, match=r"Did you mean 'max_steps'\?"):
        parse_args([_recipe(tmp_path), "--max_step", "3"])


def _normalised(text: str) -> str:
    return re.sub(r"\s+", "", text)  # argparse re-wraps lines, breaking them at spaces and hyphens


def test_help_shows_every_options_whole_docstring_entry():
    help_text = _normalised(NoLoCoArgumentParser().format_help())
    for dtype in (NoLoCoConfig, ModelArguments, DataArguments):
        entries = docstring_entries(dtype.__doc__)
        own = [f.name for f in dataclasses.fields(dtype) if f.init and is_package_field(dtype, f.name)]
        assert own and set(own) <= set(entries), set(own) - set(entries)  # every own option is documented
        for name in own:
            assert len(entries[name]) > 20, name
            assert f"--{name}" in help_text
            assert _normalised(entries[name]) in help_text, name
    assert "--configRECIPE" in help_text
