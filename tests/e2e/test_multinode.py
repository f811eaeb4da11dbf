"""Two machines simulated on one: two launches on loopback, one per "node" (2 processes each, pp=2 x dp=2),
train exactly like one 4-process launch: the same losses, the same weights on every rank, the same export.

Each simulated node gets its own datasets cache, as separate machines would; output_dir is shared, as it must
be
on a real cluster (see recipes/README.md, "Multi-node"). The same recipe is run three times:

    4 local processes (forked, see `one_launch`)                                (the reference)
    torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d ... --max-restarts 1  (a worker killed)
    accelerate launch --config_file recipes/accelerate_configs/multi_node.yaml --num_processes 4
        --num_machines 2 --machine_rank R --main_process_ip ... --main_process_port ...
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from hf_noloco.launch.local_launch import free_port, run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.tiny_models import RECIPE_MODEL

TRAIN = os.path.join(ROOT, "recipes", "train.py")
MULTI_NODE = os.path.join(ROOT, "recipes", "accelerate_configs", "multi_node.yaml")
INJECT = os.path.join(ROOT, "tests", "helpers", "inject")  # sitecustomize.py: the fault of the restart test
STEPS = 6
# Wall-clock figures that legitimately differ between runs; everything else in the logs must be identical.
TIMING_KEYS = {
    "tokens_per_second",
    "trained_tokens_per_second",
    "mfu",
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "eval_runtime",
    "eval_samples_per_second",
    "eval_steps_per_second",
}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    from pydoc_data.topics import topics

    tmp = tmp_path_factory.mktemp("multinode")
    (tmp / "corpus.txt").write_text("\n\n".join(topics[k] for k in sorted(topics)[:12]))
    settings = {
        "model_config": dict(RECIPE_MODEL),
        "tokenizer_vocab_size": 300,
        "max_length": 32,
        "dataset_name": str(tmp / "corpus.txt"),
        "pipeline_stages": 2,
        "outer_optimizer": "noloco",
        "inner_steps": 3,
        "routing": "sample",
        "per_device_train_batch_size": 4,
        "microbatch_size": 2,
        "per_device_eval_batch_size": 8,
        "learning_rate": 3.0e-3,
        "max_steps": STEPS,
        "logging_steps": 1,
        "eval_strategy": "no",
        "save_strategy": "steps",
        "save_steps": STEPS,
        "seed": 7,
        "report_to": "none",
        "disable_tqdm": True,
    }
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    return tmp


def _env(tmp, node: str) -> dict:
    env = dict(
        os.environ,
        TMPDIR=str(tmp),
        OMP_NUM_THREADS="1",
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / f"datasets-{node}"),
    )
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(var, None)
    return env


def _run_together(tmp, commands: dict[str, list[str]], timeout: float = 300, node_env=None) -> None:
    """Starts every command at once (the nodes of one job) and waits for all; on a failure or a timeout the
    others are ended too, since a node whose peer died would wait for it until the rendezvous times out.
    ``node_env``: more environment for some nodes."""
    procs = {}
    for node, cmd in commands.items():
        with open(tmp / f"{node}.log", "w") as log:
            procs[node] = subprocess.Popen(
                cmd,
                env=dict(_env(tmp, node), **(node_env or {}).get(node, {})),
                cwd=tmp,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # its own process group: ended as a whole
    try:
        for proc in procs.values():
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for node, proc in procs.items():
        log = (tmp / f"{node}.log").read_text()
        assert proc.returncode == 0, f"{node} exited with {proc.returncode}:\n{log[-4000:]}"


def _with_inject() -> str:
    return os.pathsep.join(p for p in (INJECT, os.environ.get("PYTHONPATH")) if p)


def _train_command(tmp, output_dir) -> list[str]:
    return [TRAIN, str(tmp / "recipe.yaml"), "--output_dir", str(output_dir)]


def _results(output_dir) -> dict:
    """What a run leaves behind: the exported model, every rank's checkpointed stage, the logged history."""
    checkpoint = output_dir / f"checkpoint-{STEPS}"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    shards = {
        p.parent.name: load_file(p) for p in sorted(checkpoint.glob("stage-*-replica-*/model.safetensors"))
    }
    return {
        "export": load_file(output_dir / "model.safetensors"),
        "shards": shards,
        "history": [
            {k: v for k, v in entry.items() if k not in TIMING_KEYS} for entry in state["log_history"]
        ],
        "config": json.loads((output_dir / "config.json").read_text()),
    }


def _train_in_process(argv):
    from hf_noloco.launch.cli import main

    main(argv)


@pytest.fixture(scope="module")
def one_launch(recipe):
    """The reference: one 4-process job on one machine. Its ranks are forked from this test process (by the
    harness the other multi-process tests use) rather than started by torchrun, which saves each of them the
    ~10 s of importing torch and transformers; what they run is the same `recipes/train.py` main()."""
    out = recipe / "one-launch"
    with pytest.MonkeyPatch.context() as patch:
        for var in ("TMPDIR", "WANDB_MODE", "HF_HUB_OFFLINE", "HF_DATASETS_CACHE"):
            patch.setenv(var, _env(recipe, "single")[var])
        run_distributed(_train_in_process, 4, _train_command(recipe, out)[1:], timeout_s=300)
    return _results(out)


def _assert_same_training(reference: dict, other: dict, resumed: bool = False) -> None:
    """``resumed``: ``other`` resumed a checkpoint; its run summary (the Trainer's mean ``train_loss``) covers
    only the steps it trained itself, so only the per-step entries are compared."""
    history = lambda run: [h for h in run["history"] if not (resumed and "train_loss" in h)]
    assert len(reference["history"]) == STEPS  # a loss logged at every step
    assert [h["loss"] for h in other["history"]] == [h["loss"] for h in reference["history"]]
    assert history(other) == history(reference)  # grad norms, divergence estimates, bytes sent too
    assert (
        sorted(other["shards"])
        == sorted(reference["shards"])
        == ["stage-0-replica-0", "stage-0-replica-1", "stage-1-replica-0", "stage-1-replica-1"]
    )
    for rank_dir, weights in reference["shards"].items():
        for name, tensor in weights.items():
            assert torch.equal(other["shards"][rank_dir][name], tensor), (rank_dir, name)
    assert sorted(other["export"]) == sorted(reference["export"])
    for name, tensor in reference["export"].items():
        assert torch.equal(other["export"][name], tensor), name  # bit for bit
    assert other["config"] == reference["config"]


def test_two_torchrun_nodes_restart_after_a_killed_worker_and_train_like_one_launch(recipe, one_launch):
    """Two `torchrun --nnodes 2` with a c10d rendezvous and `--max-restarts 1`: a worker of node 1 killed at
    step 5 makes both agents restart their workers, which meet again, resume checkpoint-3 by themselves and
    end bit for bit as one uninterrupted launch did."""
    out, port = recipe / "torchrun-2-nodes", free_port()
    rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes"]
    _run_together(
        recipe,
        {
            f"node{rank}": [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "2",
                *rendezvous,
                "--max-restarts",
                "1",
                *_train_command(recipe, out),
                "--save_steps",
                "3",
            ]
            for rank in (0, 1)
        },
        node_env={"node1": {"HF_NOLOCO_TEST_KILL": "5:1", "PYTHONPATH": _with_inject()}},
    )
    logs = "".join((recipe / f"node{rank}.log").read_text() for rank in (0, 1))
    assert "sitecustomize: SIGKILL to myself at step 5" in logs  # the fault struck the first attempt
    assert logs.count("a restart of this job: resuming from the newest intact checkpoint") == 4, logs[-4000:]
    assert f"Restarted job: resuming {out}/checkpoint-3." in logs
    _assert_same_training(one_launch, _results(out), resumed=True)


def test_accelerate_multi_node_config_restarts_after_a_killed_worker_and_trains_like_one_launch(
    recipe, one_launch
):
    """recipes/accelerate_configs/multi_node.yaml as documented (static rendezvous), with `--max_restarts 1`
    on both machines, on a machine without GPUs: the script falls back to gloo on the CPU by itself. A worker
    of machine 1 killed at step 5 makes both launchers restart their workers, which resume checkpoint-3 and
    end bit for bit as one uninterrupted launch. `--mixed_precision no` keeps the comparison with the fp32
    reference exact (the YAML asks for bf16, meant for the GPUs it is written for)."""
    out, port = recipe / "accelerate-2-nodes", free_port()
    _run_together(
        recipe,
        {
            f"node{rank}": [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                MULTI_NODE,
                "--num_processes",
                "4",
                "--num_machines",
                "2",
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                "--mixed_precision",
                "no",
                "--max_restarts",
                "1",
                *_train_command(recipe, out),
                "--save_steps",
                "3",
                # A static rendezvous tells machine 0's launcher nothing: it restarts once its own workers
                # fail, which a worker waiting on the lost one does within p2p_timeout.
                "--p2p_timeout",
                "10",
            ]
            for rank in (0, 1)
        },
        node_env={"node1": {"HF_NOLOCO_TEST_KILL": "5:1", "PYTHONPATH": _with_inject()}},
    )
    logs = "".join((recipe / f"node{rank}.log").read_text() for rank in (0, 1))
    assert "sitecustomize: SIGKILL to myself at step 5" in logs  # the fault struck the first attempt
    assert f"Restarted job: resuming {out}/checkpoint-3." in logs, logs[-4000:]
    _assert_same_training(one_launch, _results(out), resumed=True)
