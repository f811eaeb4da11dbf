"""benchmarks/gpu_check.py reports instead of dying: a hung child (with a child of its own, as torchrun has
workers) is killed with its whole process group at the timeout, its check is a FAIL row, and the JSON is
written anyway; the GPU scripts run from a bare copy of the tree."""

import json
import os
import sys
import time

import pytest

from tests.helpers.bare_copy import bare_copy, run_bare_script
from tests.helpers.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check

HANG = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print('CHILD', child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_hung_child_and_its_children_are_killed_at_the_timeout():
    start = time.monotonic()
    codes, logs = gpu_check.run_children([[sys.executable, "-c", HANG]], [dict(os.environ)], timeout=3)
    assert codes == [None] and time.monotonic() - start < 60  # killed at 3 s, not left to sleep 600
    grandchild = int(logs[0].split("CHILD ")[1].split()[0])
    for _ in range(50):  # the kill is asynchronous: give the kernel a moment to reap
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_a_failing_check_is_a_row_and_the_json_is_written(tmp_path):
    def broken(*args):
        raise RuntimeError("the pp=2 run hung")

    rows = gpu_check._guarded("pp=2 and a killed rank", broken, "cpu", 2, str(tmp_path))
    assert rows == [("pp=2 and a killed rank", False, "RuntimeError: the pp=2 run hung")]
    out = tmp_path / "gpu_check.json"
    gpu_check.write_results(str(out), "cpu", 0, rows)
    assert json.loads(out.read_text())["checks"] == [
        {"check": "pp=2 and a killed rank", "passed": False, "detail": "RuntimeError: the pp=2 run hung"}
    ]


def test_the_gpu_scripts_import_the_package_from_a_bare_copy_of_the_tree(tmp_path):
    """A device machine gets a copy of the tree without the editable install's *.egg-info: gpu_check.py puts
    its own copy of the package on the path (checked from outside the copy, import hook removed; the other
    GPU scripts run from a bare copy in tests/benchmarks/test_gpu_probe.py)."""
    copy = bare_copy(str(tmp_path / "tree"))
    if copy is None:
        pytest.skip("not a git checkout")
    only_packed = ("--device", "cpu", "--only", "packed", "--no-save")
    done = run_bare_script(copy, "benchmarks/gpu_check.py", *only_packed)
    assert done.returncode == 0 and "ModuleNotFoundError" not in done.stdout, done.stdout[-3000:]
    assert "PASS packed rows under sdpa equal each sequence alone" in done.stdout
