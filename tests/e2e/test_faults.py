"""Fault injection on real processes (gloo, CPU): a rank killed mid-step, mid-outer-sync and mid-checkpoint,
a hung rank, and non-finite losses/gradients. Each run is tests/fault_train.py (2 stages x 2 replicas, 8
steps, checkpoints at 4 and 8, outer steps after 3 and 6); ranks: 0 = stage 0 replica 0, 1 = stage 1
replica 0, 2 = stage 0 replica 1, 3 = stage 1 replica 1.

Two ways to start the ranks:
- ``launch``: processes forked from this one (cheap: no imports), without any launcher agent, so that only
  our own detection can stop the survivors; the rendezvous store lives in this process, as it lives in the
  agent under torchrun/accelerate.
- ``launch_processes``/torchrun: separate ``python`` processes, as users start them.
"""

import glob
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.fault_runs import FAULT_TRAIN, WORLD, _results, _state, launch, launch_processes

P2P_TIMEOUT = 3.0
DETECT_MARGIN = 10.0  # the lost-peer diagnosis (1.5 s) on a 2-core machine at load 10
EXIT_MARGIN = 40.0  # Python's exit after the error (2-3 s on a quiet machine)
DESCRIBE = {r: f"rank {r} (stage {r % 2}, replica {r // 2})" for r in range(WORLD)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: every fault below is compared with it."""
    out = tmp_path_factory.mktemp("reference")
    codes, _, logs, results = launch(out)
    assert codes == [0] * WORLD, logs
    return out, results


def raised_at(log):
    """When the training code of a rank gave up (the monotonic clock is the machine's, as in this process)."""
    return float(re.findall(r"run\(\) returned at monotonic ([0-9.]+)", log)[-1])


def assert_survivors_name_the_victim(codes, times, logs, victim):
    assert codes[victim] == -signal.SIGKILL, (codes, logs[victim][-2000:])
    killed_at = times[victim]  # within 50 ms
    for r in range(WORLD):
        if r == victim:
            continue
        assert codes[r] == 1, (r, codes, logs[r][-3000:])
        # Closed connections are seen at once; a rank waiting on a survivor that is failing may wait
        # p2p_timeout.
        assert raised_at(logs[r]) - killed_at < P2P_TIMEOUT + DETECT_MARGIN, (
            r,
            raised_at(logs[r]),
            killed_at,
        )
        assert times[r] - raised_at(logs[r]) < EXIT_MARGIN  # and then the process ends: no hang at exit
        assert DESCRIBE[victim] in logs[r].split("PeerError: ")[-1], (r, logs[r][-3000:])


def assert_resume_reproduces(reference, out):
    """Resuming the faulty run's output_dir (the last complete checkpoint) ends where the reference ended.
    Returns the resumed run's logs."""
    codes, _, logs, resumed = launch(out, RESUME="1")
    assert codes == [0] * WORLD, logs
    assert_same_as_reference(reference, resumed)
    return logs


def assert_same_as_reference(reference, resumed):
    """The losses of steps 1-8 (1-4 from the checkpoint's trainer state), the outer steps and the final
    weights of every rank are the uninterrupted run's, bit for bit."""
    _, straight = reference
    for r in range(WORLD):
        assert resumed[r]["losses"] == straight[r]["losses"]  # steps 1-4 from the checkpoint, 5-8 recomputed
        assert sorted(resumed[r]["losses"]) == list(range(1, 9))
        assert resumed[r]["outer_steps"] == straight[r]["outer_steps"] == 2
        for name, tensor in straight[r]["weights"].items():
            assert torch.equal(resumed[r]["weights"][name], tensor), (r, name)


def _digest(folder):
    return {
        os.path.relpath(f, folder): hashlib.sha256(open(f, "rb").read()).hexdigest()
        for f in sorted(glob.glob(os.path.join(folder, "**", "*"), recursive=True))
        if os.path.isfile(f)
    }


def _checkpoint_weights(folder):
    return {p: d for p, d in _digest(folder).items() if p.endswith(("model.safetensors", "optimizer.pt"))}


# ------------------------------------------------------------------------------------------ killed ranks


def test_rank_killed_mid_step_stops_every_process_and_resume_reproduces(tmp_path, reference):
    """Plain processes, no agent: the survivors' own waits find the dead peer (and exit: no hang at exit)."""
    out = tmp_path / "run"
    codes, times, logs = launch_processes(out, FAULT="kill-step:6:1")
    assert_survivors_name_the_victim(codes, times, logs, victim=1)
    assert sorted(n for n in os.listdir(out) if "checkpoint" in n) == ["checkpoint-4"]
    assert _checkpoint_weights(out / "checkpoint-4") == _checkpoint_weights(reference[0] / "checkpoint-4")
    assert_resume_reproduces(reference, out)


def test_rank_killed_mid_outer_sync(tmp_path, reference):
    out = tmp_path / "run"
    codes, times, logs, _ = launch(out, FAULT="kill-outer:6:2")
    assert_survivors_name_the_victim(codes, times, logs, victim=2)
    # Its partner was waiting for its weights in the same outer step.
    assert f"NoLoCo outer step 1 of {DESCRIBE[0]}: failed receiving from {DESCRIBE[2]}" in logs[0], logs[0][
        -3000:
    ]
    assert_resume_reproduces(reference, out)


def test_rank_killed_mid_checkpoint_leaves_the_previous_one(tmp_path, reference):
    out = tmp_path / "run"
    codes, times, logs, _ = launch(out, FAULT="kill-save:8:3")
    assert_survivors_name_the_victim(codes, times, logs, victim=3)
    names = sorted(n for n in os.listdir(out) if "checkpoint" in n)
    assert names == ["checkpoint-4", "tmp-checkpoint-8"]  # the half-written one keeps its temporary name
    assert not os.path.exists(out / "tmp-checkpoint-8" / "stage-1-replica-1" / "optimizer.pt")
    assert_resume_reproduces(reference, out)  # resumes from checkpoint-4, never from the half-written 8


def torchrun(out, *launcher_args, timeout=150, launcher=("-m", "torch.distributed.run"), **env):
    """``torchrun <launcher_args> fault_train.py out``; returns the finished process (output captured)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(out.parent), PYTHONUNBUFFERED="1", **env)
    command = [sys.executable, *launcher, *launcher_args]
    return subprocess.run(
        [*command, FAULT_TRAIN, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=out.parent,
        check=False,
    )


# Restarts under --max-restarts (torchrun's c10d rendezvous and accelerate's static one, two machines each)
# are tests/e2e/test_multinode.py's.


# ------------------------------------------------------------------------------------------- SIGTERM


def _preempted_step(text):
    """The step every rank saved and stopped at (the same on every rank: each rank logs it)."""
    steps = {int(n) for n in re.findall(r"SIGTERM: checkpoint-(\d+) written", text)}
    assert len(steps) == 1, text[-5000:]
    return steps.pop()


def test_sigterm_to_the_launcher_checkpoints_and_the_same_command_resumes_bit_identical(tmp_path, reference):
    """As Slurm preempts a job: SIGTERM to torchrun, which forwards it to every worker. They agree on a step,
    save it and exit 143 within the launcher's 30 s of grace; the same command line (resume 'auto') ends as
    the uninterrupted run did, bit for bit."""
    out = tmp_path / "run"
    out.mkdir()
    args = ["--standalone", "--nproc_per_node", str(WORLD)]
    proc = torchrun(out, *args, timeout=300, RESUME="auto", FAULT="sigterm-agent:5:1")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-5000:]  # the job did not finish: a scheduler must not read success
    [signalled] = re.findall(r"SIGTERM to pid \d+ at monotonic ([0-9.]+)", text)
    step = _preempted_step(text)
    assert 5 <= step < 8, text[-5000:]
    assert text.count("fault_train: preempted after step") == WORLD
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == [
        "checkpoint-4",
        f"checkpoint-{step}",
    ]
    latency = [float(t) for t in re.findall(r"written ([0-9.]+) s after the signal", text)]
    print(f"SIGTERM at monotonic {signalled}: checkpoint-{step} written {max(latency):.2f} s after it")
    assert len(latency) == WORLD and max(latency) < 30, latency  # within torchrun's (and Slurm's) grace
    assert not _results(out)  # no rank wrote final results: training stopped before max_steps
    # The requeued job: the same run, resume 'auto' (its ranks forked: torchrun's start-up is tested above)
    codes, _, logs, resumed = launch(out, RESUME="auto")
    assert codes == [0] * WORLD, logs
    assert f"resume_from_checkpoint=auto: resuming {out}/checkpoint-{step}." in logs[0]
    assert_same_as_reference(reference, resumed)


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """A signal that reaches one worker only (no agent forwards it): the flag it raises stops the others
    at the same step, every rank exits 143, and that step's checkpoint is complete."""
    out = tmp_path / "run"
    codes, _, logs, _ = launch(out, RESUME="auto", FAULT="sigterm-self:3:2")
    assert codes == [143] * WORLD, (codes, [log[-2000:] for log in logs])
    step = _preempted_step(logs[2])
    assert step in (3, 4), logs[2][-3000:]  # raised during step 3: saved after step 3 or 4
    for log in logs:
        assert f"preempted after step {step}" in log, log[-3000:]
    assert (out / f"checkpoint-{step}" / "noloco_checksums.json").exists()  # complete: every rank wrote


def test_torchrun_ends_the_whole_job_when_a_rank_is_killed(tmp_path):
    """What a user sees: the launcher's job ends non-zero and fast, the lost rank is named, nothing left."""
    out = tmp_path / "run"
    out.mkdir()
    env = dict(
        os.environ,
        FAULT="kill-step:3:3",
        OMP_NUM_THREADS="1",
        TMPDIR=str(tmp_path),
        PYTHONUNBUFFERED="1",
        P2P_TIMEOUT="120",
    )  # a long timeout: the agent, not our detection, ends this job
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(WORLD),
            FAULT_TRAIN,
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
        check=False,
    )
    ended = time.monotonic()
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert re.search(r"rank\s*: 3 \(local_rank: 3\)", text) and "Signal 9 (SIGKILL)" in text, text[-3000:]
    [killed_at] = re.findall(r"sending SIGKILL to myself at monotonic ([0-9.]+)", text)
    assert ended - float(killed_at) < 60, (ended, killed_at)  # the agent's SIGTERM, then Python's exit
    for r in range(WORLD):
        pid = int((out / f"pid-rank{r}").read_text())
        assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z", r  # gone (or a zombie being reaped)


# ----------------------------------------------------------------------------------- damaged checkpoints


def _copy_of_reference(reference, out):
    """The reference run's output_dir (checkpoints 4 and 8), without its logs and results."""
    shutil.copytree(
        reference[0], out, ignore=shutil.ignore_patterns("log-rank*", "result-rank*", "pid-rank*")
    )


def _truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def _flip_one_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x08  # deep inside the tensors: the file still parses
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, victim, reason",
    [
        (
            _truncate,
            "stage-1-replica-1/model.safetensors",
            r"\d+ bytes, the checksum record says \d+ \(truncated\)",
        ),
        (
            _flip_one_bit,
            "stage-0-replica-1/optimizer.pt",
            r"its SHA-256 differs from the checksum record \(the content changed\)",
        ),
    ],
    ids=["truncated", "bit-flipped"],
)
def test_damaged_newest_checkpoint_is_named_skipped_and_the_previous_resumes_exactly(
    tmp_path, reference, damage, victim, reason
):
    out = tmp_path / "run"
    _copy_of_reference(reference, out)
    damage(out / "checkpoint-8" / victim)
    logs = assert_resume_reproduces(reference, out)  # from checkpoint-4: steps 5-8 recomputed, bit for bit
    skipped = re.compile(rf"Skipping {re.escape(str(out))}/checkpoint-8: checkpoint-8/{victim}: {reason}\.")
    for r in range(WORLD):  # every rank says why, though only the victim's owner read the file
        assert skipped.search(logs[r]), (r, logs[r][-3000:])
        assert f"Resuming from {out}/checkpoint-4, the newest checkpoint that verifies" in logs[r]
    # The damaged checkpoint is kept aside, out of the rotation; the run wrote a new, intact checkpoint-8.
    assert sorted(n for n in os.listdir(out) if "checkpoint" in n) == [
        "checkpoint-4",
        "checkpoint-8",
        "skipped-checkpoint-8",
    ]
    assert _checkpoint_weights(out / "checkpoint-8") == _checkpoint_weights(reference[0] / "checkpoint-8")


def test_damaged_explicit_checkpoint_is_a_one_line_error_on_every_rank_before_training(tmp_path, reference):
    """Only rank 3 reads the damaged file, yet every rank refuses: none may train while another refuses."""
    out = tmp_path / "run"
    _copy_of_reference(reference, out)
    _truncate(out / "checkpoint-4" / "stage-1-replica-1" / "pipeline.pt")
    codes, _, logs, _ = launch(out, RESUME=str(out / "checkpoint-4"))
    assert codes == [1] * WORLD, logs
    error = (
        f"ValueError: Cannot resume {out}/checkpoint-4: checkpoint-4/stage-1-replica-1/pipeline.pt: "
        "{} bytes, the checksum record says {} (truncated)"
    )
    size = (out / "checkpoint-4" / "stage-1-replica-1" / "pipeline.pt").stat().st_size
    written = (reference[0] / "checkpoint-4" / "stage-1-replica-1" / "pipeline.pt").stat().st_size
    for r in range(WORLD):
        assert error.format(size, written) + "\n" in logs[r], (r, logs[r][-3000:])
        assert "'loss'" not in logs[r]  # no rank trained a step
    assert _checkpoint_weights(out / "checkpoint-8") == _checkpoint_weights(reference[0] / "checkpoint-8")


# --------------------------------------------------------------------------------------------- hung rank


def test_hung_rank_stops_the_others_within_p2p_timeout(tmp_path):
    """A stopped process keeps its sockets open (like a frozen machine): only timeouts can end the wait, here
    in the step's logging collectives over all ranks, whose process group would otherwise wait 30 minutes."""
    out = tmp_path / "run"
    codes, _, logs, _ = launch(out, FAULT="stop-log:2:3")
    assert codes[3] is None  # stopped, killed by the test
    stopped_at = raised_at(logs[3])  # its on_step_end callback stops it
    for r in range(3):
        assert codes[r] == 1, (r, logs[r][-3000:])
        # The first to time out gives up its connections, so the others may see them close instead.
        assert raised_at(logs[r]) - stopped_at < P2P_TIMEOUT + DETECT_MARGIN
        assert DESCRIBE[3] in logs[r].split("PeerError: ")[-1], (r, logs[r][-3000:])
    assert min(raised_at(logs[r]) for r in range(3)) - stopped_at >= P2P_TIMEOUT  # nobody could know earlier
    assert any("timed out" in logs[r].lower() for r in range(3))


# --------------------------------------------------------------------------------------------- non-finite


def test_nonfinite_loss_stops_the_run_naming_step_stage_and_replica(tmp_path, reference):
    out = tmp_path / "run"
    codes, _, logs, _ = launch(out, FAULT="nan-loss:6:3")
    assert codes == [1] * WORLD, logs
    message = f"Step 6: a non-finite loss (nan) on stage 1, replica 1 ({DESCRIBE[3].split(' (')[0]})"
    for r in (2, 3):  # replica 1's column stops at once with the error
        assert "FloatingPointError: " + message in logs[r], logs[r][-3000:]
    # Replica 0's column: its own error (the NaN's gradients reached it) or the first failure.
    for r in (0, 1):
        assert "Step 6" in logs[r] and "non-finite" in logs[r], logs[r][-3000:]
    # The last good checkpoint is intact and no later one was started.
    assert sorted(n for n in os.listdir(out) if "checkpoint" in n) == ["checkpoint-4"]
    assert _checkpoint_weights(out / "checkpoint-4") == _checkpoint_weights(reference[0] / "checkpoint-4")


def test_nonfinite_gradient_can_skip_the_step(tmp_path, reference):
    out = tmp_path / "run"
    codes, _, logs, results = launch(out, FAULT="nan-grad:5:2", NONFINITE="skip")
    assert codes == [0] * WORLD, logs
    assert (
        "Step 5: non-finite gradients on stage 0, replica 1 (rank 2). Skipping this step on replica 1"
        in logs[2]
    )
    for r in range(WORLD):
        assert results[r]["global_step"] == 8 and results[r]["outer_steps"] == 2  # counters stay aligned
        assert all(torch.isfinite(t).all() for t in results[r]["weights"].values())
    # Replica 1's column (ranks 2, 3) skipped one optimizer step; replica 0's column took all 8.
    assert results[0]["adam_steps"] == results[1]["adam_steps"] == [8]
    assert results[2]["adam_steps"] == results[3]["adam_steps"] == [7]
    assert results[0]["losses"][4] == reference[1][0]["losses"][4]  # before the fault, the same run
