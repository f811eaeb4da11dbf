"""Starting the ranks of a fault-injection run (``fault_train.py``) and collecting what they did.

Two ways to start them:
- :func:`launch`: processes forked from the test (cheap: no imports), without any launcher agent, so that only
  our own detection can stop the survivors; the rendezvous store lives in a process of its own
  (:func:`store_process`), as it lives in the agent under torchrun/accelerate.
- :func:`launch_processes`: separate ``python fault_train.py`` processes, as users start them (rank 0 hosts
  the store).
"""

import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import hf_noloco.trainer  # noqa: F401 - imported once here, inherited by every forked rank
from hf_noloco.engine.comm import free_port
from tests.helpers import fault_train
from tests.helpers.paths import HELPERS

WORLD = 4
FAULT_TRAIN = os.path.join(HELPERS, "fault_train.py")


def _child(rank, world, store_port, out, env):
    gc.freeze()  # the inherited imports stay out of the collector's sight (as in local_launch's ranks)
    os.environ.update(
        env,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
        OMP_NUM_THREADS="1",
    )
    log = os.open(os.path.join(out, f"log-rank{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = sys.stderr = open(log, "w", buffering=1, closefd=False)  # noqa: SIM115 - pytest replaced them
    logging.getLogger().handlers = [logging.StreamHandler()]  # and the root logger's handlers
    store = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        fault_train.run(out)  # an exception prints its traceback into the log and exits with code 1
    finally:
        print(f"fault_train: run() returned at monotonic {time.monotonic():.3f}", flush=True)


def _finish(procs, out, exitcode, deadline):
    """Waits for every process (``exitcode(p)`` or None while it runs) until ``deadline``; returns the exit
    codes, the (monotonic) exit times and the logs; processes still running then (or stopped) are killed and
    reported
    as ``None``."""
    codes, times = [None] * len(procs), [None] * len(procs)
    while time.monotonic() < deadline and not all(
        c is not None or _stopped(p.pid) for c, p in zip(codes, procs)
    ):
        for r, p in enumerate(procs):
            if codes[r] is None and exitcode(p) is not None:
                codes[r], times[r] = exitcode(p), time.monotonic()
        time.sleep(0.05)
    for r in range(len(procs)):
        if codes[r] is None:  # left running or stopped: kill it so that the test machine stays clean
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[r].pid, signal.SIGKILL)
    logs = []
    for r in range(len(procs)):
        path = os.path.join(out, f"log-rank{r}.txt")
        logs.append(Path(path).read_text(errors="replace") if os.path.exists(path) else "")
    return codes, times, logs


def _state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _stopped(pid):
    return _state(pid) == "T"


# The run's store, bound to loopback, proving the run's secret (HF_NOLOCO_RUN_SECRET) as column_launch's does.
_HOST_STORE = (
    "import os, sys, time\n"
    "from hf_noloco.resilience.authentication import host_run_store\n"
    "hosted = host_run_store('127.0.0.1', int(sys.argv[1]), os.environ['HF_NOLOCO_RUN_SECRET'].encode())\n"
    "print('ready', flush=True)\n"
    "time.sleep(3600)\n"
)
# The secret of the runs these helpers start (a test's own: never a real run's).
RUN_SECRET = "fault-runs-test-secret-" + "0123456789abcdef" * 2


@contextlib.contextmanager
def store_process():
    """A store hosted by a process of its own (no worker hosts it, as under an agent), yielding its port. Not
    hosted in this process: forking it while its store's server thread runs can leave a child deadlocked."""
    port = free_port()
    env = dict(os.environ, HF_NOLOCO_RUN_SECRET=RUN_SECRET)
    host = subprocess.Popen(
        [sys.executable, "-c", _HOST_STORE, str(port)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert host.stdout.readline().strip() == "ready"
        os.environ["STORE_PID"] = str(host.pid)  # the ranks forked meanwhile inherit it (FAULT=kill-store)
        os.environ["HF_NOLOCO_RUN_SECRET"] = RUN_SECRET  # and the secret the store proves
        yield port
    finally:
        os.environ.pop("STORE_PID", None)
        os.environ.pop("HF_NOLOCO_RUN_SECRET", None)
        host.kill()
        host.wait()


def launch(out, timeout=90.0, world=WORLD, **env):
    """Forks the ``world`` (4) ranks of one run, around a store of their own (:func:`store_process`); returns
    (exit codes, seconds to each exit, per-rank logs, results)."""
    os.makedirs(out, exist_ok=True)
    with store_process() as port:
        context = multiprocessing.get_context("fork")
        procs = [context.Process(target=_child, args=(r, world, port, str(out), env)) for r in range(world)]
        started = time.monotonic()
        for p in procs:
            p.start()
        codes, times, logs = _finish(procs, str(out), lambda p: p.exitcode, started + timeout)
        for p in procs:
            p.join(5)
    return codes, times, logs, _results(out, world)


def _results(out, world=WORLD):
    return {
        r: torch.load(path, weights_only=False)
        for r in range(world)
        if os.path.exists(path := os.path.join(out, f"result-rank{r}.pt"))
    }


def launch_processes(out, timeout=120.0, **env):
    """The 4 ranks as separate `python fault_train.py` processes, no agent (rank 0 hosts the store)."""
    os.makedirs(out, exist_ok=True)
    port = free_port()
    procs = []
    started = time.monotonic()
    for r in range(WORLD):
        penv = dict(
            os.environ,
            **env,
            RANK=str(r),
            WORLD_SIZE=str(WORLD),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            TMPDIR=str(out),
        )
        with open(os.path.join(out, f"log-rank{r}.txt"), "w") as log:  # the child keeps its own descriptor
            procs.append(
                subprocess.Popen(
                    [sys.executable, FAULT_TRAIN, str(out)],
                    env=penv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=out,
                )
            )
    codes, times, logs = _finish(procs, str(out), lambda p: p.poll(), started + timeout)
    return codes, times, logs
