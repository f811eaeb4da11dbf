"""The convergence study: its statistics, its study-file and command-line arms, and its smoke mode end to end
(two parts run at different times, resumed, merged, reported and replotted)."""

import json
import math
import os
import statistics
import sys

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.scripts import run_main

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import _stats
import _study

# Two-sided 95% Student-t quantiles t(0.975, df) from printed tables: the independent reference.
T_TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 10: 2.228, 30: 2.042, 1000: 1.962}


def test_t_quantiles_match_the_printed_table():
    for df, t in T_TABLE.items():
        assert _stats.t_quantile(0.975, df) == pytest.approx(t, abs=1e-3), df
        assert _stats.t_quantile(0.025, df) == pytest.approx(-t, abs=1e-3), df
        assert _stats.t_cdf(t, df) == pytest.approx(0.975, abs=1e-4)
    assert _stats.t_quantile(0.5, 3) == 0.0
    assert _stats.t_cdf(0.0, 7) == 0.5


def test_paired_log_ratio_by_hand():
    a, b = [110.0, 121.0, 99.0], [100.0, 100.0, 100.0]
    result = _stats.paired_log_ratio(a, b)
    logs = [math.log(x / y) for x, y in zip(a, b)]
    half = T_TABLE[2] * statistics.stdev(logs) / math.sqrt(3)
    assert result["per_seed"] == pytest.approx([1.1, 1.21, 0.99])
    assert result["ratio"] == pytest.approx(math.exp(statistics.mean(logs)))
    assert result["low"] == pytest.approx(math.exp(statistics.mean(logs) - half), rel=1e-4)
    assert result["high"] == pytest.approx(math.exp(statistics.mean(logs) + half), rel=1e-4)
    assert result["pct"] == pytest.approx(100 * (result["ratio"] - 1))
    assert _stats.std([1.0, 2.0, 4.0]) == pytest.approx(statistics.stdev([1.0, 2.0, 4.0]))
    one = _stats.paired_log_ratio([2.0], [1.0])
    assert one["ratio"] == 2.0 and math.isnan(one["low"])
    with pytest.raises(ValueError):
        _stats.paired_log_ratio([1.0, 2.0], [1.0])


def test_arms_from_the_command_line_and_the_paper_defaults():
    name, arm = _study.parse_arm("nl=noloco,H=8,alpha=0.3,gamma=0.5,group=4,routing=step")
    assert name == "nl" and arm == {
        "method": "noloco",
        "H": 8,
        "alpha": 0.3,
        "gamma": 0.5,
        "group": 4,
        "routing": "step",
    }
    full = _study.normalize_arm(name, arm)
    assert full == {
        "method": "noloco",
        "routing": "step",
        "H": 8,
        "alpha": 0.3,
        "beta": 0.7,
        "gamma": 0.5,
        "group": 4,
        "dtype": "float32",
    }
    # Unset values are the paper's: noloco H 50, alpha 0.5, gamma = beta, pairs; diloco H 100, alpha 0.3.
    assert _study.normalize_arm("n", {"method": "noloco", "beta": 0.6}) == {
        "method": "noloco",
        "routing": "sample",
        "H": 50,
        "alpha": 0.5,
        "beta": 0.6,
        "gamma": 0.6,
        "group": 2,
        "dtype": "float32",
    }
    assert _study.normalize_arm("n", {"method": "noloco", "dtype": "int4"})["dtype"] == "int4"
    assert _study.normalize_arm("d", {"method": "diloco"})["H"] == 100
    assert _study.normalize_arm("d", {"method": "diloco"})["alpha"] == 0.3
    for bad, message in [
        ("x=diloco,gamma=0.5", "only apply to noloco"),
        ("x=ddp,H=4", "no outer step"),
        ("x=noloco,eta=1", "unknown key"),
        ("x=adam", "method must be"),
        ("x=local,routing=random", "routing must be"),
        ("x=noloco,alpha=1.0", "outer_momentum"),  # the library's own range checks
        ("x=diloco,beta=0", "outer_lr"),
        ("x=noloco,dtype=int2", "outer_dtype"),
    ]:
        with pytest.raises(ValueError, match=message):
            _study.normalize_arm(*_study.parse_arm(bad))


def test_the_study_file_is_consistent():
    study = _study.load_study(os.path.join(ROOT, "benchmarks", "studies", "factorial.yaml"))
    runs = _study.plan(study)
    assert len(runs) == len({(m, a, s) for _, m, a, s in runs})  # no run twice
    train = study["train"]
    tokens = train["max_steps"] * train["global_batch"] * study["data"]["block_size"]
    assert tokens >= 4 * 160 * 1024  # at least 4x the earlier study's tokens
    noloco = [a for a in study["arms"].values() if a["method"] == "noloco"]
    assert min(train["max_steps"] // a["H"] for a in noloco) >= 40  # at least 40 NoLoCo outer steps
    for mesh in ("4x1", "8x1", "4x2"):  # the factorial: 3 seeds of every arm on every mesh
        for arm in (
            "ddp",
            "local",
            "diloco-H8-a0.3",
            "diloco-H8-a0.5",
            "noloco-H8-a0.3",
            "noloco-H8-a0.5",
            "diloco-H16-a0.3",
        ):
            assert sorted(s for _, m, a, s in runs if (m, a) == (mesh, arm)) == [0, 1, 2], (mesh, arm)
    for mesh in study["routing"]["meshes"]:
        for arm in [study["routing"]["baseline"], *study["routing"]["arms"]]:
            assert sorted(s for _, m, a, s in runs if (m, a) == (mesh, arm)) == [0, 1, 2], (mesh, arm)
    # The paper's pairing: NoLoCo at H and alpha 0.5 against DiLoCo at 2H and alpha 0.3.
    [paper] = [c for c in study["comparisons"] if "paper" in c["measures"]]
    assert study["arms"][paper["arm"]]["H"] * 2 == study["arms"][paper["ref"]]["H"]
    assert (study["arms"][paper["arm"]]["alpha"], study["arms"][paper["ref"]]["alpha"]) == (0.5, 0.3)


def convergence(*args):
    return run_main("convergence", *args)


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")


def test_quick_study_runs_in_parts_resumes_merges_and_replots(tmp_path):
    out = str(tmp_path)
    convergence("--quick", "--output-dir", out, "--part", "seed0")
    log = convergence("--quick", "--output-dir", out)  # both parts: seed0's runs are already saved
    assert log.count("already in part-seed0.json") == 9 and log.count("seed 1: final ppl") == 9
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["parts"] == ["seed0", "seed1"] and summary["num_runs"] == 18

    # Raw logs: every run's Trainer log history, with losses, evaluations and replica divergence.
    runs = {}
    for part in ("seed0", "seed1"):
        record = json.loads((tmp_path / f"part-{part}.json").read_text())
        assert record["train"]["max_steps"] == 8 and record["machine"]["cores"] >= 1
        for run in record["runs"]:
            evals = [h for h in run["log_history"] if "eval_perplexity" in h]
            logs = [h for h in run["log_history"] if "loss" in h and "replica_divergence" in h]
            assert [h["step"] for h in evals] == [0, 4, 8] and len(logs) == 8
            assert evals[-1]["eval_perplexity"] < evals[0]["eval_perplexity"]  # it learns
            runs[(run["arm"], run["seed"])] = run
    assert runs[("noloco-H2-a0.5", 0)]["arm_settings"] == {  # unset in quick.yaml: the paper's values
        "method": "noloco",
        "routing": "sample",
        "H": 2,
        "alpha": 0.5,
        "beta": 0.7,
        "gamma": 0.7,
        "group": 2,
    }

    def final(arm, seed):
        return [h["eval_perplexity"] for h in runs[(arm, seed)]["log_history"] if "eval_perplexity" in h][-1]

    # Statistics recomputed from the raw logs with the standard library and the printed t table.
    rows = summary["arms"]["2x2"]
    for arm, row in rows.items():
        finals = [final(arm, 0), final(arm, 1)]
        assert row["final_perplexity"] == finals
        assert row["mean"] == pytest.approx(statistics.mean(finals))
        assert row["std"] == pytest.approx(statistics.stdev(finals))
    assert rows["ddp"]["divergence_mid_interval"] == 0.0 < rows["local"]["divergence_mid_interval"]
    [paper] = [c for c in summary["comparisons"] if c["name"] == "paper pairing"]
    logs = [math.log(final("noloco-H2-a0.5", s) / final("diloco-H4-a0.3", s)) for s in (0, 1)]
    half = T_TABLE[1] * statistics.stdev(logs) / math.sqrt(2)
    result = paper["by_mesh"]["2x2"]
    assert result["seeds"] == [0, 1]
    assert result["ratio"] == pytest.approx(math.exp(statistics.mean(logs)))
    assert result["low"] == pytest.approx(math.exp(statistics.mean(logs) - half), rel=1e-4)
    [interaction] = [c for c in summary["comparisons"] if c["name"] == "interaction"]
    expected = [
        final("noloco-H2-a0.5", s)
        * final("diloco-H2-a0.3", s)
        / (final("diloco-H2-a0.5", s) * final("noloco-H2-a0.3", s))
        for s in (0, 1)
    ]
    assert interaction["by_mesh"]["2x2"]["per_seed"] == pytest.approx(expected)
    # At dp = 2 a NoLoCo pair is the whole group: equal alpha and H, gamma = beta give DiLoCo (to rounding).
    for alpha in ("0.3", "0.5"):
        for seed in (0, 1):
            assert final(f"noloco-H2-a{alpha}", seed) == pytest.approx(
                final(f"diloco-H2-a{alpha}", seed), rel=1e-5
            )
    routing = summary["routing"]["2x2"]
    for arm in ("local", "local-step"):
        std = [h["replica_divergence"] for h in runs[(arm, 1)]["log_history"] if "replica_divergence" in h][
            -1
        ]
        fixed = [
            h["replica_divergence"]
            for h in runs[("local-fixed", 1)]["log_history"]
            if "replica_divergence" in h
        ][-1]
        assert routing[arm]["std_ratio_final"]["per_seed"][1] == pytest.approx(std / fixed)

    tables = (tmp_path / "summary.md").read_text()
    assert "| dp2 x pp2 | `noloco-H2-a0.5` |" in tables and "paper pairing" in tables
    pngs = ["quick_perplexity.png", "quick_comparisons.png", "quick_divergence.png", "quick_routing.png"]
    stamps = {}
    for png in pngs:
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        stamps[png] = (tmp_path / png).stat().st_mtime_ns
        (tmp_path / png).unlink()
    (tmp_path / "summary.json").unlink()
    log = convergence("--quick", "--output-dir", out, "--replot")  # no training: the same summary, new plots
    assert ": final ppl" not in log
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert all((tmp_path / png).exists() for png in pngs)


def test_command_line_arm_reaches_the_trainer(tmp_path):
    """An ad-hoc part with an arm from the command line: gamma != beta makes NoLoCo send its slow weights too,
    so each outer step sends two copies of the model (one with gamma = beta)."""
    convergence(
        "--quick",
        "--output-dir",
        str(tmp_path),
        "--arms",
        "nl",
        "--meshes",
        "2x1",
        "--seeds",
        "3",
        "--arm",
        "nl=noloco,H=4,alpha=0.2,beta=0.6,gamma=0.4",
    )
    [run] = json.loads((tmp_path / "part-custom.json").read_text())["runs"]
    assert run["arm_settings"] == {
        "method": "noloco",
        "routing": "sample",
        "H": 4,
        "alpha": 0.2,
        "beta": 0.6,
        "gamma": 0.4,
        "group": 2,
    }
    from _common import count_parameters

    study = _study.load_study(os.path.join(ROOT, "benchmarks", "studies", "quick.yaml"))
    sent = [h["outer_bytes_sent_per_rank"] for h in run["log_history"] if "outer_bytes_sent_per_rank" in h][
        -1
    ]
    assert (
        sent == 2 * 2 * count_parameters(study["model"]) * 4
    )  # 8 steps / H 4 = 2 outer steps, theta + phi, fp32
