"""Bad configurations: many malformed recipes and overrides, each refused with a clear one-paragraph error
that names the bad setting, never a traceback from deep inside torch or a hang.

All cases go through ``hf_noloco.launch.cli.parse_args`` in ONE driver subprocess (start-up dominates the
cost); a few also run as the real command (``python recipes/train.py``, and one 2-rank torchrun launch) to
check the exit status and what the user sees on stderr.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from tests.helpers.paths import ROOT
from tests.helpers.tiny_models import RECIPE_MODEL

TRAIN = os.path.join(ROOT, "recipes", "train.py")

TINY_MODEL = RECIPE_MODEL


def base_recipe(tmp, launched: bool) -> dict:
    """A valid recipe: one process (pp=1, no sync), or as seen by each rank of a 4-process launch (pp=2 x
    dp=2)."""
    recipe = {
        "model_config": TINY_MODEL,
        "tokenizer_vocab_size": 300,
        "max_length": 16,
        "dataset_name": os.path.join(tmp, "corpus.txt"),
        "output_dir": os.path.join(tmp, "out"),
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "report_to": "none",
        "disable_tqdm": True,
    }
    recipe.update(
        {"pipeline_stages": 2, "outer_optimizer": "noloco", "inner_steps": 2}
        if launched
        else {"pipeline_stages": 1, "outer_optimizer": "local"}
    )
    return recipe


# (id, how, input, words the message must contain). how: "cli" = overrides of the one-process recipe,
# "launched" = overrides as seen under a 4-process launch (WORLD_SIZE=4), "yaml" = recipe keys replaced
# (None deletes a key), "text" = the recipe file's raw text.
CASES = [
    # wrong types
    (
        "batch not int",
        "cli",
        ["--per_device_train_batch_size", "abc"],
        ["per_device_train_batch_size", "'abc'"],
    ),
    ("lr not float", "cli", ["--learning_rate", "fast"], ["learning_rate", "'fast'"]),
    ("stages float", "cli", ["--pipeline_stages", "2.5"], ["pipeline_stages", "'2.5'"]),
    ("bool garbage", "cli", ["--disable_tqdm", "maybe"], ["disable_tqdm", "maybe"]),
    ("missing value", "cli", ["--max_steps"], ["max_steps", "expected one argument"]),
    ("timeout not number", "cli", ["--p2p_timeout", "soon"], ["p2p_timeout", "'soon'"]),
    ("boundaries not ints", "cli", ["--stage_boundaries", "a"], ["stage_boundaries", "'a'"]),
    (
        "yaml batch string",
        "yaml",
        {"per_device_train_batch_size": "eight"},
        ["per_device_train_batch_size", "'eight'"],
    ),
    ("yaml steps float", "yaml", {"max_steps": 2.5}, ["max_steps", "'2.5'"]),
    ("yaml stages bool", "yaml", {"pipeline_stages": True}, ["pipeline_stages", "'True'"]),
    (
        "yaml list for scalar",
        "yaml",
        {"per_device_train_batch_size": [1, 2]},
        ["per_device_train_batch_size", "[1, 2]"],
    ),
    ("yaml mapping for scalar", "yaml", {"learning_rate": {"value": 1}}, ["learning_rate", "mapping"]),
    ("yaml nested list", "yaml", {"stage_boundaries": [[1]]}, ["stage_boundaries", "[[1]]"]),
    ("yaml report_to list", "yaml", {"report_to": ["wandb", "nope"]}, ["report_to", "'nope'"]),
    ("yaml list for a flag", "yaml", {"disable_tqdm": [True]}, ["disable_tqdm", "list"]),
    ("yaml model_config number", "yaml", {"model_config": 5}, ["model_config", "'5'"]),
    ("yaml model_config list", "yaml", {"model_config": [1, 2]}, ["model_config", "[1, 2]"]),
    ("model_config not json", "cli", ["--model_config", "{not json"], ["model_config", "{not json"]),
    (
        "model_config without type",
        "yaml",
        {"model_config": {"hidden_size": 32}},
        ["model_config", "model_type"],
    ),
    (
        "model size string",
        "yaml",
        {"model_config": {**TINY_MODEL, "hidden_size": "big"}},
        ["hidden_size", "'big'"],
    ),
    # negative or zero sizes
    ("batch negative", "cli", ["--per_device_train_batch_size", "-2"], ["per_device_train_batch_size", "-2"]),
    ("batch zero", "cli", ["--per_device_train_batch_size", "0"], ["per_device_train_batch_size", "0"]),
    ("eval batch zero", "cli", ["--per_device_eval_batch_size", "0"], ["per_device_eval_batch_size", "0"]),
    ("microbatch zero", "cli", ["--microbatch_size", "0"], ["microbatch_size", "0"]),
    ("stages zero", "cli", ["--pipeline_stages", "0"], ["pipeline_stages", "0"]),
    ("stages negative", "cli", ["--pipeline_stages", "-1"], ["pipeline_stages", "-1"]),
    ("max length one", "cli", ["--max_length", "1"], ["max_length", "1"]),
    ("max length negative", "cli", ["--max_length", "-8"], ["max_length", "-8"]),
    # a former name (deprecated) sets the new one, and is checked as it is
    ("former name block_size one", "yaml", {"max_length": None, "block_size": 1}, ["max_length", "got 1"]),
    (
        "former and new name disagree",  # in one source (the command line over the recipe is fine)
        "cli",
        ["--block_size", "8", "--max_length", "16"],
        ["block_size", "former name of max_length", "not both"],
    ),
    ("vocab tiny", "cli", ["--tokenizer_vocab_size", "10"], ["tokenizer_vocab_size", "10"]),
    ("vocab negative", "cli", ["--tokenizer_vocab_size", "-1"], ["tokenizer_vocab_size", "-1"]),
    ("max samples zero", "cli", ["--max_train_samples", "0"], ["max_train_samples", "0"]),
    ("num proc zero", "cli", ["--dataset_num_proc", "0"], ["dataset_num_proc", "0"]),
    (
        "val split too big",
        "cli",
        ["--validation_split_percentage", "150"],
        ["validation_split_percentage", "150"],
    ),
    (
        "val split negative",
        "cli",
        ["--validation_split_percentage", "-5"],
        ["validation_split_percentage", "-5"],
    ),
    ("timeout zero", "cli", ["--p2p_timeout", "0"], ["p2p_timeout", "0"]),
    ("timeout negative", "cli", ["--p2p_timeout", "-1"], ["p2p_timeout", "-1"]),
    ("divergence zero", "cli", ["--divergence_steps", "0"], ["divergence_steps", "0"]),
    ("lr negative", "cli", ["--learning_rate", "-1"], ["learning_rate", "-1"]),
    ("weight decay negative", "cli", ["--weight_decay", "-0.1"], ["weight_decay", "-0.1"]),
    ("beta out of range", "cli", ["--adam_beta1", "1.5"], ["adam_beta1", "1.5"]),
    ("epsilon negative", "cli", ["--adam_epsilon=-1e-8"], ["adam_epsilon", "-1e-08"]),
    ("negative without =", "cli", ["--adam_epsilon", "-1e-8"], ["adam_epsilon", "--key=-1e-8"]),
    ("yaml epsilon negative", "yaml", {"adam_epsilon": -1e-8}, ["adam_epsilon", "-1e-08"]),
    ("warmup negative", "cli", ["--warmup_steps", "-5"], ["warmup_steps", "-5"]),
    ("seed negative", "cli", ["--seed", "-3"], ["seed", "-3"]),
    ("logging steps zero", "cli", ["--logging_steps", "0"], ["logging_steps"]),
    ("eval steps negative", "cli", ["--eval_strategy", "steps", "--eval_steps", "-5"], ["eval_steps", "-5"]),
    ("save steps negative", "cli", ["--save_strategy", "steps", "--save_steps", "-1"], ["save_steps", "-1"]),
    ("logging steps negative", "cli", ["--logging_steps", "-1"], ["logging_steps", "-1"]),
    (
        "scheduler kwargs not json",
        "cli",
        ["--lr_scheduler_kwargs", "notjson"],
        ["lr_scheduler_kwargs", "'notjson'"],
    ),
    (
        "nothing to train",
        "cli",
        ["--max_steps", "-1", "--num_train_epochs", "0"],
        ["max_steps", "num_train_epochs"],
    ),
    ("inner steps negative", "launched", ["--inner_steps", "-3"], ["inner_steps", "-3"]),
    ("outer lr negative", "launched", ["--outer_lr", "-0.5"], ["outer_lr", "-0.5"]),
    ("outer momentum too big", "launched", ["--outer_momentum", "1.5"], ["outer_momentum", "1.5"]),
    (
        "hidden size negative",
        "yaml",
        {"model_config": {**TINY_MODEL, "hidden_size": -4}},
        ["hidden_size", "-4"],
    ),
    (
        "no layers",
        "yaml",
        {"model_config": {**TINY_MODEL, "num_hidden_layers": 0}},
        ["num_hidden_layers", "0"],
    ),
    # unknown methods and names
    ("unknown outer optimizer", "cli", ["--outer_optimizer", "gossip"], ["outer_optimizer", "'gossip'"]),
    ("unknown routing", "cli", ["--routing", "random"], ["routing", "'random'"]),
    ("unknown outer dtype", "cli", ["--outer_dtype", "fp16"], ["outer_dtype", "'fp16'"]),
    ("unknown scheduler", "cli", ["--lr_scheduler_type", "wobbly"], ["lr_scheduler_type", "'wobbly'"]),
    ("unknown optimizer", "cli", ["--optim", "sgdx"], ["optim", "'sgdx'"]),
    ("unknown strategy", "cli", ["--eval_strategy", "sometimes"], ["eval_strategy", "'sometimes'"]),
    ("unknown report_to", "cli", ["--report_to", "foo"], ["report_to", "'foo'"]),
    ("yaml routing number", "yaml", {"routing": 3}, ["routing", "'3'"]),
    ("unknown stage balance", "cli", ["--stage_balance", "flops"], ["stage_balance", "'flops'"]),
    (
        "unknown model_type",
        "yaml",
        {"model_config": {**TINY_MODEL, "model_type": "nonsense"}},
        ["model_type", "nonsense"],
    ),
    (
        "not llama family",
        "yaml",
        {"model_config": {"model_type": "gpt2", "n_layer": 2}},
        ["GPT2LMHeadModel", "Llama-family"],
    ),
    ("unknown option", "cli", ["--no_such_option", "3"], ["no_such_option"]),
    ("unknown yaml key", "yaml", {"learning_rte": 0.1}, ["learning_rte"]),
    ("positional junk", "cli", ["extra_positional"], ["extra_positional"]),
    # contradictory or impossible combinations
    ("both model sources", "yaml", {"model_name_or_path": "gpt2"}, ["model_name_or_path", "model_config"]),
    ("no model source", "yaml", {"model_config": None}, ["model_name_or_path", "model_config"]),
    ("bf16 and fp16", "cli", ["--bf16", "true", "--fp16", "true"], ["fp16", "bf16"]),
    (
        "grad accumulation",
        "cli",
        ["--gradient_accumulation_steps", "0"],
        ["gradient_accumulation_steps", "0"],
    ),
    (
        "token averaging",
        "cli",
        ["--average_tokens_across_devices", "true"],
        ["average_tokens_across_devices"],
    ),
    ("best model at end", "cli", ["--load_best_model_at_end", "true"], ["load_best_model_at_end"]),
    ("microbatch not divisor", "cli", ["--microbatch_size", "3"], ["microbatch_size=3"]),
    (
        "heads vs hidden",
        "yaml",
        {"model_config": {**TINY_MODEL, "hidden_size": 30, "num_attention_heads": 4}},
        ["hidden size (30)", "attention heads (4)"],
    ),
    (
        "heads vs kv heads",
        "yaml",
        {"model_config": {**TINY_MODEL, "num_attention_heads": 4, "num_key_value_heads": 3}},
        ["num_attention_heads=4", "num_key_value_heads=3"],
    ),
    (
        "missing dataset",
        "cli",
        ["--dataset_name", "./no/such/corpus.txt"],
        ["dataset_name", "./no/such/corpus.txt"],
    ),
    (
        "missing checkpoint",
        "cli",
        ["--resume_from_checkpoint", "/no/such/checkpoint-5"],
        ["resume_from_checkpoint"],
    ),
    ("push without repo", "cli", ["--push_to_hub", "true"], ["push_to_hub", "hub_model_id"]),
    (
        "push bad repo id",
        "cli",
        ["--push_to_hub", "true", "--hub_model_id", "not/a/valid/id"],
        ["hub_model_id"],
    ),
    (
        "gamma with diloco",
        "launched",
        ["--outer_optimizer", "diloco", "--outer_averaging", "0.3"],
        ["outer_averaging"],
    ),
    (
        "stages vs world size",
        "launched_yaml",
        {"pipeline_stages": 3, "model_config": {**TINY_MODEL, "num_hidden_layers": 6}},
        ["pipeline_stages=3", "world size"],
    ),
    ("group larger than replicas", "launched", ["--gossip_group_size", "3"], ["gossip_group_size=3"]),
    ("export replica out of range", "launched", ["--export_replica", "5"], ["export_replica", "5"]),
    (
        "noloco with one replica",
        "launched_yaml",
        {"pipeline_stages": 4, "model_config": {**TINY_MODEL, "num_hidden_layers": 4}},
        ["noloco", "replica"],
    ),
    (
        "more stages than layers",
        "launched",
        ["--pipeline_stages", "4", "--outer_optimizer", "local"],
        ["pipeline_stages=4", "decoder layers"],
    ),
    ("boundaries count", "launched", ["--stage_boundaries", "1", "2"], ["stage_boundaries", "[1, 2]"]),
    ("boundaries out of range", "launched", ["--stage_boundaries", "9"], ["stage_boundaries", "[9]"]),
    (
        "boundaries and balance",
        "launched",
        ["--stage_boundaries", "1", "--stage_balance", "compute"],
        ["stage_boundaries=[1]", "stage_balance='compute'", "only one"],
    ),
    # TrainingArguments options the trainer would otherwise ignore silently
    ("neftune", "cli", ["--neftune_noise_alpha", "5"], ["neftune_noise_alpha=5.0", "not supported"]),
    ("liger kernels", "cli", ["--use_liger_kernel", "true"], ["use_liger_kernel=True", "not supported"]),
    ("hub strategy", "cli", ["--hub_strategy", "sometimes"], ["hub_strategy", "sometimes"]),
    ("label smoothing", "cli", ["--label_smoothing_factor", "0.1"], ["label_smoothing_factor=0.1"]),
    ("tokens seen", "cli", ["--include_num_input_tokens_seen", "all"], ["include_num_input_tokens_seen"]),
    ("save only model", "cli", ["--save_only_model", "true"], ["save_only_model=True"]),
    ("full bf16 eval", "cli", ["--bf16_full_eval", "true"], ["bf16_full_eval=True"]),
    (
        "sampling strategy",
        "cli",
        ["--train_sampling_strategy", "group_by_length"],
        ["train_sampling_strategy"],
    ),
    ("ddp bucket", "cli", ["--ddp_bucket_cap_mb", "25"], ["ddp_bucket_cap_mb=25"]),
    ("split batches", "yaml", {"accelerator_config": {"split_batches": True}}, ["split_batches=True"]),
    # model and memory options
    ("dtype float16", "cli", ["--dtype", "float16"], ["dtype", "float16"]),
    ("init dtype float16", "yaml", {"model_init_kwargs": {"dtype": "float16"}}, ["float16", "bfloat16"]),
    ("init unknown key", "yaml", {"model_init_kwargs": {"device_map": "auto"}}, ["'device_map'"]),
    (
        "dtype given twice",
        "yaml",
        {"dtype": "bfloat16", "model_init_kwargs": {"dtype": "float32"}},
        ["model_init_kwargs", "dtype", "once"],
    ),
    (
        "flash attention",
        "cli",
        ["--attn_implementation", "flash_attention_2"],
        ["flash_attention_2", "flash_attn"],
    ),
    ("attention unknown", "cli", ["--attn_implementation", "fast"], ["attn_implementation", "'fast'"]),
    ("revision from scratch", "cli", ["--model_revision", "v1"], ["model_revision", "model_config"]),
    (
        "reentrant checkpointing",
        "yaml",
        {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
        ["use_reentrant=True"],
    ),
    (
        "checkpoint every 0 layers",
        "yaml",
        {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 0}},
        ["every_n_layers", "0"],
    ),
    ("loss chunk zero", "cli", ["--loss_chunk_tokens", "0"], ["loss_chunk_tokens", "0"]),
    ("export dtype", "cli", ["--export_dtype", "float16"], ["export_dtype", "float16"]),
    # malformed files
    ("yaml syntax", "text", "model_config: {model_type: llama\nmax_length: 32\n", ["not valid YAML", "line"]),
    ("yaml top-level list", "text", "- max_steps\n- 3\n", ["mapping", "list"]),
    ("yaml scalar", "text", "just some words\n", ["mapping", "str"]),
    ("yaml non-string key", "text", "1: 2\n", ["unknown option", "1"]),
    ("yaml tab indentation", "text", "model_config:\n\tmodel_type: llama\n", ["not valid YAML"]),
    ("empty recipe", "text", "", ["model_name_or_path", "model_config"]),
    ("missing recipe", "missing", None, ["does not exist", "nope.yaml"]),
]

DRIVER = textwrap.dedent("""
    import json, os, signal, sys, traceback
    from hf_noloco.launch.cli import parse_args

    def on_alarm(*_):
        raise TimeoutError("parse_args hung")

    signal.signal(signal.SIGALRM, on_alarm)
    results = []
    for argv, env in json.load(open(sys.argv[1])):
        saved = dict(os.environ)
        os.environ.update(env)
        signal.alarm(60)
        try:
            parse_args(argv)
            results.append(dict(kind="accepted"))
        except BaseException as exc:
            frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
            results.append(dict(kind=type(exc).__name__, is_value_error=isinstance(exc, ValueError),
                                message=str(exc), frames=frames))
        signal.alarm(0)
        os.environ.clear()
        os.environ.update(saved)
    print("RESULTS " + json.dumps(results))
""")


def _env(tmp_path) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        WANDB_MODE="disabled",
        TMPDIR=str(tmp_path),
        HF_DATASETS_CACHE=str(tmp_path / "datasets"),
        HF_HUB_OFFLINE="1",
        HF_TOKEN="",
    )
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _write_case(tmp_path, index, how, value) -> list[str]:
    """The argv of one case, writing its recipe file."""
    path = tmp_path / f"case{index}.yaml"
    if how == "missing":
        return [str(tmp_path / "nope.yaml")]
    if how == "text":
        path.write_text(value)
        return [str(path)]
    recipe = base_recipe(str(tmp_path), launched=how.startswith("launched"))
    if how in ("yaml", "launched_yaml"):
        for key, v in value.items():
            if v is None:
                recipe.pop(key, None)
            else:
                recipe[key] = v
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return [str(path)] + (list(value) if how in ("cli", "launched") else [])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "corpus.txt").write_text("\n\n".join(f"Paragraph {i} of a small corpus." for i in range(50)))
    return tmp


@pytest.fixture(scope="module")
def outcomes(workspace):
    cases = []
    for i, (_, how, value, _) in enumerate(CASES):
        env = {"WORLD_SIZE": "4"} if how.startswith("launched") else {}
        cases.append([_write_case(workspace, i, how, value), env])
    # The control cases: the base recipes themselves parse (so every failure above is the case's own doing),
    # and a bare `no` in YAML (read as False) means the choice "no".
    cases.append([_write_case(workspace, "ok1", "yaml", {}), {}])
    cases.append(
        [_write_case(workspace, "ok2", "yaml", {"eval_strategy": False, "save_strategy": False}), {}]
    )
    # Tied embeddings over two stages, in bf16 with activation checkpointing: accepted.
    tied = {"model_config": {**TINY_MODEL, "tie_word_embeddings": True}, "dtype": "bfloat16"}
    tied.update({"gradient_checkpointing": True, "torch_compile": True})
    cases.append([_write_case(workspace, "ok3", "launched_yaml", tied), {"WORLD_SIZE": "4"}])
    # The former (deprecated) names still work.
    former = {"max_length": None, "block_size": 16, "preprocessing_num_proc": 1}
    cases.append([_write_case(workspace, "ok4", "yaml", former), {}])
    (workspace / "cases.json").write_text(json.dumps(cases))
    (workspace / "driver.py").write_text(DRIVER)
    done = subprocess.run(
        [sys.executable, str(workspace / "driver.py"), str(workspace / "cases.json")],
        env=_env(workspace),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=workspace,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    return json.loads(line[len("RESULTS ") :])


def test_valid_control_recipes_parse(outcomes):
    ok1, ok2, tied, former = outcomes[len(CASES) :]
    assert ok1["kind"] == "accepted", ok1
    assert ok2["kind"] == "accepted", ok2
    # Every check passed: what stops it is joining the 4-process group that this driver does not start.
    assert tied["kind"] == "accepted" or "MASTER_ADDR" in tied["message"], tied
    assert former["kind"] == "accepted", former


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_bad_setting_gives_a_clear_error(outcomes, index):
    name, _how, _value, words = CASES[index]
    outcome = outcomes[index]
    # Refused, as a ValueError (what the command turns into `error: ...` and exit status 2), not accepted,
    # not argparse's SystemExit with the usage of every option, not a hang.
    assert outcome["kind"] != "accepted", f"{name}: accepted"
    assert outcome["is_value_error"], f"{name}: {outcome['kind']}: {outcome['message']}"
    message = outcome["message"]
    for word in words:
        assert word in message, f"{name}: {word!r} not in {message!r}"
    assert "\n\n" not in message and len(message) < 1500, message  # one paragraph
    assert "MASTER_ADDR" not in message  # refused before joining a process group
    # Raised by our checks, argparse or TrainingArguments' own validation: never from torch internals.
    raiser = outcome["frames"][-1]
    assert f"{os.sep}torch{os.sep}" not in raiser and "huggingface_hub" not in raiser, (
        name,
        outcome["frames"],
    )


def _command(tmp_path, argv, prefix=()):
    return subprocess.Popen(
        [*prefix, *argv],
        env=_env(tmp_path),
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_the_command_exits_2_with_one_line_on_every_rank(workspace):
    """The real command: exit status 2, one `error: ...` line, no traceback; under a launch, on every rank."""
    single = {"type": ["--per_device_train_batch_size", "abc"], "yaml": None}
    procs = {}
    for key, overrides in single.items():
        argv = (
            _write_case(workspace, f"run-{key}", "cli", overrides)
            if overrides
            else _write_case(workspace, "run-yaml", "text", "model_config: [unclosed\n")
        )
        procs[key] = _command(workspace, [sys.executable, TRAIN, *argv])
    launched = _write_case(
        workspace, "run-launch", "launched", ["--outer_optimizer", "local", "--export_replica", "1"]
    )
    procs["launch"] = _command(
        workspace,
        [*launched],
        prefix=(
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            TRAIN,
        ),
    )
    outputs = {key: (*p.communicate(timeout=240), p.returncode) for key, p in procs.items()}

    for key in single:
        _out, err, code = outputs[key]
        assert code == 2, (key, code, err[-2000:])
        lines = [line for line in err.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error: ")]
        assert len(errors) == 1, (key, err[-2000:])
        assert "Traceback" not in err and "site-packages/torch" not in err, (key, err[-2000:])
    assert "per_device_train_batch_size" in outputs["type"][1] and "not valid YAML" in outputs["yaml"][1]

    # 2 ranks of pp=2: one replica, so export_replica=1 is out of range. Each rank says so and exits; the
    # launcher ends with a failure (its own report may name the exit codes), and no worker traceback. Once the
    # first rank has exited, torchrun may stop the other before it prints: at least one rank's line must show.
    _out, err, code = outputs["launch"]
    assert code != 0
    said = [r for r in range(2) if f"error (rank {r} of 2): export_replica must be in [0, 1), got 1." in err]
    assert said, err[-3000:]
    for where in ("hf_noloco/launch/cli.py", "hf_noloco/config.py"):
        assert f'{where}", line' not in err, err[-3000:]
