"""The main job end to end on a tiny preset and three mechanisms: every stage writes its rows and
the report's images all exist."""

from __future__ import annotations

import json
import re

import pytest
from rich.console import Console

import attnzoo
from attnzoo.bench import suite


def test_suite_runs_every_stage_and_writes_a_complete_report(tmp_path, monkeypatch):
    chosen = ("softmax", "linformer", "local")  # linformer cannot be causal: skipped for MQAR
    all_names = attnzoo.names
    monkeypatch.setattr(attnzoo, "names", lambda *a, **k: [n for n in all_names(*a, **k) if n in chosen])
    tiny = dict(n_train=64, n_val=16, n_test=16)
    monkeypatch.setitem(
        suite.PRESETS,
        "quick",
        suite.Preset(
            speed_sizes=(64, 128),
            speed_repeats=1,
            backward=False,
            profile_sizes=(64,),
            tasks=(
                ("mqar", "quick", dict(steps=4, eval_every=2, dim=16, heads=2, depth=1, task_overrides=tiny)),
                (
                    "listops",
                    "quick",
                    dict(steps=2000, eval_every=2000, max_seconds=0.5, dim=16, heads=2, depth=1, task_overrides=tiny),
                ),
            ),
            fidelity_passages=2,
        ),
    )
    console = Console(width=200, record=True)
    index = suite.run(
        "quick",
        tmp_path / "out",
        data_dir=str(tmp_path / "data"),
        report_dir=tmp_path / "report",
        console=console,
        command="test",
    )
    train = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()][1:]
    assert sorted((r["task"], r["mechanism"]) for r in train) == sorted(
        [("mqar", "softmax"), ("mqar", "local"), ("listops", "softmax"), ("listops", "local"), ("listops", "linformer")]
    )
    assert all("error" not in r for r in train), [r.get("error") for r in train]
    assert "skipping linformer (not causal)" in console.export_text()
    timed = [r for r in train if r["task"] == "listops"]
    assert all(r["steps"] < 2000 for r in timed)  # stopped by the time budget
    speed_rows = [json.loads(line) for line in (tmp_path / "out" / "speed.jsonl").read_text().splitlines()]
    assert {r["mechanism"] for r in speed_rows if r["kind"] == "speed"} == set(chosen)
    html = index.read_text()
    images = re.findall(r'<img[^>]+src="([^"]+)"', html)
    assert images and all((index.parent / src).is_file() for src in images)
    if (tmp_path / "out" / "fidelity.jsonl").exists():
        assert "Fidelity" in html or "fidelity" in html
    else:
        pytest.importorskip("transformers")  # only absent when the hf extra is not installed
