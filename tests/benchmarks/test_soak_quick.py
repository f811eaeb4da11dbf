"""The soak benchmark's quick mode runs end to end and writes the figures the full run reports."""

import json
import tempfile

from tests.helpers.scripts import run_main


def test_soak_quick(tmp_path, monkeypatch):
    output = tmp_path / "soak.json"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    printed = run_main("soak", "--quick", "--output", str(output))
    result = json.loads(output.read_text())
    settings = result["settings"]
    assert settings["mode"] == "quick" and settings["processes"] == 4

    ranks = result["ranks"]
    assert [(r["rank"], r["stage"], r["replica"]) for r in ranks] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 0, 1),
        (3, 1, 1),
    ]
    for r in ranks:
        assert r["steps_recorded"] == settings["steps"]  # one sample per optimizer step, on every rank
        for trend in (r["rss_mib"], r["step_ms"]):
            assert {"level", "slope_per_1000_steps", "growth", "noise", "grows"} <= set(trend)
            assert trend["level"] > 0 and trend["noise"] >= 0
        assert 50 < r["rss_mib"]["level"] < 4096  # MiB: a real process, measured in the right unit
        assert (
            len(r["series"]["step"])
            == len(r["series"]["rss_mib"])
            == len(r["series"]["step_ms"])
            == settings["windows"]
        )
        assert r["last_loss"] < r["first_loss"]  # it really trained
    assert set(result["summary"]["rss_growth_mib"]) == {"0", "1", "2", "3"}
    assert isinstance(result["summary"]["any_growth"], bool)
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "verdict" in printed  # the printed table
