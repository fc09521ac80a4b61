"""``attnzoo bench profile`` structure (timings themselves are never asserted)."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from attnzoo.bench import profile


def test_profile_rows_time_each_sublayer():
    rows = list(profile.run((("softmax", {}), ("fnet", {})), (32, 64), command="test", dim=32, heads=2, repeats=1))
    assert rows[0]["kind"] == "meta" and rows[0]["command"] == "test" and rows[0]["torch"]
    body = rows[1:]
    assert [(r["mechanism"], r["n"]) for r in body] == [("softmax", 32), ("fnet", 32), ("softmax", 64), ("fnet", 64)]
    for row in body:
        assert "error" not in row, row
        assert row["attention_s"] > 0 and row["ffn_s"] > 0 and row["block_s"] > 0
        assert 0 < row["attention_share"] < 1
        assert row["attention_share"] == row["attention_s"] / (row["attention_s"] + row["ffn_s"])


def test_profile_reports_errors_as_rows():
    # head_dim 16 vs a config key that does not exist, and a fixed-size pattern at the wrong N.
    bad = profile.profile_one("softmax", {"bogus": 1}, 32, dim=32, heads=2, repeats=1)
    assert "unknown config key" in bad["error"] and "attention_s" not in bad
    axial = profile.profile_one("axial", {"h": 4, "w": 4}, 32, dim=32, heads=2, repeats=1)
    assert "exactly h*w" in axial["error"]


def test_profile_fills_sizes_from_the_layer():
    # Synthesizer's default heads=8 and head_dim=64 would not match a 2-head, 32-wide layer.
    row = profile.profile_one("synthesizer", {}, 64, dim=32, heads=2, repeats=1)
    assert "error" not in row, row


def test_main_writes_json_lines_and_prints_a_table(tmp_path):
    parser = argparse.ArgumentParser()
    profile.add_arguments(parser)
    out = tmp_path / "profile.jsonl"
    args = parser.parse_args(
        ["--mechanism", "softmax", "--n", "32", "--dim", "32", "--heads", "2", "--repeats", "1", "--out", str(out)]
    )
    args.argv = ["bench", "profile", "--mechanism", "softmax"]
    console = Console(width=200, record=True)
    profile.main(args, console)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["meta", "profile"]
    assert lines[0]["command"] == "attnzoo bench profile --mechanism softmax"
    assert "attention share" in console.export_text()
