"""``attnzoo report`` and ``attnzoo.bench.pick``: one reference row per mechanism, averages over
equal task sets, no ranking where softmax did not learn, "which to pick" computed from the data
(a synthetic results file with a known Pareto front), refusal to mix machines, provenance, and a
whole self-contained report on synthetic files."""

from __future__ import annotations

import argparse
import json
import re
import subprocess

import pytest
from rich.console import Console

from attnzoo.bench import pick, report, results, sections

META = {"kind": "meta", "processor": "AMD EPYC", "cpus": 2, "torch_threads": 2, "date": "2026-01-02", "git": "abc1234"}


def train(mechanism, task, acc, *, chance=0.1, size="quick", steps=600, **extra):
    row = {"kind": "train", "task": task, "size": size, "mechanism": mechanism, "config": {}, "chance": chance}
    row.update({"optim": {"steps": steps}, "git": "abc1234", **extra})
    if acc is None:  # a failed run carries its error and no figures
        return {**row, "error": "RuntimeError: out of memory"}
    return {**row, "test_accuracy": acc, "steps": steps, "steps_per_s": 10.0, "peak_memory_bytes": 2**20}


def speed(mechanism, n, ratio, peak_mib, *, causal=False, forward_only=False, **extra):
    row = {"kind": "speed", "mechanism": mechanism, "config": {}, "backend": "auto", "n": n, "causal": causal}
    row.update(batch=1, heads=8, dim=64, correct=True, forward_s=0.01 / ratio, peak_forward_bytes=peak_mib * 2**20)
    row["speedup_forward_vs_sdpa"] = ratio
    if not forward_only:
        row.update(forward_backward_s=0.03 / ratio, speedup_forward_backward_vs_sdpa=ratio)
    return {**row, **extra}


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def loaded(tmp_path, name, rows, committed=False):
    return results.load_run(write(tmp_path / name, rows), origin="committed" if committed else "fresh")


def test_one_reference_row_per_mechanism(tmp_path):
    committed = loaded(
        tmp_path,
        "old.jsonl",
        [train("softmax", "A", 0.5), train("softmax", "A", 0.9, git="abc+dirty"), train("softmax", "A", 0.6)],
        committed=True,
    )
    # Within a file: a clean revision beats a dirty one, then the later row: 60%, not a mean.
    table = pick.accuracy_table(committed.rows)
    (column,) = table["columns"]
    assert pick.accuracy(table["cells"]["softmax"][column]) == pytest.approx(60.0)
    # A later, shorter run of the same task (the demo's 150 steps) does not stand in for the full
    # budget: one column never mixes budgets.
    short = loaded(tmp_path, "demo.jsonl", [train("softmax", "A", 0.3, steps=150)], committed=True)
    table = pick.accuracy_table(committed.rows + short.rows)
    (column,) = table["columns"]
    assert pick.accuracy(table["cells"]["softmax"][column]) == pytest.approx(60.0)
    assert table["info"][column]["budgets"] == [600]
    # Fresh and committed runs are different columns (their budgets differ), one row each.
    fresh = loaded(tmp_path, "new.jsonl", [train("softmax", "A", 0.7, steps=100)])
    table = pick.accuracy_table(committed.rows + fresh.rows)
    assert [c.name for c in table["columns"]] == ["A quick (this run)", "A quick"]
    # The same size at another sequence length is another task: its own column, named with it.
    longer = loaded(tmp_path, "long.jsonl", [train("softmax", "A", 0.5, seq_len=1024)], committed=True)
    lengths = pick.accuracy_table(committed.rows + longer.rows)
    assert sorted(c.name for c in lengths["columns"]) == ["A quick", "A quick @ 1024 tokens"]
    assert table["info"][table["columns"][0]]["budgets"] == [100]
    # Speed: one row per mechanism, the default config and fresh rows first.
    rows = loaded(tmp_path, "s1.jsonl", [META, speed("local", 4096, 3.0, 10)], committed=True).rows
    rows += loaded(tmp_path, "s2.jsonl", [META, speed("local", 4096, 5.0, 10)]).rows
    rows += loaded(tmp_path, "s3.jsonl", [META, speed("local", 4096, 9.0, 10, config={"left": 256})]).rows
    chosen = pick.speed_points(rows, 4096, False)
    assert list(chosen) == ["local"] and chosen["local"]["speedup_forward_backward_vs_sdpa"] == 5.0
    # Among committed files the newer measurement wins, whatever the input order (a committed demo
    # run read last must not hide a later sweep).
    newer = loaded(tmp_path, "s4.jsonl", [{**META, "date": "2026-02-01"}, speed("local", 4096, 7.0, 10)], True)
    older = loaded(tmp_path, "s5.jsonl", [META, speed("local", 4096, 2.0, 10)], committed=True)
    chosen = pick.speed_points(newer.rows + older.rows, 4096, False)
    assert chosen["local"]["speedup_forward_backward_vs_sdpa"] == 7.0


def test_averages_are_over_equal_task_sets():
    rows = [train("softmax", t, 0.8) for t in "ABC"] + [train("linear", t, 0.6) for t in "AB"]
    rows += [train("local", "A", 0.9), train("fnet", "A", None)]  # a failed run has no result
    table = pick.accuracy_table(rows)
    used, means = pick.common_tasks(table)
    # A has the most mechanisms (softmax, linear, local); B and C lack local: A only, for all three.
    assert [c.task for c in used] == ["A"]
    assert means == pytest.approx({"softmax": 80.0, "linear": 60.0, "local": 90.0})
    # Among softmax and linear only, A and B are common (C lacks linear).
    used, means = pick.common_tasks(table, {"softmax", "linear"})
    assert [c.task for c in used] == ["A", "B"] and means == pytest.approx({"softmax": 80.0, "linear": 60.0})
    html = sections.accuracy_section(table)
    assert "fnet" in html and "not ranked: no result on A quick" in html


def test_no_ranking_where_softmax_is_not_above_chance_plus_ten_points():
    rows = [train("softmax", "hard", 0.2, chance=0.15), train("local", "hard", 0.3, chance=0.15)]
    rows += [train("softmax", "easy", 0.9), train("local", "easy", 0.5)]
    rows += [train("local", "alone", 0.9)]  # no softmax run: cannot be judged
    table = pick.accuracy_table(rows)
    learned = {c.task: table["info"][c]["learned"] for c in table["columns"]}
    assert learned == {"hard": False, "easy": True, "alone": None}
    used, means = pick.common_tasks(table)
    assert [c.task for c in used] == ["easy"] and means == pytest.approx({"softmax": 90.0, "local": 50.0})
    best = {c.task: b for c, b in pick.best_per_column(table).items()}
    assert best == {"hard": set(), "easy": {"softmax"}, "alone": set()}
    html = sections.accuracy_section(table)
    assert "not learned at this budget" in html and "no softmax run: not judged" in html
    assert "<b>30.0</b>" not in html  # local's 30% on the unlearned task is not marked best


def test_a_causal_encoder_run_is_its_own_column_judged_by_its_own_softmax():
    causal = {"model": {"causal_encoder": True}}
    rows = [train("softmax", "listops", 0.45, chance=0.15), train("local", "listops", 0.40, chance=0.15)]
    rows += [train("softmax", "listops", 0.20, chance=0.15, **causal), train("retnet", "listops", 0.3, **causal)]
    table = pick.accuracy_table(rows)
    plain, causal_col = table["columns"]
    assert (plain.causal_encoder, causal_col.causal_encoder) == (False, True)
    assert causal_col.name == "listops quick, causal encoder (this run)"
    assert table["cells"]["softmax"][plain]["test_accuracy"] == 0.45  # not replaced by the causal row
    assert table["info"][causal_col]["causal"] and table["info"][causal_col]["learned"] is False
    assert "retnet" not in table["cells"] or plain not in table["cells"]["retnet"]


# A known front at N=4096, not causal: (speed-up, MiB, accuracy %).
FRONT = {
    "softmax": (1.0, 10, 0.90),  # most accurate
    "mid": (5.0, 8, 0.85),  # a trade-off
    "fast": (10.0, 5, 0.80),  # fastest, least memory
    "slow_bad": (0.5, 20, 0.70),  # dominated by softmax
    "shadow": (8.0, 6, 0.75),  # dominated by fast
}


def test_which_to_pick_is_the_pareto_front_of_the_data(tmp_path):
    speeds = [META] + [speed(m, 4096, s, mib) for m, (s, mib, _) in FRONT.items()]
    speeds += [speed("softmax", 1024, 1.0, 3, causal=True), speed("fast", 1024, 2.0, 9, causal=True)]
    speeds += [speed("fast", 16384, 20.0, 50, forward_only=True), speed("mid", 16384, 12.0, 40, forward_only=True)]
    trains = [train(m, "listops", acc) for m, (_, _, acc) in FRONT.items()]
    trains += [train("softmax", "mqar", 0.99, task_params={}), train("fast", "mqar", 0.5, task_params={})]
    runs = [loaded(tmp_path, "speed.jsonl", speeds), loaded(tmp_path, "train.jsonl", trains, committed=True)]
    table = pick.accuracy_table(results.of_kind(runs, "train"))
    speed_rows = results.of_kind(runs, "speed")
    result = pick.pick(table, speed_rows, 4096, False)
    assert result["metric"] == pick.FWD_BWD and [c.task for c in result["tasks"]] == ["listops"]
    assert result["front"] == ["softmax", "mid", "fast"]  # most accurate first
    assert "fastest and the least memory" in pick.sentence("fast", result)
    assert "5.0 points below softmax at 5x its speed" in pick.sentence("mid", result)
    # Causal picks rank on the causal task (MQAR), at 16K on the forward-only rows.
    causal = pick.pick(table, speed_rows, 1024, True)
    assert [c.task for c in causal["tasks"]] == ["mqar"] and causal["front"] == ["softmax", "fast"]
    long = pick.pick(table, speed_rows, 16384, False)
    assert long["metric"] == pick.FWD and long["front"] == ["mid", "fast"]
    html = sections.pick_section(table, speed_rows)
    assert html.count("<li") == 3 + 2 + 2 and "shadow:" not in html and "slow_bad:" not in html
    assert "N = 4096, causal" in html and "No mechanism has a speed row and an accuracy here" in html


def test_report_refuses_to_mix_speed_rows_from_different_machines(tmp_path):
    here = loaded(tmp_path, "a.jsonl", [META, speed("softmax", 1024, 1.0, 3)])
    there = loaded(tmp_path, "b.jsonl", [{**META, "processor": "Apple M3"}, speed("linear", 1024, 4.0, 3)])
    with pytest.raises(
        ValueError, match=r"2 different machines.*Apple M3, 2 CPUs, 2 threads: .*b\.jsonl.*must not mix machines"
    ):
        report.render([here, there], tmp_path / "out", gallery=False)
    # The command line says so on one line, with exit status 2.
    from attnzoo import cli

    assert cli.main(["report", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--out", str(tmp_path)]) == 2


def test_sources_dates_revisions_and_dirty_rows_are_labelled(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    path = write(repo / "train.jsonl", [train("softmax", "A", 0.8, git="1234567+dirty")])
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "train.jsonl"], ["commit", "-q", "-m", "results"]):
        subprocess.run(git + args, check=True, capture_output=True)
    run = results.load_run(path)  # tracked and unmodified: committed, dated by its commit
    assert run.origin == "committed" and run.rows[0]["_date"] == run.committed_in.split()[1]
    assert "committed: " in pick.source_label(run.rows[0]) and "git 1234567+dirty (DIRTY" in pick.source_label(
        run.rows[0]
    )
    assert results.load_run(write(tmp_path / "new.jsonl", [train("softmax", "A", 0.8)])).origin == "uncommitted"
    page = report.page([run], lambda name, draw: None, gallery=False)
    assert "1 row(s) were made at a dirty git revision" in page and "&dagger; dirty: 1234567+dirty" in page


def test_bad_input_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"kind": "meta"}\n\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        results.load_run(path)
    path.write_text('{"kind": "meta"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        results.load_run(path)
    with pytest.raises(ValueError, match="missing.jsonl"):
        results.load_run(tmp_path / "missing.jsonl")


def test_report_is_self_contained(tmp_path):
    meta = {**META, "command": "attnzoo bench speed --n 1024,4096", "torch": "2.13.0"}
    sdpa = [
        {"kind": "sdpa", "n": n, "causal": False, "forward_s": t, "forward_backward_s": 3 * t, "peak_forward_bytes": m}
        for n, t, m in ((1024, 1.0, 2**20), (4096, 16.0, 2**24))
    ]
    speeds = [speed(m, n, r, mib) for m, n, r, mib in (("softmax", 1024, 1, 1), ("softmax", 4096, 1, 16))]
    speeds += [speed("linear", 1024, 4, 1), speed("linear", 4096, 16, 2)]
    speeds.append({"kind": "speed", "mechanism": "local", "config": {}, "backend": "auto", "n": 1024, "error": "x"})
    prof = [
        {"kind": "profile", "mechanism": m, "config": {}, "n": n, "attention_s": a, "ffn_s": 1.0}
        | {"block_s": a + 1, "attention_share": a / (a + 1)}
        for m in ("softmax", "linear")
        for n, a in ((256, 0.5), (1024, 2.0))
    ]
    fidelity = [
        {"kind": "fidelity", "mechanism": "linear", "config": {}, "applicable": True, "mean_cosine": 0.91}
        | {"min_cosine": 0.5, "retrieval_at_1": 0.8, "model": "tiny"},
        {"kind": "fidelity", "mechanism": "fnet", "config": {}, "applicable": False, "reason": "a token mixer"},
    ]
    trains = [train("softmax", "A", 0.8), train("linear", "A", 0.7), train("linear", "B", None)]
    files = [
        write(tmp_path / "speed.jsonl", [meta, *sdpa, *speeds]),
        write(tmp_path / "train.jsonl", trains),
        write(tmp_path / "more.jsonl", [meta, *prof, *fidelity]),
    ]
    out = tmp_path / "report"
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    console = Console(width=200, record=True)
    assert report.main(parser.parse_args([*map(str, files), "--out", str(out)]), console) == []
    assert f"report: {out / 'index.html'}" in console.export_text()
    page = (out / "index.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page)
    images = re.findall(r'<img src="([^"]+)"', page)
    assert "bubbles.png" in images and any(i.startswith("gallery/") for i in images)
    assert any(i.startswith("profile-") for i in images) and any(i.startswith("time-fwd-bwd-") for i in images)
    for image in images:
        assert (out / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", image
    assert 'class="failed" title="RuntimeError: out of memory; uncommitted: ' in page and "failed: RuntimeError" in page
    assert "not applicable: a token mixer" in page and "AMD EPYC" in page
    assert "Which mechanism should I use?" in page and "linear: 16x dense SDPA" in page
    assert "N^" in page or "time-" in " ".join(images)


def test_optional_sections_without_rows_are_left_out_and_named(tmp_path):
    path = write(tmp_path / "speed.jsonl", [speed("softmax", 1024, 1.0, 1)])
    index, failed = report.render([results.load_run(path, origin="fresh")], tmp_path / "out", gallery=False)
    page = index.read_text()
    assert failed == []
    assert "Not in the inputs (left out): Is your bottleneck really attention?, Fidelity" in page
    assert 'id="profile"' not in page and "No train rows" in page and "No meta row" in page


def test_a_later_measurement_supersedes_a_file_that_sorts_later(tmp_path):
    # Two runs of one day: the newer one (by its meta timestamp) is the reference row, even where
    # the older file comes later in the input (its name sorts later).
    rows = []
    runs = (("a-new.jsonl", "2026-11-27T09:45:00+00:00", 2.0), ("b-old.jsonl", "2026-11-27T04:05:00+00:00", 0.5))
    for name, when, ratio in runs:
        meta = {"kind": "meta", "date": when}
        row = {"kind": "speed", "mechanism": "random", "n": 1024, "speedup_forward_backward_vs_sdpa": ratio}
        (tmp_path / name).write_text(json.dumps(meta) + "\n" + json.dumps(row) + "\n")
        rows += results.load_run(tmp_path / name, origin="uncommitted").rows
    chosen = pick.one_per(rows, lambda r: r["mechanism"])
    assert chosen["random"]["speedup_forward_backward_vs_sdpa"] == 2.0


def test_speed_rows_on_scaled_inputs_are_left_out_of_the_report(tmp_path):
    # bench speed --input-scale times another experiment (q, k several times unit variance):
    # its rows must not stand in for the unit-variance figures, even from the same machine.
    plain = [META, speed("softmax", 1024, 1.0, 1), speed("linear", 1024, 3.25, 1)]
    scaled = [META, speed("linear", 1024, 7.75, 1, input_scale=10.0), speed("lsh", 1024, 5.5, 1, input_scale=10.0)]
    runs = [
        results.load_run(write(tmp_path / name, rows), origin="fresh")
        for name, rows in (("a.jsonl", plain), ("b.jsonl", scaled))
    ]
    index, failed = report.render(runs, tmp_path / "out", gallery=False)
    page = index.read_text()
    assert failed == [] and "<th>linear</th>" in page and "lsh" not in page and "b.jsonl, 2026" not in page
