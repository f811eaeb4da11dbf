"""The throughput benchmark's smoke mode runs end to end and writes the rows it promises."""

import json

from tests.helpers.scripts import run_main


def test_pipeline_throughput_quick(tmp_path):
    output = tmp_path / "throughput.json"
    printed = run_main("pipeline_throughput", "--quick", "--output", str(output))
    result = json.loads(output.read_text())

    sizes = [1, 2]
    expected = ["reference", "reference x2"] + [
        f"pp2 dp1 mb{m}{split}" for m in sizes for split in ("", " compute")
    ]
    expected += [f"pp2 dp2 mb{m} {routing}" for m in sizes for routing in ("fixed", "sample")]
    assert [row["name"] for row in result["rows"]] == expected
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and row["efficiency"] > 0 and row["step_s_median"] > 0
        assert row["processes"] == row["pp"] * row["dp"]
    assert result["rows"][0]["efficiency"] == 1.0
    assert result["summary"]["two_process_ceiling"] == result["rows"][1]["efficiency"] > 0
    assert set(result["summary"]["pp2_dp1_of_two_process_ceiling"]) == {"layers", "compute"}
    assert set(result["summary"]["sample_vs_fixed_cost"]) == {"1", "2"}
    assert all(e > 0 for e in result["summary"]["pp2_dp1_efficiency"].values())
    assert set(result["summary"]["pp2_dp1_efficiency_compute"]) == {"1", "2"}
    assert result["model"]["stage_split"] == {"layers": [[0, 1], [1, 2]], "compute": [[0, 1], [1, 2]]}
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    assert "reference" in printed and "efficiency" in printed  # the printed table


def test_packing_quick(tmp_path):
    output = tmp_path / "packing.json"
    printed = run_main("packing", "--quick", "--output", str(output))
    result = json.loads(output.read_text())
    padded, packed = result["arms"]["padded"], result["arms"]["packed"]
    # The same conversations, cut alike: the same tokens to train on, in fewer, fuller rows.
    assert packed["trained_tokens"] == padded["trained_tokens"] > 0
    assert packed["non_padding_tokens"] == padded["non_padding_tokens"]
    assert packed["rows"] < padded["rows"] and packed["padding_share"] < padded["padding_share"]
    assert packed["steps_per_epoch"] <= padded["steps_per_epoch"]
    for arm in (padded, packed):
        assert arm["trained_tokens_per_second"] > 0 and arm["epoch_seconds"] > 0
        assert arm["non_padding_tokens_per_second"] >= arm["trained_tokens_per_second"]
    assert result["conversation_tokens"]["median"] > 16  # a realistic spread, not a handful of tokens
    assert "packed / padded" in printed
