"""The README's usage example runs as written; the CLI lists, describes and demos."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from attnzoo.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run_as_written():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README must contain a python usage example"
    assert len(blocks[0].strip().splitlines()) <= 5, "the first example is the five-line one"
    namespace: dict = {}
    for block in blocks:  # later blocks continue from earlier ones, as a reader would run them
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["out"].shape == (2, 8, 1024, 64)
    assert namespace["y"].shape == (2, 1024, 512)
    assert torch.isfinite(namespace["y"]).all()


def test_list_shows_softmax_with_capabilities(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "softmax" in line)
    for word in ("exact", "causal", "key_mask", "decode_step", "cross_attention"):
        assert word in row


def test_describe_and_unknown_name(capsys):
    assert main(["describe", "softmax"]) == 0
    out = capsys.readouterr().out
    assert "1706.03762" in out and "normalizer" in out
    assert main(["describe", "softmx"]) == 2
    assert "did you mean 'softmax'" in capsys.readouterr().out


def test_demo_reports_agreement(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    diffs = [float(x) for x in re.findall(r"max \|diff\|\s*=\s*([0-9.e+-]+)", out)]
    assert len(diffs) == 3 and max(diffs) < 1e-4


def test_bad_subcommand_exits_with_usage():
    with pytest.raises(SystemExit):
        main(["frobnicate"])


def test_show_draws_a_pattern_and_the_gallery(tmp_path, capsys):
    assert main(["show", "local", "--set", "left=3", "--grid", "8", "--out", str(tmp_path / "local.png")]) == 0
    assert (tmp_path / "local.png").stat().st_size > 0
    assert main(["show", "softmax", "--n", "16", "--out", str(tmp_path / "softmax.png")]) == 0
    assert main(["show", "lsh", "--n", "32", "--out", str(tmp_path / "lsh.png")]) == 0  # a real forward's weights
    assert main(["show", "--all", "--out", str(tmp_path / "gallery")]) == 0
    assert (tmp_path / "gallery" / "index.html").exists()
    assert main(["show"]) == 2 and "--all" in capsys.readouterr().out
