"""The streaming-memory benchmark's quick mode runs end to end and writes the figures the full run reports."""

import json
import os
import subprocess
import sys

from tests.helpers.paths import ROOT


def test_streaming_memory_quick(tmp_path):
    output = tmp_path / "streaming_memory.json"
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "streaming_memory.py"),
            "--quick",
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path)),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(output.read_text())
    runs = result["runs"]
    assert [(r["corpus_mb"], r["mode"]) for r in runs] == [
        (1, "stream"),
        (1, "map"),
        (2, "stream"),
        (2, "map"),
    ]
    for r in runs:
        assert 50 < r["baseline_mib"] < r["peak_mib"] < 4096  # a real process, measured in MiB
        assert r["tokens"] > r["corpus_mb"] * 2**20 / 8  # the whole corpus was read (~4-5 bytes per token)
    stream = [r for r in runs if r["mode"] == "stream"]
    mapped = [r for r in runs if r["mode"] == "map"]
    assert all(r["cache_bytes_written"] == 0 for r in stream)  # the stream writes nothing ahead
    assert all(r["cache_bytes_written"] > r["corpus_mb"] * 2**20 for r in mapped)  # the ordinary path does
    # Both paths read the same blocks (up to the few held out for evaluation).
    for s, m in zip(stream, mapped):
        assert abs(s["tokens"] - m["tokens"]) < 0.05 * m["tokens"]
    assert set(result["summary"]) >= {"stream_peak_growth_mib", "corpus_growth", "stream_cache_bytes_written"}
