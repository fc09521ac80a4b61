"""The main job end to end on a tiny preset and three mechanisms: every stage writes its rows, the
stage times are saved, committed files from this machine are shown beside the fresh ones (from
another machine: left out), and the report's images all exist."""

from __future__ import annotations

import json
import re
import subprocess

from rich.console import Console

import attnzoo
from attnzoo.bench import speed, suite


def _commit(folder, files):
    """A committed results folder: ``files`` (name -> rows) tracked by git, unmodified."""
    folder.mkdir()
    for name, rows in files.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    git = ["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "results"]):
        subprocess.run(git + args, check=True, capture_output=True)


def test_suite_runs_every_stage_and_writes_a_complete_report(tmp_path, monkeypatch):
    chosen = ("softmax", "linformer", "local")  # linformer cannot be causal: skipped for MQAR
    all_names = attnzoo.names
    monkeypatch.setattr(attnzoo, "names", lambda *a, **k: [n for n in all_names(*a, **k) if n in chosen])
    tiny = dict(n_train=64, n_val=16, n_test=16)
    monkeypatch.setitem(
        suite.PRESETS,
        "quick",
        suite.Preset(
            speed=((False, (64, 128)), (True, (64,))),
            speed_repeats=1,
            profile_sizes=(64,),
            tasks=(
                ("mqar", "quick", dict(steps=4, eval_every=2, dim=16, heads=2, depth=1, task_overrides=tiny)),
                (
                    "listops",
                    "quick",
                    dict(steps=2000, eval_every=2000, max_seconds=0.5, dim=16, heads=2, depth=1, task_overrides=tiny),
                ),
            ),
            mechanisms=("softmax", "linformer"),  # trained and profiled; local: speed only
        ),
    )
    here = {"kind": "meta", **speed.machine()}
    old = {"kind": "train", "task": "listops", "size": "quick", "mechanism": "local", "config": {}}
    old |= {"test_accuracy": 0.4, "chance": 0.15, "git": "abc1234"}
    _commit(
        tmp_path / "benchmarks",
        {
            "train-listops-quick-cpu.jsonl": [old],
            "speed-here-cpu.jsonl": [here, {"kind": "sdpa", "n": 16384, "causal": False, "forward_s": 1.0}],
            "speed-there-cpu.jsonl": [{**here, "processor": "elsewhere"}],
        },
    )
    console = Console(width=200, record=True)
    index = suite.run(
        "quick",
        tmp_path / "out",
        data_dir=str(tmp_path / "data"),
        report_dir=tmp_path / "report",
        console=console,
        command="test",
        committed=tmp_path / "benchmarks",
    )
    out = tmp_path / "out"
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()][1:]
    assert sorted((r["task"], r["mechanism"]) for r in train) == sorted(
        [("mqar", "softmax"), ("listops", "softmax"), ("listops", "linformer")]
    )
    assert all("error" not in r for r in train), [r.get("error") for r in train]
    text = console.export_text()
    assert "skipping linformer (not causal)" in text
    assert "committed speed files from other machines left out: elsewhere" in text
    assert all(r["steps"] < 2000 for r in train if r["task"] == "listops")  # stopped by the time budget
    speed_rows = [json.loads(line) for line in (out / "speed.jsonl").read_text().splitlines()]
    measured = {(r["mechanism"], r["n"], r["causal"]) for r in speed_rows if r["kind"] == "speed"}
    assert measured == {(m, n, False) for m in chosen for n in (64, 128)} | {(m, 64, True) for m in chosen}
    assert all("forward_backward_s" in r for r in speed_rows if r["kind"] == "speed" and "error" not in r)
    profile_rows = [json.loads(line) for line in (out / "profile.jsonl").read_text().splitlines()]
    assert {r["mechanism"] for r in profile_rows if r["kind"] == "profile"} == {"softmax", "linformer"}
    (stages,) = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]
    assert set(stages["stage_seconds"]) == {"speed", "profile", "train", "report"}
    html = index.read_text()
    images = re.findall(r'<img[^>]+src="([^"]+)"', html)
    assert images and all((index.parent / src).is_file() for src in images)
    assert re.search(r"listops quick @ \d+ tokens \(this run\)", html), "the fresh column, named with its length"
    assert "speed-here-cpu.jsonl" in html and "speed-there" not in html
    assert re.search(r'title="committed: [^"]*train-listops-quick-cpu.jsonl, \d{4}-\d\d-\d\d, git abc1234', html)
