"""Bad inputs through the real command: each case ends with exactly one `error: ...` line that names the
cause, exit status 2, no traceback, before training; under a 2-process launch, on every rank.

The cases are the ones found failing with a traceback, a hidden cause or an echoed value (an empty `.jsonl`, a
missing model folder that fell through to the Hub, a corrupt `config.json`, `--p2p_timeout inf`, a misspelled
`--hub_token` printing the token) and the others of their kind: unreadable data, corrupt weights, configs or
tokenizers, non-finite or out-of-range numbers. They run through ``hf_noloco.launch.cli.main(argv)`` in ONE
driver subprocess (its exit captured per case: start-up dominates the cost), with a valid control that
trains (so each failure is its case's own doing); one case also runs as two separate worker processes of one
launch.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from tests.helpers.paths import ROOT
from tests.helpers.tiny_models import RECIPE_MODEL

TRAIN = os.path.join(ROOT, "recipes", "train.py")
SECRET = "hf_SECRETtokenDoNotEcho0123456789"

# (id, overrides of the one-process recipe, words the error line must contain)
CASES = [
    ("empty jsonl", ["--dataset_name", "data/empty.jsonl"], ["empty.jsonl", "is empty"]),
    ("binary jsonl", ["--dataset_name", "data/binary.jsonl"], ["binary.jsonl", "cannot be read as json"]),
    ("broken json line", ["--dataset_name", "data/broken.jsonl"], ["broken.jsonl", "cannot be read as json"]),
    ("empty data folder", ["--dataset_name", "data/emptydir"], ["data/emptydir", "holds no file"]),
    ("whitespace text", ["--dataset_name", "data/blank.txt"], ["blank.txt", "0 document"]),
    (
        "missing model folder",
        ["--model_name_or_path", "./no/such/model"],
        ["./no/such/model", "never looked up"],
    ),
    (
        "missing absolute path",
        ["--model_name_or_path", "/no/such/model"],
        ["/no/such/model", "never looked up"],
    ),
    ("missing nested path", ["--model_name_or_path", "no/such/model"], ["no/such/model", "never looked up"]),
    (
        "missing tokenizer",
        ["--tokenizer_name_or_path", "./no/tokenizer"],
        ["tokenizer_name_or_path", "./no/"],
    ),
    ("corrupt config", ["--model_name_or_path", "models/bad-config"], ["config.json", "not valid JSON"]),
    ("config without type", ["--model_name_or_path", "models/no-type"], ["config.json", "model_type"]),
    ("no config", ["--model_name_or_path", "models/no-config"], ["holds no config.json"]),
    (
        "corrupt weights",
        ["--model_name_or_path", "models/bad-weights"],
        ["model.safetensors", "not a readable"],
    ),
    (
        "truncated weights",
        ["--model_name_or_path", "models/truncated"],
        ["model.safetensors", "not fully covered"],
    ),
    ("pickle weights only", ["--model_name_or_path", "models/bin-only"], ["safetensors checkpoints only"]),
    ("no tokenizer files", ["--model_name_or_path", "models/no-tokenizer"], ["holds none of tokenizer.json"]),
    (
        "corrupt tokenizer",
        ["--model_name_or_path", "models/bad-tokenizer"],
        ["No tokenizer could be loaded", "("],
    ),
    ("p2p timeout inf", ["--p2p_timeout", "inf"], ["p2p_timeout", "finite"]),
    ("p2p timeout nan", ["--p2p_timeout", "nan"], ["p2p_timeout", "finite"]),
    ("ddp timeout huge", ["--ddp_timeout", "100000000000000"], ["ddp_timeout", "at most"]),
    ("learning rate inf", ["--learning_rate", "inf"], ["learning_rate", "finite"]),
    ("grad norm nan", ["--max_grad_norm", "nan"], ["max_grad_norm", "finite"]),
    ("epochs inf", ["--max_steps", "-1", "--num_train_epochs", "inf"], ["num_train_epochs", "finite"]),
    ("steps beyond int64", ["--max_steps", "9" * 30], ["max_steps", "64 bits"]),
    ("outer lr inf", ["--outer_lr", "inf"], ["outer_lr", "finite"]),
    ("misspelled token option", ["--hub_tokn", SECRET], ["--hub_tokn", "hub_token", "not shown"]),
    ("token option without value", ["--hub_token"], ["--hub_token", "expected one argument"]),
]

DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, sys, traceback
    from hf_noloco.launch import cli

    results = []
    for argv in json.load(open(sys.argv[1])):
        err, out = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                cli.main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:  # what the command would have shown as a traceback
            code = "traceback"
            err.write("Traceback\\n" + "".join(traceback.format_exception(exc))[-3000:])
        results.append({"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()})
    print("RESULTS " + json.dumps(results))
    """
)


def _env(tmp) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "datasets"),
        TMPDIR=str(tmp),
        HF_TOKEN="",
        TOKENIZERS_PARALLELISM="false",
    )
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HF_NOLOCO_TRACEBACK"):
        env.pop(var, None)
    return env


def _model_folders(tmp):
    """A valid tiny model folder (weights, config, a word-level tokenizer) and broken copies of it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("abcdefghijklmnop")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>"
    )
    config = {k: v for k, v in RECIPE_MODEL.items() if k != "model_type"}
    ok = tmp / "models" / "ok"
    LlamaForCausalLM(
        LlamaConfig(vocab_size=len(vocab), pad_token_id=1, eos_token_id=2, **config)
    ).save_pretrained(ok)
    fast.save_pretrained(ok)
    broken = {
        "bad-config": lambda f: (f / "config.json").write_text("{not json"),
        "no-type": lambda f: (f / "config.json").write_text("{}"),
        "no-config": lambda f: (f / "config.json").unlink(),
        "bad-weights": lambda f: (f / "model.safetensors").write_bytes(b"garbage" * 10),
        "truncated": lambda f: (f / "model.safetensors").write_bytes(
            (f / "model.safetensors").read_bytes()[:-100]
        ),
        "bin-only": lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"),
        "no-tokenizer": lambda f: [(f / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
        "bad-tokenizer": lambda f: (f / "tokenizer.json").write_text('{"version": "1.0", "model": 5}'),
    }
    for name, damage in broken.items():
        folder = tmp / "models" / name
        shutil.copytree(ok, folder)
        damage(folder)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-inputs")
    data = tmp / "data"
    (data / "emptydir").mkdir(parents=True)
    (data / "ok.txt").write_text("\n\n".join(f"a b c d e f g h {i} of a small corpus." for i in range(60)))
    (data / "empty.jsonl").write_bytes(b"")
    (data / "binary.jsonl").write_bytes(b"\x00\xff\xfe{not json\n")
    (data / "broken.jsonl").write_text('{"text": "a b c"}\n{"text": oops\n')
    (data / "blank.txt").write_text("\n\n   \n\t\n")
    _model_folders(tmp)
    recipe = {
        "model_config": RECIPE_MODEL,
        "tokenizer_vocab_size": 300,
        "max_length": 16,
        "dataset_name": "data/ok.txt",
        "output_dir": "out",
        "per_device_train_batch_size": 4,
        "max_steps": 1,
        "report_to": "none",
        "disable_tqdm": True,
        "pipeline_stages": 1,
        "outer_optimizer": "local",
        "eval_strategy": "no",
        "save_strategy": "no",
    }
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return tmp


def _argv(overrides):
    argv = ["recipe.yaml", *overrides]
    if "--model_name_or_path" in overrides:  # the recipe's own model source is replaced (its model_config)
        argv += ["--output_dir", "out-finetune"]
    return argv


@pytest.fixture(scope="module")
def outcomes(workspace):
    # The control last: a valid fine-tune of the good folder trains one step and exports.
    argvs = [_argv(overrides) for _, overrides, _ in CASES] + [_argv(["--model_name_or_path", "models/ok"])]
    (workspace / "cases.json").write_text(json.dumps(argvs))
    (workspace / "driver.py").write_text(DRIVER)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "driver.py", "cases.json"],
        env=_env(workspace),
        cwd=workspace,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    print(f"{len(argvs)} cases through cli.main in {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    return json.loads(line[len("RESULTS ") :])


def test_the_valid_control_trains(outcomes, workspace):
    control = outcomes[-1]
    assert control["code"] == 0, control["stderr"][-3000:]
    assert (workspace / "out-finetune" / "model.safetensors").exists()


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case[0] for case in CASES])
def test_a_bad_input_is_one_error_line_naming_its_cause_and_exit_2(outcomes, index):
    name, _, words = CASES[index]
    outcome = outcomes[index]
    stderr = outcome["stderr"]
    assert "Traceback" not in stderr, (name, stderr[-3000:])
    assert outcome["code"] == 2, (name, outcome["code"], stderr[-2000:])
    errors = [line for line in stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, (name, stderr[-2000:])
    for word in words:
        assert word in errors[0], (name, word, errors[0])
    assert SECRET not in stderr + outcome["stdout"]  # no value of a token option is ever echoed


def test_on_every_rank_of_a_launch(workspace):
    """Two worker processes of one launch (rank 0 hosts the store, no agent to stop the other): the empty
    file is found by rank 0 as it trains the tokenizer, and by rank 1 from the same documents; each rank
    prints its own line and exits 2."""
    from hf_noloco.engine.comm import free_port

    port = free_port()
    procs = []
    argv = [
        sys.executable,
        TRAIN,
        "recipe.yaml",
        "--dataset_name",
        "data/empty.jsonl",
        "--output_dir",
        "out2",
    ]
    argv += ["--pipeline_stages", "2", "--outer_optimizer", "local"]
    started = time.monotonic()
    for rank in range(2):
        env = dict(_env(workspace), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="2")
        procs.append(subprocess.Popen(argv, env=env, cwd=workspace, stderr=subprocess.PIPE, text=True))
    outputs = [(p.communicate(timeout=240)[1], p.returncode) for p in procs]
    print(f"2-rank launch: {time.monotonic() - started:.1f} s")
    for rank, (stderr, code) in enumerate(outputs):
        assert code == 2 and "Traceback" not in stderr, (rank, code, stderr[-3000:])
        errors = [line for line in stderr.splitlines() if line.startswith("error")]
        assert errors == [
            f"error (rank {rank} of 2): The dataset 'data/empty.jsonl' is empty: empty.jsonl holds no rows."
        ]
