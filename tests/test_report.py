"""``attnzoo report``: the pure tables and chart inputs with hand-computed numbers, and a
whole report on synthetic result files (self-contained, every image a PNG that exists)."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest
from rich.console import Console

from attnzoo.bench import report


def train(mechanism, task, acc, steps, *, peak=2**20, chance=0.1, size="tiny", **extra):
    row = {
        "kind": "train",
        "task": task,
        "size": size,
        "mechanism": mechanism,
        "config": {},
        "chance": chance,
        "seq_len": 256,
        "world_size": 1,
        "git": "abc123",
        "command": "attnzoo bench train",
        **extra,
    }
    if acc is None:  # a failed run carries its error and no figures
        return {**row, "error": "RuntimeError: out of memory"}
    return {
        **row,
        "test_accuracy": acc,
        "val_accuracy": acc,
        "steps": 100,
        "steps_per_s": steps,
        "tokens_per_s": 1000.0 * (steps or 0),
        "peak_memory_bytes": peak,
        "wall_s": 10.0,
    }


# softmax: A 80%, B 60% -> 70; linear: A 70%, B failed -> 70 over A only; local: A 90% only.
TRAIN = [
    train("softmax", "A", 0.8, 10.0, peak=4 * 2**20),
    train("softmax", "B", 0.6, 20.0),
    train("linear", "A", 0.7, 40.0, peak=2**20),
    train("linear", "B", None, None),
    train("local", "A", 0.9, 5.0),
    train("softmax", "mqar", 0.95, 10.0),
    train("linear", "mqar", 0.5, 30.0),
]


def speed(mechanism, n, forward_s, peak, backend="auto", **extra):
    return {
        "kind": "speed",
        "mechanism": mechanism,
        "config": {},
        "backend": backend,
        "backend_ran": mechanism,
        "n": n,
        "batch": 1,
        "heads": 8,
        "dim": 64,
        "causal": False,
        "forward_s": forward_s,
        "peak_forward_bytes": peak,
        "correct": True,
        **extra,
    }


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_lra_table_averages_over_present_tasks_and_keeps_failures():
    rows = [r for r in TRAIN if r["task"] != "mqar"]
    table = report.lra_table(rows)
    assert table["tasks"] == ["A", "B"] and table["chance"] == {"A": 10.0, "B": 10.0}
    assert table["average"] == pytest.approx({"softmax": 70.0, "linear": 70.0, "local": 90.0})
    assert table["missing"] == {"softmax": [], "linear": ["B"], "local": ["B"]}
    assert table["mechanisms"][0] == "local"
    assert table["best"] == {"A": ["local"], "B": ["softmax"]}
    failed = table["cells"]["linear"]["B"]
    assert failed["accuracy"] is None and "out of memory" in failed["errors"][0]
    # Two runs of a cell are averaged.
    twice = report.lra_table([train("softmax", "A", 0.5, 1.0), train("softmax", "A", 0.7, 1.0)])
    assert (
        twice["cells"]["softmax"]["A"]["accuracy"] == pytest.approx(60.0)
        and twice["cells"]["softmax"]["A"]["runs"] == 2
    )


def test_bubble_x_is_the_geometric_mean_of_steps_per_s_ratios():
    rows = TRAIN + [train("linear", "B", 0.6, 20.0)]  # linear: 40/10 on A, 20/20 on B, 30/10 on mqar
    assert report.train_speed_ratios(rows)["linear"] == pytest.approx((4 * 1 * 3) ** (1 / 3))
    data = report.bubble_points(TRAIN, [])
    points = {p["label"]: p for p in data["points"]}
    assert points["linear"]["x"] == pytest.approx(math.sqrt(4 * 3))  # B failed: A and mqar only
    assert points["softmax"]["x"] == pytest.approx(1.0) and points["softmax"]["memory"] == 4 * 2**20
    assert points["local"]["x"] == pytest.approx(0.5)
    # y averages only the tasks every mechanism has a result on (here A): linear's B failed and
    # local has no MQAR, so a mean over each one's own tasks would compare different tasks.
    assert points["linear"]["y"] == pytest.approx(70)
    assert report.comparable_accuracy(report.lra_table(TRAIN))[1] == ["A"]


def test_bubble_x_falls_back_to_speed_rows_at_the_largest_common_n():
    rows = [
        speed("softmax", 1024, 1.0, 10),
        speed("softmax", 4096, 16.0, 100),
        speed("linear", 1024, 0.5, 5),
        speed("linear", 4096, 2.0, 20),
        speed("linear", 4096, 4.0, 20, backend="slow"),
        speed("local", 16384, 1.0, 1),
    ]
    ratios = report.speed_ratios(rows)
    assert ratios["linear"] == (8.0, 20, 4096) and ratios["softmax"] == (1.0, 100, 4096)
    assert "local" not in ratios  # no softmax at 16384
    no_steps = [{**r, "steps_per_s": None} for r in TRAIN]
    data = report.bubble_points(no_steps, rows)
    assert {p["label"]: p["x"] for p in data["points"]} == {"linear": 8.0, "softmax": 1.0}
    assert data["no_speed"] == ["local"]


def test_mqar_rows_sit_beside_softmax():
    rows = report.mqar_rows(TRAIN)
    assert [(r["mechanism"], r["accuracy"], r["exact"]) for r in rows] == [
        ("softmax", 95.0, 95.0),
        ("linear", 50.0, 95.0),
    ]


def test_bad_input_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"kind": "meta"}\n\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        report.load_run(path)
    path.write_text('{"kind": "meta"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        report.load_run(path)
    with pytest.raises(ValueError, match="missing.jsonl"):
        report.load_run(tmp_path / "missing.jsonl")


def test_report_is_self_contained(tmp_path):
    meta = {
        "kind": "meta",
        "command": "attnzoo bench speed --n 1024,4096",
        "processor": "AMD EPYC",
        "cpus": 2,
        "torch": "2.13.0",
        "date": "2026-01-01",
    }
    sdpa = [
        {"kind": "sdpa", "n": n, "causal": False, "forward_s": t, "peak_forward_bytes": m}
        for n, t, m in ((1024, 1.0, 2**20), (4096, 16.0, 2**24))
    ]
    speeds = [
        speed("softmax", 1024, 1.0, 2**20),
        speed("softmax", 4096, 16.0, 2**24),
        speed("linear", 1024, 0.1, 2**18),
        speed("linear", 4096, 0.4, 2**20),
        {"kind": "speed", "mechanism": "local", "config": {}, "backend": "auto", "n": 1024, "error": "ValueError: x"},
    ]
    fit = [
        {
            "kind": "fit",
            "mechanism": "linear",
            "config": {},
            "backend": "auto",
            "sizes": [1024, 4096],
            "time_exponent": 1.0,
            "memory_exponent": 1.0,
        }
    ]
    prof = [
        {
            "kind": "profile",
            "mechanism": m,
            "config": {},
            "n": n,
            "attention_s": a,
            "ffn_s": 1.0,
            "block_s": a + 1,
            "attention_share": a / (a + 1),
        }
        for m in ("softmax", "linear")
        for n, a in ((256, 0.5), (1024, 2.0))
    ]
    prof.append({"kind": "profile", "mechanism": "graph", "config": {}, "n": 256, "error": "ValueError: fixed size"})
    fidelity = [
        {
            "kind": "fidelity",
            "mechanism": "linear",
            "config": {},
            "applicable": True,
            "reason": None,
            "mean_cosine": 0.91,
            "min_cosine": 0.5,
            "retrieval_at_1": 0.8,
            "n_passages": 10,
            "seconds": 1.0,
            "model": "tiny",
        },
        {
            "kind": "fidelity",
            "mechanism": "fnet",
            "config": {},
            "applicable": False,
            "reason": "a token mixer has no attention weights",
        },
    ]
    files = [
        write(tmp_path / "speed.jsonl", [meta, *sdpa, *speeds, *fit]),
        write(tmp_path / "train.jsonl", TRAIN),
        write(tmp_path / "more.jsonl", [meta, *prof, *fidelity]),
    ]
    out = tmp_path / "report"
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    console = Console(width=200, record=True)
    assert report.main(parser.parse_args([*files, "--out", str(out)]), console) == []
    assert f"report: {out / 'index.html'}" in console.export_text()
    page = (out / "index.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page)
    images = re.findall(r'<img src="([^"]+)"', page)
    assert "bubbles.png" in images and any(i.startswith("gallery/") for i in images)
    assert any(i.startswith("profile-") for i in images) and any(i.startswith("time-") for i in images)
    for image in images:
        assert (out / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", image
    # Failed runs read "failed" with their error on hover, never 0.
    assert 'class="failed" title="RuntimeError: out of memory">failed<' in page
    assert "<b>90.0</b>" in page and "not applicable: a token mixer has no attention weights" in page
    assert "attnzoo bench speed --n 1024,4096" in page and "AMD EPYC" in page


def test_missing_sections_say_what_is_missing(tmp_path):
    path = write(tmp_path / "speed.jsonl", [speed("softmax", 1024, 1.0, 2**20)])
    index, failed = report.render([report.load_run(path)], tmp_path / "out", gallery=False)
    page = index.read_text()
    assert failed == []
    assert "No train rows" in page and "No profile rows" in page and "No fidelity rows" in page
    assert "No meta row" in page


def test_bubble_y_without_a_common_task_uses_the_task_most_mechanisms_ran():
    def row(m, task, acc):
        return {
            "kind": "train",
            "task": task,
            "size": "quick",
            "mechanism": m,
            "config": {},
            "test_accuracy": acc,
            "chance": 0.1,
            "steps_per_s": 10.0,
            "peak_memory_bytes": 2**20,
        }

    rows = [row("softmax", "A", 0.9), row("softmax", "B", 0.5), row("linear", "A", 0.4), row("fnet", "B", 0.3)]
    rows.append(row("local", "A", 0.6))
    accuracy, used = report.comparable_accuracy(report.lra_table(rows))
    assert used == ["A"] and accuracy == pytest.approx({"softmax": 90, "linear": 40, "local": 60})
