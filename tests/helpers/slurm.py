"""A throwaway Slurm cluster on this host, for tests/e2e/test_slurm.py: munged, slurmctld and one slurmd per
node, every file of theirs (config, key, state, spool, logs) in one folder, every address on loopback.

Several slurmd on one host stand for several nodes (``slurmd -N name``, which Debian's build allows). The
daemons run as root, as slurmd must to start jobs. :func:`slurm_cluster` raises :class:`SlurmUnavailable`
(the test skips) when Slurm is not installed, this is not root, or the daemons do not come up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from hf_noloco.launch.local_launch import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo")
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"})  # job states


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; the message says why."""


class SlurmCluster:
    """The cluster's files live under ``root``; :meth:`env` is the environment its commands need."""

    def __init__(self, root: Path, nodes: tuple[str, ...], cpus: int):
        self.root, self.nodes, self.cpus = root, nodes, cpus
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge.sock"
        self.daemons: dict[str, subprocess.Popen] = {}

    def env(self, **extra) -> dict:
        env = dict(os.environ, SLURM_CONF=str(self.conf), **extra)
        for var in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SRUN_")) and v != "SLURM_CONF"]:
            del env[var]  # a test run inside a Slurm job must not pass that job's settings to these jobs
        return env

    def command(self, *args: str, timeout: float = 30) -> str:
        done = subprocess.run(
            args, env=self.env(), capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode:
            raise RuntimeError(f"{' '.join(args)} exited with {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, args: list[str], env: dict, cwd: str) -> int:
        done = subprocess.run(
            ["sbatch", "--parsable", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
        )
        if done.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} exited with {done.returncode}: {done.stderr}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a mapping (finished jobs stay visible for MinJobAge, 300 s)."""
        fields = {}
        for item in self.command("scontrol", "show", "job", "--oneliner", str(job_id)).split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_for(
        self, job_id: int, states: set[str], timeout: float, fail: frozenset[str] = frozenset(), poll=0.25
    ) -> dict[str, str]:
        """The job's record once its state is one of ``states``; AssertionError at once in one of ``fail``."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["JobState"] in states:
                return job
            if job["JobState"] in fail:
                raise AssertionError(f"job {job_id} ended {job['JobState']} (exit code {job['ExitCode']})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['JobState']} after {timeout} s, not in {states}")
            time.sleep(poll)

    def logs(self) -> str:
        """The daemons' logs' tails, for a failure message."""
        tails = []
        for path in sorted(self.root.glob("*.log")):
            tails.append(f"== {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(tails)

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn(
            "munged",
            "munged",
            "--foreground",
            "--force",  # root and a key outside /etc/munge
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={self.root / 'munged.pid'}",
            f"--log-file={self.root / 'munged.log'}",
            f"--seed-file={self.root / 'munged.seed'}",
        )
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged to create its socket")
        self._write_conf()
        self._spawn("slurmctld", "slurmctld", "-D", "-i", "-f", str(self.conf))
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True)
            self._spawn(f"slurmd-{node}", "slurmd", "-D", "-N", node, "-f", str(self.conf))

        def idle():
            states = self.command("sinfo", "--noheader", "--Node", "--format=%N %T").split("\n")
            return sorted(line.split()[0] for line in states if line.endswith(" idle")) == sorted(self.nodes)

        self._wait(idle, timeout, f"the nodes {', '.join(self.nodes)} to be idle")

    def _spawn(self, name: str, *cmd: str) -> None:
        with open(self.root / f"{name}.out", "w") as out:
            self.daemons[name] = subprocess.Popen(
                cmd, env=self.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {proc.returncode}:\n{self.logs()}")
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                if ready():
                    return
            time.sleep(0.25)
        raise SlurmUnavailable(f"timed out waiting for {what}:\n{self.logs()}")

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        state = self.root / "state"
        state.mkdir()
        lines = [
            "ClusterName=noloco-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd'}-%n.pid",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'slurmd'}-%n.log",
            # No cgroups (none in a container, and none needed): processes are tracked by their parents.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "ReturnToService=2",
            "JobRequeue=0",  # only the jobs that ask for it (launch.slurm's --requeue) are requeued
        ]
        # Each node is one slurmd on this host, on a port of its own, reached over loopback.
        lines += [
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={self.cpus}"
            for node in self.nodes
        ]
        lines.append(f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def stop(self, timeout: float = 60) -> None:
        """Cancels every job, waits for their processes to end, stops the daemons; anything still running
        that this cluster started (found by its SLURM_CONF) is killed."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.command("scancel", "--partition=test")
                deadline = time.monotonic() + timeout
                while self.command("squeue", "--noheader").strip() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for name in sorted(self.daemons, key=lambda n: n == "munged"):  # munged last: the others use it
            proc = self.daemons[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for pid in self._leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _leftovers(self) -> list[int]:
        """Processes started by this cluster (slurmstepd and the jobs' processes carry its SLURM_CONF)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
        return pids


def check_available() -> None:
    """Raises :class:`SlurmUnavailable` when this host cannot run a cluster."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if missing:
        raise SlurmUnavailable(f"Slurm is not installed (no {', '.join(missing)}; apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd must run as root to start jobs, and this is not root")


@contextlib.contextmanager
def slurm_cluster(root: Path, nodes: tuple[str, ...] = ("node1", "node2"), cpus: int = 2):
    """A running cluster of ``nodes`` (each with ``cpus`` CPUs) in ``root``; stopped and removed on exit."""
    check_available()
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)  # munged refuses a key in a folder others may write to
    cluster = SlurmCluster(root, nodes, cpus)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


# Stand-ins for the Slurm commands launch.slurm calls, to check the command lines it builds without Slurm.
# srun runs its command once per task, one after the other, with that task's SLURM_PROCID.
_FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_SLURM/srun-args"
echo "${SRUN_CPUS_PER_TASK:-}" > "$FAKE_SLURM/srun-cpus-per-task"
while [[ $1 == --* ]]; do shift; done
for ((task = 0; task < SLURM_NTASKS; task++)); do
    SLURM_PROCID=$task "$@" || exit $?
done
"""
_FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") printf '%s\\n' $FAKE_HOSTS ;;
    "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=48 NodeAddr=$FAKE_NODE_ADDR NodeHostName=$3" ;;
    *) echo "fake scontrol: $*" >> "$FAKE_SLURM/scontrol-calls" ;;
esac
"""
# The launcher: each task's arguments, one a line.
_FAKE_LAUNCHER = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_SLURM/launch-$SLURM_PROCID"
"""


def fake_slurm_bin(folder: Path) -> Path:
    """A folder holding fake ``srun``, ``scontrol`` and launcher (``launcher``), which record what they are
    given in ``$FAKE_SLURM``; put it first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL), ("launcher", _FAKE_LAUNCHER)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder
