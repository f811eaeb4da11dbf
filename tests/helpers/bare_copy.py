"""A bare copy of the tree, as a device machine gets it (the files ``git archive`` packs, and the ones not yet
committed: no ``*.egg-info``, nothing installed), and a Python that cannot see this machine's editable install
of the package: a script that imports ``hf_noloco`` from such a copy must put the copy on the path itself."""

import os
import shutil
import subprocess
import sys

from tests.helpers.paths import ROOT

# Python without the editable install's import hook (setuptools' __editable__ finder), as on a bare machine.
BARE_PYTHON = (
    "import runpy, sys; "
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
    "sys.path_hooks[:] = [h for h in sys.path_hooks if 'editable' not in repr(h).lower()]; "
    "sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def bare_copy(target: str) -> str | None:
    """Copies the tree's tracked and untracked-but-not-ignored files into ``target``; returns it (``None``:
    not a git checkout)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
    )
    if listed.returncode != 0:
        return None
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = os.path.join(ROOT, name)
        if not os.path.isfile(source):
            continue  # listed but deleted in the working tree
        destination = os.path.join(target, name)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        shutil.copy2(source, destination)
    return target


def bare_env() -> dict:
    """The environment of a bare machine's process: no PYTHONPATH pointing into this checkout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    env.pop("PYTHONPATH", None)
    return env


def run_bare_script(copy: str, script: str, *args: str, timeout: float = 300, cwd: str | None = None):
    """Runs ``python <copy>/<script> ARGS`` in a bare Python from outside the copy; returns the completed
    process (output in ``stdout``, merged with stderr)."""
    return subprocess.run(
        [sys.executable, "-c", BARE_PYTHON, os.path.join(copy, script), *args],
        cwd=cwd or os.path.dirname(copy),
        env=bare_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
