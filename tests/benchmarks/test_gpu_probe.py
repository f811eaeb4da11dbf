"""benchmarks/gpu_probe.sh in its dry mode (--device cpu), from a bare copy of the tree (no install, no
PYTHONPATH of this checkout): every step runs, none fails or times out, and the JSON and the table are
written, naming the package of the copy."""

import json
import os
import subprocess

import pytest

from tests.helpers.bare_copy import bare_copy, bare_env

STEPS = ["versions", "nccl", "trainer", "split", "codecs", "gpu_check", "memory"]


def test_the_probes_dry_mode_runs_every_step_from_a_bare_copy(tmp_path):
    copy = bare_copy(str(tmp_path / "tree"))
    if copy is None:
        pytest.skip("not a git checkout")
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", os.path.join(copy, "benchmarks", "gpu_probe.sh"), "--device", "cpu", "--out", str(out)],
        cwd=tmp_path,
        env=bare_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    result = json.loads((out / "gpu_probe.json").read_text())
    assert list(result["steps"]) == STEPS
    assert all(step["exit"] == 0 for step in result["steps"].values()), done.stdout[-4000:]
    assert result["versions"]["package"] == os.path.join(copy, "hf_noloco")
    rows = [row for step in result["steps"].values() for row in step["rows"]]
    assert not [row for row in rows if row["passed"] is False], done.stdout[-4000:]
    assert sum(row["passed"] is True for row in rows) >= 20  # the dry mode checks, not only skips
    table = (out / "gpu_probe.txt").read_text()
    assert table.startswith("gpu_probe (cpu): ") and "0 failed" in table.splitlines()[0]
