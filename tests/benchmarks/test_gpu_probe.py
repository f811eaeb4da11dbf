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


def test_the_sync_log_counts_sync_warnings_by_step_and_call_site():
    """The Trainer step's counter of torch.cuda.set_sync_debug_mode's warnings (no GPU here: the warnings are
    raised by hand, as torch raises them from the op that synchronises)."""
    import importlib.util
    import warnings

    from tests.helpers.paths import ROOT

    spec = importlib.util.spec_from_file_location(
        "gpu_probe", os.path.join(ROOT, "benchmarks", "gpu_probe.py")
    )
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    log = probe._SyncLog()
    with log.recording("cpu"):
        for step in (1, 2):
            log.step = step
            for _ in range(step):
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        with warnings.catch_warnings(record=True) as other:
            warnings.simplefilter("always")
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert sorted((step, n) for (step, _), n in log.counts.items()) == [(1, 1), (2, 2)]
    assert len({site for _, site in log.counts}) == 1 and len(other) == 1
