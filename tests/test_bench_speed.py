"""``attnzoo bench speed`` structure (timings themselves are never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from attnzoo import patterns as P
from attnzoo.bench import speed
from attnzoo.cli import main


def test_parse_mechanism_reads_literals():
    assert speed.parse_mechanism("local:left=256,right=3") == ("local", {"left": 256, "right": 3})
    assert speed.parse_mechanism("global:indices=(0, 5)") == ("global", {"indices": (0, 5)})
    assert speed.parse_mechanism("softmax") == ("softmax", {})
    with pytest.raises(ValueError, match="key=value"):
        speed.parse_mechanism("local:left")
    with pytest.raises(ValueError, match="no mechanism named"):
        speed.parse_mechanism("locl")


def test_parse_mechanism_reads_brackets_and_patterns():
    # A comma inside [] belongs to the value, and a Pattern-typed field reads its text as a pattern.
    name, config = speed.parse_mechanism("pattern", ["pattern=per_head[local(8), strided(8)]"])
    assert config["pattern"] == P.per_head([P.local(8), P.strided(8)])
    assert speed.parse_settings("a=[1, 2],b={'x': (3, 4)},c=5") == {"a": [1, 2], "b": {"x": (3, 4)}, "c": 5}
    with pytest.raises(ValueError, match="unbalanced brackets"):
        speed.parse_settings("left=(3")
    with pytest.raises(ValueError, match="unknown builder 'loca'"):
        speed.parse_mechanism("pattern", ["pattern=loca(8)"])


def test_run_reports_ratios_checks_and_errors():
    setting = speed.Setting(
        mechanisms=(("local", {"left": 8, "right": 8, "tile": 64}), ("block2d", {})),
        backends=("blocked",),
        sizes=(256,),
        heads=2,
        dim=16,
        repeats=1,
    )
    rows = list(speed.run(setting))
    kinds = [r["kind"] for r in rows]
    assert kinds == ["meta", "sdpa", "speed", "speed"]
    meta, sdpa, local, block2d = rows
    assert meta["torch"] and meta["matmul_2048_gflops"] > 0
    assert local["correct"] and local["max_abs_error_vs_reference"] < 1e-4
    assert local["checked_by"] == "reference backend"
    assert local["backend_ran"] == "blocked (structured)"
    # The ratio is the median of interleaved pairs, so it lies within their spread.
    low, high = local["speedup_forward_spread"]
    assert low <= local["speedup_forward_vs_sdpa"] <= high
    assert local["sdpa_forward_s"] > 0 and local["sdpa_forward_backward_s"] > 0
    assert 0 < local["density"] < 0.1  # 17 keys of 256 per row, fewer at the edges
    assert local["density_bound"] == pytest.approx(1 / local["density"])
    assert local["forward_backward_s"] > 0 and local["blocks_ms"] >= 0
    # block2d's default image (32 x 32) does not fit N = 256: sized for it, and the row says so.
    assert "exactly h*w" in block2d["default_error"] and block2d["sized_for"] == 256 and block2d["correct"]


def test_cli_writes_json_lines(tmp_path, capsys):
    out = tmp_path / "speed.jsonl"
    code = main(
        [
            "bench",
            "speed",
            "--mechanism",
            "local:left=4,right=4,tile=32",
            "--n",
            "128",
            "--heads",
            "2",
            "--dim",
            "16",
            "--repeats",
            "1",
            "--no-backward",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["kind"] == "meta" and "bench speed" in rows[0]["command"]
    assert rows[-1]["mechanism"] == "local" and "forward_backward_s" not in rows[-1]
    assert "local:left=4,right=4,tile=32" in capsys.readouterr().out, "the table names the config asked for"


def test_device_is_checked_and_recorded(monkeypatch):
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        speed.Setting(mechanisms=(), device="mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device is available here; use --device cpu"):
        speed.Setting(mechanisms=(), device="cuda")
    assert "device" not in speed.machine("cpu")  # the CPU row names no accelerator


def test_mechanisms_without_a_backend_switch_are_checked_against_implied_attention():
    setting = speed.Setting(
        mechanisms=(("topk", {"topk": 8}),), sizes=(128,), heads=2, dim=16, repeats=1, backward=False
    )
    row = list(speed.run(setting))[-1]
    assert row["checked_by"] == "implied_attention @ v" and row["correct"]


def test_interleaved_alternates_and_takes_pairwise_ratios(monkeypatch):
    calls, clock = [], iter(range(100))
    monkeypatch.setattr(speed.time, "perf_counter", lambda: float(next(clock)))
    timed = speed.interleaved(lambda: calls.append("sdpa"), lambda: calls.append("mech"), repeats=3)
    assert calls == ["sdpa", "mech"] * 5  # two warm-ups, then three timed pairs, alternating
    assert timed["ratio"] == 1.0 and timed["spread"] == [1.0, 1.0] and timed["s"] == 1.0


def test_density_counts_against_the_pairs_sdpa_computes():
    assert speed.density(64.0, 8, causal=False) == 1.0
    assert speed.density(36.0, 8, causal=True) == 1.0  # causal SDPA computes 8 * 9 / 2 pairs
    assert speed.density(None, 8, causal=False) is None


def test_content_mechanisms_report_their_budget_as_keys_per_query():
    build = __import__("attnzoo").build
    # topk: k keys per row, all a causal row sees when it sees fewer (rows 0..3 see 1, 2, 3, 4)
    assert build("topk", topk=4).keys_per_query(10, causal=False) == 4.0
    assert build("topk", topk=2).keys_per_query(4, causal=True) == (1 + 2 + 2 + 2) / 4
    # moba causal, block 2, topk 2: the own block up to the row plus one earlier block
    assert build("moba", block=2, topk=2).keys_per_query(6, causal=True) == (1 + 2 + 3 + 4 + 3 + 4) / 6
    # nsa, block 2, n_select 2, window 2: window min(2, i + 1); selected: own block up to the row,
    # plus block 0 from the second block on; compressed: one key per complete block
    nsa = build("nsa", block=2, n_select=2, window=2, heads=1, head_dim=4)
    per_row = [1 + 1 + 0, 2 + 2 + 1, 2 + 1 + 2 + 1, 2 + 2 + 2 + 2]
    assert nsa.keys_per_query(4, causal=True) == sum(per_row) / 4
    # hierarchical with k >= N - 1 is full attention over tokens: N keys per row
    assert build("hierarchical", k=7).keys_per_query(8, causal=False) == 8.0
    # and the speed report turns a budget into pairs; a data-dependent one reports none
    assert speed.useful_pairs(build("topk", topk=4), 10, causal=False) == 40.0
    assert speed.useful_pairs(build("lsh"), 64, causal=False) is None


def test_crossover_is_the_smallest_n_from_which_the_mechanism_stays_ahead():
    rows = [
        {"n": 512, "speedup_forward_backward_vs_sdpa": 1.2},
        {"n": 1024, "speedup_forward_backward_vs_sdpa": 0.9},
        {"n": 2048, "speedup_forward_backward_vs_sdpa": 1.5},
        {"n": 4096, "speedup_forward_backward_vs_sdpa": 3.0},
    ]
    assert speed.crossover(rows) == 2048
    assert speed.crossover(rows[:2]) is None
    assert speed.crossover([{"n": 512, "speedup_forward_vs_sdpa": 2.0}]) == 512


def test_fitted_exponents():
    assert speed.fitted_exponent([1000, 2000, 4000], [1.0, 4.0, 16.0]) == pytest.approx(2.0)
    assert speed.fitted_exponent([1000, 2000], [3.0, 6.0]) == pytest.approx(1.0)
    assert speed.fitted_exponent([1000], [3.0]) is None
    assert speed.fitted_exponent([1000, 2000], [0, 5.0]) is None  # unmeasured memory is skipped
    setting = speed.Setting(
        mechanisms=(("local", {"left": 4, "right": 4, "tile": 32}),),
        sizes=(64, 128),
        heads=1,
        dim=16,
        repeats=1,
        backward=False,
    )
    fit = list(speed.run(setting))[-1]
    assert fit["kind"] == "fit" and fit["sizes"] == [64, 128] and fit["time_exponent"] is not None
    assert "crossover_n" in fit and fit["causal"] is False


def test_decode_bench_times_steps_and_refuses_mechanisms_without_one():
    from attnzoo.bench import decode

    mechanisms = (("softmax", {}), ("local", {"left": 4, "right": 0}), ("random", {}))
    rows = list(decode.run(mechanisms, (16, 64), "test", heads=1, dim=8))
    assert rows[0]["kind"] == "meta"
    assert [r["position"] for r in rows[1:3]] == [16, 64] and all(r["steps_per_s"] > 0 for r in rows[1:3])
    # softmax's cache grows with the position (room preallocated for position + 33 tokens, K and
    # V in float32); local's window of 4 keys does not.
    assert [r["state_bytes"] for r in rows[1:3]] == [2 * (n + 33) * 8 * 4 for n in (16, 64)]
    assert rows[3]["state_bytes"] == rows[4]["state_bytes"] < rows[1]["state_bytes"]
    assert "no decode step" in rows[5]["error"]


def test_state_bytes_counts_a_shared_storage_once():
    from attnzoo.bench.decode import state_bytes

    base = torch.zeros(10)
    assert state_bytes((base[:5], base[5:], [base], {"x": torch.zeros(2, dtype=torch.float64)})) == 40 + 16


def test_token_mixers_are_timed_without_a_claimed_speedup():
    setting = speed.Setting(
        mechanisms=(("fnet", {}), ("gmlp", {})), sizes=(64,), heads=2, dim=8, repeats=1, backward=False
    )
    rows = [r for r in speed.run(setting) if r["kind"] == "speed"]
    assert [r["mechanism"] for r in rows] == ["fnet", "gmlp"]
    assert all(r["forward_s"] > 0 and r["correct"] is None and "speedup_forward_vs_sdpa" not in r for r in rows)


def test_peak_memory_counts_a_large_temporary_after_timing_released_the_heap():
    from attnzoo.bench.speed import peak_memory

    mib = 1024 * 1024
    first = peak_memory(lambda: torch.ones(12 * mib // 4))  # 12 MiB of float32
    if first is None:
        pytest.skip("no /proc peak-memory probe on this system")
    # After the probe the allocator keeps freed memory resident (as a long-running process
    # does), so later timings do not page-fault; the next probe must still see a fresh peak.
    for _ in range(3):
        torch.ones(16 * mib // 4).sum()
    again = peak_memory(lambda: torch.ones(12 * mib // 4))
    assert first >= 11 * mib and again >= 11 * mib, (first / mib, again / mib)


def test_decode_bench_sizes_a_default_that_does_not_reach_the_position_and_says_so():
    from attnzoo.bench import decode

    rows = list(decode.run((("routing", {}), ("routing", {"n_clusters": 2})), (40,), "test", heads=2, dim=8))
    sized, chosen = rows[1], rows[2]
    assert "window=" in sized["default_error"] and sized["sized_for"] == 40 + decode.STEPS + 1
    assert sized["config"]["window"] > 0 and sized["steps_per_s"] > 0
    assert "window=" in chosen["error"] and "sized_for" not in chosen  # a chosen config is not changed


def test_speed_bench_sizes_a_default_defined_on_one_length_and_says_so():
    # axial's default 32 x 32 grid is defined at N = 1024 only: at N = 64 the default is sized
    # (an 8 x 8 grid, checked at N = 64 itself); a chosen grid is reported as it fails.
    mechanisms = (("axial", {}), ("axial", {"h": 32, "w": 32}))
    setting = speed.Setting(mechanisms=mechanisms, sizes=(64,), heads=2, dim=8, repeats=1)
    rows = [r for r in speed.run(setting) if r.get("mechanism") == "axial"]
    sized, chosen = rows[0], rows[1]
    assert "h*w = 1024" in sized["default_error"] and sized["sized_for"] == 64
    assert sized["config"] == {"h": 8, "w": 8} and sized["correct"] and sized["forward_s"] > 0
    assert "h*w = 1024" in chosen["error"] and "sized_for" not in chosen  # a chosen config is not changed


def test_a_default_sized_per_n_fits_as_one_mechanism():
    # axial's default 32 x 32 grid is defined at N = 1024 only: at 36 and 64 it is sized (6 x 6,
    # 8 x 8), and the fit joins those sizes (one line, one crossover), as for any default config.
    setting = speed.Setting(mechanisms=(("axial", {}),), sizes=(36, 64), heads=2, dim=8, repeats=1)
    fits = [r for r in speed.run(setting) if r["kind"] == "fit"]
    assert len(fits) == 1 and fits[0]["sizes"] == [36, 64] and fits[0]["config"] == {}


def test_input_scale_multiplies_q_and_k_for_both_sides_and_is_recorded():
    # A trained model's q, k are often several times unit variance: --input-scale times them
    # that way (v stays unit variance), for SDPA and the mechanism alike, and says so in the rows.
    setting = speed.Setting(mechanisms=(("local", {"left": 4, "right": 4}),), sizes=(64,), heads=2, dim=8, repeats=1)
    scaled = speed.Setting(**{**setting.__dict__, "input_scale": 10.0})
    torch.manual_seed(0)
    base = speed._inputs(setting, 4096, False)
    torch.manual_seed(0)
    big = speed._inputs(scaled, 4096, False)
    assert torch.equal(big[0], 10 * base[0]) and torch.equal(big[1], 10 * base[1]) and torch.equal(big[2], base[2])
    rows = list(speed.run(scaled))
    assert [r.get("input_scale") for r in rows[1:]] == [10.0, 10.0] and rows[-1]["correct"]
    assert "input_scale" not in list(speed.run(setting))[-1]
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"input_scale \(--input-scale\) must be a finite number > 0"):
            speed.Setting(mechanisms=(), input_scale=bad)


def test_machines_sharing_a_processor_name_differ_by_their_cpu_flags(monkeypatch):
    # Two cloud Xeons both read "Intel(R) Xeon(R) Processor"; one has AMX tiles. Their speed files
    # must not count as one machine's (the suite and the report mix no machines in a ratio).
    from attnzoo.bench.results import machine_identity

    info = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu sse avx2 avx512f {}\n"
    monkeypatch.setattr(speed.platform, "processor", lambda: "")
    rows = []
    for extra in ("", "amx_tile amx_bf16"):
        monkeypatch.setattr(speed, "_cpuinfo", lambda extra=extra: info.format(extra))
        rows.append(speed.machine())
    assert [r["processor"] for r in rows] == ["Intel(R) Xeon(R) Processor"] * 2
    assert rows[0]["cpu_flags"] == ["avx2", "avx512f"]
    assert rows[1]["cpu_flags"] == ["avx2", "avx512f", "amx_tile", "amx_bf16"]
    identities = {machine_identity(r) for r in rows}
    identities.add(machine_identity({k: v for k, v in rows[0].items() if k != "cpu_flags"}))  # an older file
    assert len(identities) == 3
    monkeypatch.setattr(speed, "_cpuinfo", lambda: "")  # no /proc/cpuinfo (macOS): no flags recorded
    assert "cpu_flags" not in speed.machine()
