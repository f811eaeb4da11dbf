"""The convergence and routing-ablation benchmarks' smoke modes run end to end and write what they promise."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_quick(script: str, output) -> dict:
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick", "--output", str(output)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
        env=dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(output.read_text())


def finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


@pytest.mark.multiprocess
def test_convergence_quick(tmp_path):
    result = run_quick("convergence.py", tmp_path / "convergence_quick.json")
    assert result["mode"] == "quick" and result["corpus"] == "builtin"
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    settings = result["settings"]
    assert settings["inner_steps"] >= 1 and settings["lr"] > 0 and settings["parameters"] > 0
    assert settings["total_tokens"] == settings["tokens_per_step"] * settings["max_steps"]
    methods = ["ddp", "diloco", "noloco", "local"]
    assert [r["method"] for r in result["runs"]] == methods
    for run in result["runs"]:
        assert run["steps"][0] == 0 and run["steps"][-1] == settings["max_steps"]
        assert run["tokens"][-1] == settings["total_tokens"]
        assert len(run["eval_perplexity"]) == len(run["steps"])
        assert len(run["replica_divergence"]) == len(run["log_steps"]) > 0
        assert finite(run["eval_perplexity"] + run["replica_divergence"] + [run["final_perplexity"]])
        assert run["eval_perplexity"][-1] < run["eval_perplexity"][0]  # it learns, even in a few steps
    [mesh] = result["summary"]
    rows = result["summary"][mesh]
    assert set(rows) == set(methods)
    assert rows["diloco"]["vs_diloco"] == 1.0 and rows["ddp"]["vs_ddp"] == 1.0
    assert rows["ddp"]["late_divergence"] < 1e-6 < rows["local"]["late_divergence"]
    for suffix in ("perplexity", "divergence"):
        assert (tmp_path / f"convergence_quick_{suffix}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
def test_routing_ablation_quick(tmp_path):
    result = run_quick("routing_ablation.py", tmp_path / "routing_ablation.json")
    assert result["settings"]["pp"] == 2 and result["settings"]["outer_optimizer"] == "local"
    assert sorted(r["routing"] for r in result["runs"]) == ["fixed", "sample", "step"]
    for run in result["runs"]:
        assert finite(run["eval_perplexity"] + run["replica_divergence"])
        assert run["replica_divergence"][-1] > 0
    summary = result["summary"]
    for routing in ("sample", "step"):
        row = summary[routing]
        assert finite([row["divergence_ratio_final"], row["divergence_ratio_second_half"],
                       row["perplexity_ratio_final"], row["perplexity_ratio_max"]])
        assert 0 < row["divergence_ratio_final"] < 10 and 0 < row["perplexity_ratio_final"] < 10
    assert (tmp_path / "routing_ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
