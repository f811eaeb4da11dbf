"""recipes/launch.slurm under a real Slurm: a cluster of this host's own (tests/helpers/slurm.py), a tiny
NoLoCo recipe on CPU processes, and a job that is requeued once it has saved a checkpoint. The requeued job
must come back by itself, resume from the newest checkpoint the first run left (the one its workers wrote on
SIGTERM) and end as a full run: every step logged once, the last checkpoint at max_steps, the export written.

    two nodes (two slurmd on this host), 2 processes each, `scontrol requeue`
    one node running two tasks ("machines": machines are tasks), 1 process each, USR1 to the batch shell
        (what `--signal=B:USR1@300` sends before the time limit), which requeues the job itself

Skipped where Slurm is not installed or cannot start (CI installs nothing by hand): `apt-get install
slurm-wlm`. The command lines the script builds and its refusals are also checked without Slurm, with
stand-ins for srun, scontrol and the launcher (`fake_slurm_bin`).
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml
from safetensors.torch import load_file

from hf_noloco.launch.local_launch import free_port
from tests.helpers.paths import ROOT
from tests.helpers.slurm import ENDED, SlurmUnavailable, fake_slurm_bin, slurm_cluster
from tests.helpers.tiny_models import RECIPE_MODEL

LAUNCH = os.path.join(ROOT, "recipes", "launch.slurm")
MULTI_NODE = os.path.join(ROOT, "recipes", "accelerate_configs", "multi_node.yaml")
# Steps take a few tens of milliseconds: enough of them that the first run is still training when the requeue
# lands after its first checkpoint.
MAX_STEPS = 160
SAVE_STEPS = 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    stack = contextlib.ExitStack()
    try:
        running = stack.enter_context(slurm_cluster(tmp_path_factory.mktemp("slurm")))
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm cluster here: {exc}")
    with stack:
        yield running


def _recipe(tmp, pipeline_stages: int):
    from pydoc_data.topics import topics

    (tmp / "corpus.txt").write_text("\n\n".join(topics[k] for k in sorted(topics)[:12]))
    settings = {
        "model_config": dict(RECIPE_MODEL),
        "tokenizer_vocab_size": 300,
        "max_length": 32,
        "dataset_name": str(tmp / "corpus.txt"),
        "pipeline_stages": pipeline_stages,
        "outer_optimizer": "noloco",
        "inner_steps": 3,
        "routing": "sample",
        "per_device_train_batch_size": 4,
        "microbatch_size": 2,
        "learning_rate": 3.0e-3,
        "max_steps": 10 * MAX_STEPS,  # the job's --max_steps override must win
        "logging_steps": 1,
        "eval_strategy": "no",
        "save_strategy": "steps",
        "save_steps": SAVE_STEPS,
        "seed": 7,
        "report_to": "none",
        "disable_tqdm": True,
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


def _job_env(cluster, tmp, procs_per_node: int) -> dict:
    env = cluster.env(
        PROCS_PER_NODE=str(procs_per_node),  # no GPUs: CPU processes
        ACCELERATE_LAUNCH=f"{sys.executable} -m accelerate.commands.launch",
        ACCELERATE_ARGS="--mixed_precision no",  # the config's bf16 is meant for GPUs
        MAIN_PROCESS_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "datasets"),
        TMPDIR=str(tmp),
        GLOO_SOCKET_IFNAME="lo",
    )
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(var, None)
    return env


def _checkpoints(out) -> dict[int, int]:
    """Finished checkpoints (a save in progress is a tmp- folder) by step, with their modification times."""
    found = {}
    for path in out.glob("checkpoint-*"):
        if re.fullmatch(r"checkpoint-\d+", path.name):
            found[int(path.name.split("-")[1])] = (path / "trainer_state.json").stat().st_mtime_ns
    return found


def _wait_for_checkpoint(cluster, job_id, out, log, timeout=180.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):  # a folder renamed as it is read
            if found := _checkpoints(out):
                return min(found)
        state = cluster.job(job_id)["JobState"]
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"job {job_id} {state}:\n{_tail(log)}"
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint after {timeout} s:\n{_tail(log)}\n{cluster.logs()}")


def _tail(log, lines=60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def _run_requeued(cluster, tmp, sbatch_args, procs_per_node, pipeline_stages, interrupt):
    """Submits launch.slurm, calls ``interrupt(job_id)`` once the job has saved a checkpoint, lets the
    requeued job start without Slurm's hold of requeued jobs (about 2 minutes) and waits for its end."""
    recipe, out, log = _recipe(tmp, pipeline_stages), tmp / "out", tmp / "job.out"
    job_id = cluster.sbatch(
        [
            *sbatch_args,
            "--gres=none",  # the header's gpu:8: this cluster has no GPUs
            f"--output={log}",
            LAUNCH,
            str(recipe),
            MULTI_NODE,
            "--output_dir",
            str(out),
            "--max_steps",
            str(MAX_STEPS),
        ],
        env=_job_env(cluster, tmp, procs_per_node),
        cwd=ROOT,
    )
    first_seen = _wait_for_checkpoint(cluster, job_id, out, log)
    interrupt(job_id)
    try:
        cluster.wait_for(job_id, {"PENDING"}, timeout=120, fail=ENDED)
    except (AssertionError, TimeoutError) as exc:
        raise AssertionError(f"{exc}; the job was not requeued:\n{_tail(log)}") from None
    left = _checkpoints(out)  # what the first run left: its processes have all ended
    cluster.command("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    job = cluster.wait_for(job_id, ENDED, timeout=240)
    return job_id, job, first_seen, left, out, log.read_text(errors="replace")


def _check_resumed(job_id, job, first_seen, left, out, text, machines, procs_per_node, stage_dirs):
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), text[-4000:]
    attempts = re.split(rf"^launch\.slurm: job {job_id}, restart (\d+): ", text, flags=re.M)[1:]
    assert [attempts[0], attempts[2]] == ["0", "1"] and len(attempts) == 4, text[-4000:]
    first, second = attempts[1], attempts[3]
    for attempt in (first, second):
        assert attempt.startswith(f"{machines} machines x {procs_per_node} processes on ")
        assert "--resume_from_checkpoint auto" in attempt.splitlines()[1]
    assert "resume_from_checkpoint=auto: no checkpoint yet, from step 0." in first
    newest = max(left)
    # Saved on SIGTERM, at a step boundary after the periodic checkpoint that triggered the requeue.
    assert first_seen < newest < MAX_STEPS
    assert re.search(rf"SIGTERM: .*checkpoint-{newest}\b", first), first[-4000:]
    resumed = re.findall(r"resume_from_checkpoint=auto: resuming (\S+)\.$", second, flags=re.M)
    assert resumed == [str(out / f"checkpoint-{newest}")], second[-4000:]
    after = _checkpoints(out)
    assert {step: after[step] for step in left} == left  # the second run rewrote none of the first run's
    assert sorted(after) == sorted({*left, *range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS)})
    final = out / f"checkpoint-{MAX_STEPS}"
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["global_step"] == MAX_STEPS
    assert [h["step"] for h in state["log_history"] if "loss" in h] == list(range(1, MAX_STEPS + 1))
    assert sorted(p.name for p in final.glob("stage-*-replica-*")) == stage_dirs
    export = load_file(out / "model.safetensors")
    assert "lm_head.weight" in export and "model.embed_tokens.weight" in export
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_two_nodes_requeued_job_resumes_its_newest_checkpoint(cluster, tmp_path):
    """Two nodes x 2 processes = world 4 (2 stages x 2 replicas), requeued with `scontrol requeue`."""
    requeue = lambda job_id: cluster.command("scontrol", "requeue", str(job_id))
    result = _run_requeued(cluster, tmp_path, ["--nodes", "2"], 2, 2, requeue)
    stage_dirs = ["stage-0-replica-0", "stage-0-replica-1", "stage-1-replica-0", "stage-1-replica-1"]
    _check_resumed(*result, machines=2, procs_per_node=2, stage_dirs=stage_dirs)
    assert "on node[1-2], rendezvous at 127.0.0.1:" in result[-1]


def test_two_tasks_on_one_node_requeue_themselves_on_usr1(cluster, tmp_path):
    """One node running two tasks, each a machine of 1 process (world 2: 1 stage x 2 replicas); the batch
    shell gets USR1 as `--signal=B:USR1@300` sends it before the time limit, and requeues the job."""
    usr1 = lambda job_id: cluster.command("scancel", "--batch", "--signal=USR1", str(job_id))
    sbatch_args = ["--nodes", "1", "--ntasks", "2", "--ntasks-per-node", "2"]
    result = _run_requeued(cluster, tmp_path, sbatch_args, 1, 1, usr1)
    _check_resumed(
        *result, machines=2, procs_per_node=1, stage_dirs=["stage-0-replica-0", "stage-0-replica-1"]
    )
    text = result[-1]
    assert f"launch.slurm: time limit near, requeueing job {result[0]}" in text
    assert re.search(r"^launch\.slurm: job \d+, restart 0: 2 machines x 1 processes on node[12],", text, re.M)


# ------------------------------------------------------------------------------------ without Slurm

RECIPE = "recipes/llama-tiny/noloco.yaml"
CONFIG = "recipes/accelerate_configs/multi_node.yaml"


def _fake_job_env(tmp, **settings) -> dict:
    """What Slurm gives the batch shell of a 2-node job with 8 GPUs per node, with fake Slurm commands."""
    bin_dir = fake_slurm_bin(tmp / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    for var in ("PROCS_PER_NODE", "MAIN_PROCESS_IP", "MAIN_PROCESS_PORT", "MAX_RESTARTS", "ACCELERATE_ARGS"):
        env.pop(var, None)
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        FAKE_SLURM=str(tmp),
        FAKE_HOSTS="gpu-a gpu-b",
        FAKE_NODE_ADDR="127.0.0.7",
        ACCELERATE_LAUNCH=str(bin_dir / "launcher"),
        SLURM_JOB_ID="1234",
        SLURM_JOB_NODELIST="gpu-[a-b]",
        SLURM_NTASKS="2",
        SLURM_TASKS_PER_NODE="1(x2)",
        SLURM_CPUS_ON_NODE="96",
        SLURM_GPUS_ON_NODE="8",
    )
    env.update(settings)
    return {k: v for k, v in env.items() if v is not None}


def _launch(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", LAUNCH, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("settings", "launch_args", "cpus_per_task"),
    [
        # 2 nodes x 8 GPUs: the first node's NodeAddr, the job's port, all of a node's CPUs for its launcher
        (
            {},
            [
                "--num_machines", "2", "--num_processes", "16", "--main_process_ip", "127.0.0.7",
                "--main_process_port", "21234", "--rdzv_backend", "c10d", "--max_restarts", "3",
            ],
            "96",
        ),
        # 2 tasks on one node, CPU processes, every knob set; each task gets half of the node's CPUs
        (
            {
                "SLURM_TASKS_PER_NODE": "2", "SLURM_CPUS_ON_NODE": "2", "SLURM_GPUS_ON_NODE": None,
                "PROCS_PER_NODE": "1", "MAIN_PROCESS_IP": "127.0.0.1", "MAIN_PROCESS_PORT": "29555",
                "MAX_RESTARTS": "0", "ACCELERATE_ARGS": "--mixed_precision no",
            },
            [
                "--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
                "--main_process_port", "29555", "--rdzv_backend", "c10d", "--max_restarts", "0",
                "--mixed_precision", "no",
            ],
            "1",
        ),
    ],
    ids=["two-gpu-nodes", "two-tasks-on-one-node"],
)  # fmt: skip
def test_launch_slurm_builds_one_launch_per_task(tmp_path, settings, launch_args, cpus_per_task):
    done = _launch(_fake_job_env(tmp_path, **settings), RECIPE, CONFIG, "--max_steps", "50", "--seed", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert (tmp_path / f"launch-{rank}").read_text().splitlines() == [
            "--machine_rank", str(rank),
            "--rdzv_conf", f"is_host={int(rank == 0)}",  # task 0 hosts the rendezvous
            "--config_file", CONFIG,
            *launch_args,
            "recipes/train.py", RECIPE, "--max_steps", "50", "--seed", "3",
            "--resume_from_checkpoint", "auto",
        ]  # fmt: skip
    assert (tmp_path / "srun-args").read_text().splitlines()[0] == "--kill-on-bad-exit=1"
    assert (tmp_path / "srun-cpus-per-task").read_text().strip() == cpus_per_task
    assert not (tmp_path / "scontrol-calls").exists()  # no requeue without USR1


def test_launch_slurm_refuses_what_it_cannot_run(tmp_path):
    same_network = tmp_path / "same-network.yaml"
    same_network.write_text("distributed_type: MULTI_GPU\nsame_network: true\n")
    env = _fake_job_env(tmp_path)
    cases = [
        (env, [], "usage: sbatch"),
        (env, ["missing.yaml", CONFIG], "missing.yaml does not exist"),
        (env, [RECIPE, str(same_network)], "same_network: true"),
        (env, [RECIPE, CONFIG, "--resume_from_checkpoint", "true"], "always passes --resume_from_checkpoint"),
        (env, [RECIPE, CONFIG, "--resume_from_checkpoint=true"], "always passes --resume_from_checkpoint"),
        (_fake_job_env(tmp_path, SLURM_NTASKS=None), [RECIPE, CONFIG], "not inside a Slurm job"),
        (_fake_job_env(tmp_path, SLURM_GPUS_ON_NODE=None), [RECIPE, CONFIG], "set PROCS_PER_NODE"),
    ]
    for case_env, args, message in cases:
        done = _launch(case_env, *args)
        assert (done.returncode, message in done.stderr) == (2, True), (args, done.stderr)
    assert not list(tmp_path.glob("launch-*"))  # nothing was launched
