"""benchmarks/slow_link.py in its smoke mode: two network namespaces joined by a rate-limited veth pair, four
ranks launched by two torchruns across it. Skipped (with the script's own reason) where namespaces cannot be
made; as root on Linux (CI) it runs."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.paths import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "slow_link.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from slow_link import SKIP_PREFIX, namespace_problem  # noqa: E402

needs_namespaces = pytest.mark.skipif(namespace_problem() is not None, reason=f"{namespace_problem()}")


def _namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def _env(tmp_path):
    # TMPDIR: the run's plan and logs go under tmp_path, so its processes can be recognised below.
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def test_skips_with_a_reason_where_namespaces_cannot_be_made():
    problem = namespace_problem()
    if problem is None:
        assert os.geteuid() == 0
    else:
        done = subprocess.run(
            [sys.executable, SCRIPT, "--quick"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 and done.stdout.startswith(SKIP_PREFIX), done.stdout + done.stderr


@needs_namespaces
def test_quick_run_measures_the_link_and_tears_it_down(tmp_path):
    out = tmp_path / "slow_link.json"
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "--quick", "--output", str(out)],
        cwd=ROOT,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output
    assert not {f"hfnl{proc.pid}a", f"hfnl{proc.pid}b"} & set(_namespaces())
    result = json.loads(out.read_text())
    assert os.path.exists(tmp_path / "slow_link.png")
    rows = {(r["config"], r["rate"]): r for r in result["summary"]}
    assert {rate for _, rate in rows} == {"unlimited", "1"}
    # Node routing and no outer sync: the pipeline sends nothing across the link (a few KB of barriers).
    assert rows["local node", "unlimited"]["measured_link_bytes_per_window"] < 20_000
    assert rows["local global", "unlimited"]["measured_link_bytes_per_window"] > 100_000
    # The traffic model, fed the samples each window trained, predicts the bytes on the link; headers,
    # acknowledgements and barriers add a few percent.
    for row in rows.values():
        if row["predicted_realized_link_bytes_per_window"] > 500_000:
            assert 0.98 < row["measured_over_realized"] < 1.10, row
    # The link really is rate-limited: DDP (gradients cross every step) is much slower at 1 than unlimited.
    assert rows["ddp global", "1"]["vs_unlimited"] < 0.5
    for window in result["windows"]:
        assert window["load"] >= 0 and window["seconds"] > 0
    # --replot recomputes the summary from the recorded windows alone
    summary = result["summary"]
    done = subprocess.run(
        [sys.executable, SCRIPT, "--replot", str(out)], env=_env(tmp_path), capture_output=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["summary"] == summary
    assert all(r["link_over_compute"] > 0 for r in summary if r["rate"] != "unlimited")


@needs_namespaces
def test_ctrl_c_stops_the_nodes_and_deletes_the_namespaces(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "--quick", "--output", str(tmp_path / "x.json")],
        cwd=ROOT,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    names = {f"hfnl{proc.pid}a", f"hfnl{proc.pid}b"}
    deadline = time.monotonic() + 120
    # The torchruns (and workers) are up: processes mention the run's plan under tmp_path. Not any process
    # naming tmp_path: a child the script forks (`ip netns ...`) carries the script's own command line (its
    # --output) until it execs, before the namespaces exist.
    while not set(_processes_mentioning(f"{tmp_path}/")) & set(_processes_mentioning("plan.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    assert names <= set(_namespaces())
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert not names & set(_namespaces())
    deadline = time.monotonic() + 30
    while _processes_mentioning(f"{tmp_path}/") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _processes_mentioning(f"{tmp_path}/")
