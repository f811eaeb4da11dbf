"""One launch per replica column, for ``on_replica_loss="continue"``.

torchrun and ``accelerate launch`` stop every worker they started as soon as one fails, which is right for
``on_replica_loss="stop"`` and defeats ``"continue"``. Here each replica column (its ``pipeline_stages``
processes) is a launch of its own, so a lost column takes down nothing but itself; all columns join one
run through a store that no worker hosts::

    # column 0, on the machine that also hosts the store (it serves until every worker of the run is gone)
    python -m hf_noloco.column_launch --store HOST:29400 --host-store --column 0 --columns 4 --stages 2 \\
        recipes/train.py recipes/llama-tiny/noloco.yaml --on_replica_loss continue
    # columns 1, 2, 3, anywhere that reaches HOST
    python -m hf_noloco.column_launch --store HOST:29400 --column 1 --columns 4 --stages 2 \\
        recipes/train.py recipes/llama-tiny/noloco.yaml --on_replica_loss continue

A column the run lost (or one never started) joins the live run with its own launch line plus ``--join``: it
is admitted at a step boundary, copies each stage's state from a live replica, and trains on from the run's
step (:mod:`hf_noloco.resilience.joining`)::

    python -m hf_noloco.column_launch --store HOST:29400 --column 2 --columns 4 --stages 2 --join \\
        recipes/train.py recipes/llama-tiny/noloco.yaml --on_replica_loss continue

The store's host is the one process the run cannot lose: when it goes, every column stops at its next step
with an error naming the store. ``--store-only`` hosts it on a machine of its own (no worker, no GPU), and
then every column, column 0 included, is an ordinary one that the run can lose::

    python -m hf_noloco.column_launch --store HOST:29400 --store-only --columns 4 --stages 2

Each process gets what torchrun would give it (``RANK = column * stages + stage``, ``WORLD_SIZE = columns *
stages``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` = the store) and joins the store as a client
(``TORCHELASTIC_USE_AGENT_STORE=True``), as torchrun's workers join their agent's. The launcher exits with the
first non-zero exit status of its processes (128 + the signal for one killed), else 0.

The store listens on ``--bind`` only (default: the address of ``--store``), and proves the run's secret to
every worker, which refuses to start on a store that cannot (:mod:`hf_noloco.resilience.authentication`).
The store's host generates the secret into ``--secret-file`` (default:
``~/.config/hf_noloco/run-secret-PORT``, readable by its user only) unless ``HF_NOLOCO_RUN_SECRET`` gives
one; every column's launch reads it from the same place (or ``HF_NOLOCO_RUN_SECRET``,
``HF_NOLOCO_RUN_SECRET_FILE``). The secret is never printed, and never on a command line.
``docs/security.md`` says who must be trusted.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from hf_noloco.resilience.joining import JOIN_ENV
from hf_noloco.resilience.run_secret import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    SecretError,
    StoreBindError,
    env_secret,
    new_secret,
    read_secret,
    secret_path,
    write_secret,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hf_noloco.column_launch",
        description="Starts the pipeline_stages processes of one replica column of an on_replica_loss="
        "'continue' run.",
    )
    parser.add_argument("--store", required=True, help="HOST:PORT of the run's store.")
    parser.add_argument(
        "--host-store",
        action="store_true",
        help="Host the store here (once per run); the launcher then serves it until no worker of the run "
        "has beaten its heartbeat for --linger seconds.",
    )
    parser.add_argument(
        "--store-only",
        action="store_true",
        help="Host the store and start no worker: a store outside every column, so that the run survives "
        "the loss of any column (the store is then the one process the run cannot lose). It serves until "
        "the run's workers have started and then stopped beating their heartbeats for --linger seconds.",
    )
    parser.add_argument(
        "--join",
        action="store_true",
        help="Join the live run as --column (a column it lost, or one never started), with the run's own "
        "script and arguments: admitted at the run's next step boundary, the column copies its state from a "
        "live replica of each stage and trains on from the run's step. Not with --host-store.",
    )
    parser.add_argument(
        "--rejoin",
        type=int,
        default=0,
        metavar="N",
        help="When a worker of this column fails, wait for the column's other processes to leave (the run "
        "drops the column), then start the column again with --join, up to N times: a column restarted in "
        "place rejoins the live run. Not with --host-store (the store would go with the failed column).",
    )
    parser.add_argument(
        "--bind",
        metavar="ADDRESS",
        help="With --host-store or --store-only: the address the store listens on (default: the HOST of "
        "--store; 0.0.0.0 or :: for every interface). Keep it on the network the run's machines share.",
    )
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        help=f"The file holding the run's secret (default: ${SECRET_FILE_ENV}, else "
        "~/.config/hf_noloco/run-secret-PORT). The store's host writes a new one there (readable by its user "
        f"only) unless ${SECRET_ENV} gives it; every column reads it from there.",
    )
    parser.add_argument("--linger", type=float, default=10.0, help="See --host-store (seconds).")
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=3600.0,
        help="With --store-only: seconds to wait for the first worker's heartbeat before giving up; for a "
        "column's launch, for the run's secret to appear in --secret-file (the store's host writes it).",
    )
    parser.add_argument("--column", type=int, help="This replica column, in [0, --columns).")
    parser.add_argument("--columns", type=int, required=True, help="Replica columns in the run (dp).")
    parser.add_argument("--stages", type=int, required=True, help="Processes per column (pipeline_stages).")
    parser.add_argument(
        "script", nargs="?", help="The training script (e.g. recipes/train.py), or -m for a module."
    )
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="Its arguments.")
    args = parser.parse_args(argv)
    host, _, port = args.store.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--store must be HOST:PORT, got {args.store!r}.")
    args.host, args.port = host.strip("[]"), int(port)
    args.bind = args.host if args.bind is None else args.bind
    args.secret_file_given = bool(args.secret_file or os.environ.get(SECRET_FILE_ENV))
    args.secret_file = args.secret_file or os.environ.get(SECRET_FILE_ENV) or secret_path(args.port)
    if args.columns < 1 or args.stages < 1:
        parser.error("--columns and --stages must be positive.")
    if args.store_only:
        if args.host_store or args.column is not None or args.script is not None:
            parser.error("--store-only starts no worker: give no --host-store, --column or script.")
        return args
    if args.script is None:
        parser.error("the training script is required (or --store-only).")
    if (args.join or args.rejoin) and args.host_store:
        parser.error("--join and --rejoin join a live run whose store lives elsewhere: give no --host-store.")
    if args.rejoin < 0:
        parser.error(f"--rejoin must be 0 or more, got {args.rejoin}.")
    if args.column is None or not 0 <= args.column < args.columns:
        parser.error(f"--column must be in [0, {args.columns}), got {args.column}.")
    return args


def worker_env(args: argparse.Namespace, stage: int, secret: str | None = None) -> dict[str, str]:
    env = dict(
        os.environ,
        RANK=str(args.column * args.stages + stage),
        WORLD_SIZE=str(args.columns * args.stages),
        LOCAL_RANK=str(stage),
        LOCAL_WORLD_SIZE=str(args.stages),
        GROUP_RANK=str(args.column),
        MASTER_ADDR=args.host,
        MASTER_PORT=str(args.port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    env.pop("TORCHELASTIC_RUN_ID", None)  # not an elastic agent: nothing restarts these processes
    if secret is not None:  # the host's workers start before the file is written (never a command line)
        env[SECRET_ENV] = secret
    elif SECRET_ENV not in env:
        env[SECRET_FILE_ENV] = args.secret_file
    if args.join:
        env[JOIN_ENV] = "1"
    if args.stages > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does for several processes per machine
    return env


_HOSTED: list = []


def host_store(args: argparse.Namespace, secret: str):
    """Hosts the run's store on ``--bind`` and proves ``secret``; returns a connection that reads the run's
    sealed records (the heartbeats)."""
    from hf_noloco.resilience.authentication import host_run_store

    store, records, _ = host_run_store(args.bind, args.port, secret.encode())
    _HOSTED.append(store)  # kept alive as long as the launcher runs
    return records


def host_secret(args: argparse.Namespace) -> str:
    """The store host's secret: ``HF_NOLOCO_RUN_SECRET``, or the file given (``--secret-file``,
    ``HF_NOLOCO_RUN_SECRET_FILE``) when it exists, else a new one for this run (written to the file once the
    store's port is bound: :func:`publish_secret`)."""
    given = env_secret()
    if given is None and args.secret_file_given:
        found = read_secret(args.secret_file)
        given = found[0].decode() if found else None
    args.secret_is_new = given is None
    return given if given is not None else new_secret()


def publish_secret(args: argparse.Namespace, secret: str) -> None:
    if not args.secret_is_new:
        return
    write_secret(args.secret_file, secret)
    print(
        f"column_launch: the run's secret is in {args.secret_file} (readable by this user only); every "
        "column's launch reads it from the same path on its machine (copy the file there, or set "
        f"{SECRET_FILE_ENV}).",
        flush=True,
    )


def check_secret(args: argparse.Namespace, wait: float) -> None:
    """A column's launch that does not host the store: the secret must be there (its workers read it), or
    appear within ``wait`` seconds (the store's host, started at the same time, writes it)."""
    deadline, told = time.monotonic() + wait, False
    while read_secret(args.secret_file) is None:
        if time.monotonic() > deadline:
            raise SecretError(
                f"no secret for the run's store at {args.host}:{args.port}: not in {SECRET_ENV}, nor in "
                f"{args.secret_file} (the store's host writes it there: copy it to this machine, or give "
                f"--secret-file or {SECRET_FILE_ENV})."
            )
        if not told:
            print(f"column_launch: waiting for the run's secret in {args.secret_file}", flush=True)
            told = True
        time.sleep(0.2)


def serve_until_idle(store, world_size: int, linger: float, start_timeout: float | None = None) -> bool:
    """Keeps the store up while any worker of the run still beats its heartbeat (comm.PeerWatch), its count
    read from the sealed records (a forged or replayed one never counts).
    ``start_timeout``: first wait that long for a first heartbeat (a store started before its workers);
    returns False when none came."""
    from hf_noloco.resilience.authentication import read_counts

    keys = [f"hf_noloco/0/beat/{rank}" for rank in range(world_size)]
    started = time.monotonic()
    while start_timeout is not None and not any(read_counts(store, keys)):
        if time.monotonic() - started > start_timeout:
            return False
        time.sleep(0.5)
    highest, changed = [0] * world_size, time.monotonic()
    while True:
        beats = read_counts(store, keys)
        if any(b is not None and b > h for b, h in zip(beats, highest)):
            highest = [max(h, b or 0) for b, h in zip(beats, highest)]
            changed = time.monotonic()
        elif time.monotonic() - changed > linger:  # (none ever beat: the run failed before training)
            return True
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _launch(args)
    except (SecretError, StoreBindError) as exc:
        print(f"error: column_launch: {exc}", file=sys.stderr, flush=True)
        return 2


def _launch(args: argparse.Namespace) -> int:
    if args.store_only:
        secret = host_secret(args)
        store = host_store(args, secret)
        publish_secret(args, secret)
        print(f"column_launch: serving the run's store on {args.bind}:{args.port}", flush=True)
        if not serve_until_idle(store, args.columns * args.stages, args.linger, args.start_timeout):
            print(f"column_launch: no worker beat within {args.start_timeout:g} s", file=sys.stderr)
            return 1
        return 0
    command = [sys.executable, args.script, *args.script_args]
    if args.script == "-m":
        command = [sys.executable, "-m", *args.script_args]
    secret = host_secret(args) if args.host_store else None
    if secret is None:
        check_secret(args, args.start_timeout)
    # The workers first: they import for seconds before they connect (and keep trying until the store is up),
    # while this process imports torch to host the store.
    procs = [subprocess.Popen(command, env=worker_env(args, stage, secret)) for stage in range(args.stages)]
    store = None
    if args.host_store:
        try:
            store = host_store(args, secret)
        except StoreBindError:
            for p in procs:
                p.kill()
            raise
        publish_secret(args, secret)
    rejoins = args.rejoin

    def forward(signum, frame):
        running = [p for p in procs if p.poll() is None]
        for p in running:
            p.send_signal(signum)
        if not running:  # the workers are done: the signal stops the store this launcher serves
            sys.exit(128 + signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    codes = [p.wait() for p in procs]
    while rejoins and any(c != 0 for c in codes):
        rejoins -= 1
        print(
            f"column_launch: column {args.column} failed ({codes}); starting it again with --join", flush=True
        )
        args.join = True
        procs[:] = [
            subprocess.Popen(command, env=worker_env(args, stage, secret)) for stage in range(args.stages)
        ]
        codes = [p.wait() for p in procs]
    if store is not None:
        serve_until_idle(store, args.columns * args.stages, args.linger)
    failed = [c for c in codes if c != 0]
    if not failed:
        return 0
    return 128 - failed[0] if failed[0] < 0 else failed[0]


if __name__ == "__main__":
    sys.exit(main())
