"""Nothing silent under bad input and faults (issue 14): state dicts, empty inputs, padding that
holds NaN or inf, exact float64 gradients, non-finite queries, dtype and device at the layer
boundary, refusals, and the command line's errors and failed runs."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import attnzoo
from attnzoo.bench import checkpoint
from attnzoo.bench.configs import sized
from attnzoo.nn import MultiHeadAttention
from conftest import grads, make_qkv

ATTENTION = attnzoo.names(kind="attention")
N = 16  # every mechanism's sized config fits this length (axial and block2d on a 4x4 grid)


def _mha(name: str) -> MultiHeadAttention:
    return MultiHeadAttention(32, 2, name, **sized(name, N))


# --- one registration per mechanism: complete, storable state dicts ---------------------------


@pytest.mark.parametrize("name", ATTENTION)
def test_state_dict_saves_with_safetensors_and_is_complete_before_the_first_forward(name, tmp_path):
    mha = _mha(name)
    before = mha.state_dict()
    save_file(before, str(tmp_path / "mha.safetensors"))  # refuses tensors that share memory
    assert not any(key.startswith("attn.") for key in before), "the mechanism is registered twice"
    mha(torch.randn(2, N, 32), causal=_causal_only(name))
    assert list(mha.state_dict()) == list(before)
    # And the file loads back into a fresh layer (strict: no key missing or left over).
    fresh = _mha(name)
    fresh.load_state_dict(load_file(str(tmp_path / "mha.safetensors")))


@pytest.mark.parametrize("name", attnzoo.names())
def test_a_layer_builds_every_mechanism_with_its_state_dict_complete_before_the_first_forward(name):
    """Attention and token mixers alike: the layer's ``attnzoo.Shape`` (heads, head width,
    ``max_len``) creates every per-head and per-position tensor at construction, so nothing is
    added by the first forward and a checkpoint loads into a layer that has never run."""
    config = {key: value for key, value in sized(name, N).items() if key != "max_len"}
    layer = attnzoo.nn.TransformerEncoderLayer(32, 2, name, max_len=N, **config)
    before = layer.state_dict()
    layer(torch.randn(2, N, 32), causal=_causal_only(name))
    assert list(layer.state_dict()) == list(before)
    fresh = attnzoo.nn.TransformerEncoderLayer(32, 2, name, max_len=N, **config)
    fresh.load_state_dict(before)  # strict


def test_a_checkpoint_with_the_old_duplicate_keys_still_loads():
    mha = _mha("sinkhorn")
    state = mha.state_dict()
    old = {
        **state,
        **{
            "attn." + key[len("mechanisms.0.") :]: value
            for key, value in state.items()
            if key.startswith("mechanisms.0.")
        },
    }
    assert len(old) > len(state)
    fresh = _mha("sinkhorn")
    fresh.load_state_dict(old)  # strict
    assert all(torch.equal(fresh.state_dict()[key], value) for key, value in state.items())


def test_checkpoint_stores_a_tied_weight_once_and_keeps_it_tied(tmp_path):
    lm = attnzoo.nn.SHARNN(vocab_size=11, dim=8, depth=1)  # the head is tied to the embedding
    checkpoint.save(tmp_path / "lm.safetensors", lm, None, {})
    stored = load_file(str(tmp_path / "lm.safetensors"))
    assert "model.embed.weight" in stored and "model.head.weight" not in stored
    clone = attnzoo.nn.SHARNN(vocab_size=11, dim=8, depth=1)
    checkpoint.load(tmp_path / "lm.safetensors", clone)
    assert clone.head.weight is clone.embed.weight and torch.equal(clone.embed.weight, lm.embed.weight)


# --- empty inputs: one guard at the mechanisms' common entry point ----------------------------


def _empty_cases(name: str) -> list[tuple[int, int, int]]:
    """(B, N_q, N_kv): no batch; no query (against keys where the mechanism takes N_q != N_kv)."""
    cross = attnzoo.describe(name).capabilities.cross_attention
    return [(0, N, N), (2, 0, N if cross else 0)]


@pytest.mark.parametrize("name", ATTENTION)
def test_empty_batch_or_no_query_gives_an_empty_output(name):
    attn = attnzoo.build(name, **sized(name, N))
    head_dim = attnzoo.registry.config_fields(name).get("head_dim", (None, 8))[1] or 8
    heads = attnzoo.registry.config_fields(name).get("heads", (None, 2))[1] or 2
    for b, n_q, n_kv in _empty_cases(name):
        q = torch.randn(b, heads, n_q, head_dim, requires_grad=True)
        k, v = torch.randn(b, heads, n_kv, head_dim), torch.randn(b, heads, n_kv, head_dim)
        out = attn(q, k, v, causal=_causal_only(name))
        assert out.shape == (b, heads, n_q, head_dim), (b, n_q, n_kv)
        out.sum().backward()  # still on the graph: a training loop over an empty batch runs
        assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.parametrize("name", attnzoo.names(kind="mixer"))
def test_token_mixers_give_empty_outputs_for_empty_inputs(name):
    mixer = attnzoo.build(name, dim=32, **sized(name, N))
    for shape in ((0, N, 32), (2, 0, 32)):
        assert mixer(torch.randn(shape)).shape == shape


def test_a_query_without_any_key_is_still_refused():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 0, 8)
    with pytest.raises(ValueError, match="N_kv >= 1"):
        attnzoo.build("softmax")(q, k, k)


def test_layers_pass_empty_batches_and_sequences_through():
    mha = MultiHeadAttention(32, 2, positional="rope")
    assert mha(torch.randn(0, 5, 32)).shape == (0, 5, 32)
    assert mha(torch.randn(2, 0, 32)).shape == (2, 0, 32)
    encoder = attnzoo.nn.TransformerEncoder(32, 1, 2, "local", left=2, right=2)
    assert encoder(torch.randn(0, 5, 32), causal=True).shape == (0, 5, 32)


# --- mechanisms at small sizes, for the padding and gradient checks ----------------------------

HEADS, HEAD_DIM = 2, 4


def _small(name: str, n: int) -> torch.nn.Module:
    """``name`` sized for length ``n``, its heads / head_dim fields (where it has them) set to
    HEADS / HEAD_DIM; float64, eval mode (no dropout, Gumbel noise or fresh random draws)."""
    fields = attnzoo.registry.config_fields(name)
    geometry = {key: value for key, value in (("heads", HEADS), ("head_dim", HEAD_DIM)) if key in fields}
    return attnzoo.build(name, **sized(name, n), **geometry).double().eval()


def _causal_only(name: str) -> bool:
    """True for a mechanism defined causally only (it refuses causal=False)."""
    return not attnzoo.describe(name).capabilities.bidirectional


def _causal_modes(name: str) -> tuple[bool, ...]:
    caps = attnzoo.describe(name).capabilities
    return tuple(causal for causal in (False, True) if (caps.causal if causal else caps.bidirectional))


# --- exact gradients: float64 gradcheck of every mechanism -------------------------------------


@pytest.mark.parametrize("fast", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["projected", "full"])
@pytest.mark.parametrize("name", ATTENTION)
def test_float64_gradients_pass_gradcheck(name, fast):
    # Default parameters (sized for N = 8), B = 1, with padding; selections (top-k, buckets,
    # clusters) are piecewise constant and differentiable away from ties, which random inputs avoid.
    # By default a random projection of the Jacobian (fast_mode, ~0.1 s a mechanism); the whole
    # Jacobian is the slow variant (~1 s a mechanism).
    n = 8
    attn = _small(name, n)
    mask = torch.arange(n)[None, :] < n - 3
    for causal in _causal_modes(name):
        q, k, v = make_qkv(1, HEADS, n, n, d=HEAD_DIM)
        attend = lambda q, k, v, causal=causal: attn(q, k, v, causal=causal, key_mask=mask)  # noqa: E731
        torch.autograd.gradcheck(attend, (q, k, v), fast_mode=fast)


# --- a non-finite query: NaN in its own row, never an unrelated crash --------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_routing_gives_a_non_finite_query_a_nan_row_and_leaves_the_rest(causal, value):
    attn = attnzoo.build("routing")
    q, k, v = make_qkv(2, 2, N, N, d=8, dtype=torch.float32, requires_grad=False)
    q[0, 1, 5, 2] = value
    out = attn(q, k, v, causal=causal)
    bad = ~torch.isfinite(out).all(-1)
    assert bad.nonzero().tolist() == [[0, 1, 5]] and out[0, 1, 5].isnan().all()
    attn.train()(q, k, v, causal=causal)
    assert torch.isfinite(attn.centroids).all()  # the query moved no centroid


@pytest.mark.parametrize("name", ATTENTION)
def test_a_non_finite_query_touches_only_its_own_row(name):
    # NaN or +-inf in one real query: its row is NaN (never zeros or a finite limit, which would
    # hide it; torch's own CPU SDPA returns zeros for a NaN query that sees few keys), the other
    # rows equal the clean run.
    # Row 0 is a global token in the patterns that have them; row 5 is an ordinary one.
    attn = _small(name, N)
    for causal, value, row in itertools.product(_causal_modes(name), (math.nan, math.inf, -math.inf), (0, 5)):
        q, k, v = make_qkv(2, HEADS, N, N, d=HEAD_DIM, requires_grad=False)
        clean = attn(q, k, v, causal=causal)
        q[0, 1, row, 2] = value
        out = attn(q, k, v, causal=causal)
        what = f"{name} causal={causal} query {row} holding {value}"
        assert out[0, 1, row].isnan().all(), f"{what}: its row is {out[0, 1, row]}"
        others = torch.ones(out.shape[:3], dtype=torch.bool)
        others[0, 1, row] = False
        if not attnzoo.describe(name).capabilities.independent_queries:
            # Other rows depend on every query by definition (lsh shares Q and K, nystrom's
            # landmarks are means of queries, routing's clusters take w queries each).
            assert not torch.isinf(out[others]).any(), what
        else:
            # Equal up to float64 rounding, not bit for bit: a mechanism that batches queries by
            # what they selected (moba) regroups the other rows when this one selects differently.
            torch.testing.assert_close(
                out[others], clean[others], rtol=1e-12, atol=1e-12, msg=f"{what}: the other rows"
            )


# --- padding is inert whatever it holds --------------------------------------------------------

POISONS = (math.nan, math.inf, 1e30)


def _padding(n: int, side: str) -> torch.Tensor:
    """``(4, n)``, True = real: all padding, 5 real, n - 5 real, unpadded; padding on one side."""
    right = torch.arange(n)[None, :] < torch.tensor([0, 5, n - 5, n])[:, None]
    return right if side == "right" else right.flip(-1)


def _run(module, inputs: tuple[torch.Tensor, ...], **kwargs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The output of ``module`` and the gradients of ``<output, g>`` (random g, every element)
    with respect to ``inputs`` and the module's parameters."""
    leaves = tuple(x.detach().requires_grad_() for x in inputs)
    out = module(*leaves, **kwargs)
    return out, grads(out, leaves + tuple(module.parameters()))


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", ATTENTION)
def test_padding_is_inert_whatever_it_holds(name):
    # Padded k and v hold NaN, inf or 1e30 (and padded q too where the mechanism is self-attention
    # only, so its mask marks the queries): outputs and gradients equal the zero-padded run exactly,
    # and the poisoned positions get zero gradient.
    attn = _small(name, N)
    poison_q = not attnzoo.describe(name).capabilities.cross_attention
    for causal, side in itertools.product(_causal_modes(name), ("right", "left")):
        mask = _padding(N, side)
        pad = ~mask[:, None, :, None]
        clean = tuple(torch.randn(4, HEADS, N, HEAD_DIM, dtype=torch.float64).masked_fill(pad, 0.0) for _ in range(3))
        want, want_grads = _run(attn, clean, causal=causal, key_mask=mask)
        for poison in POISONS:
            q, k, v = clean
            q = q.masked_fill(pad, poison) if poison_q else q
            dirty = (q, k.masked_fill(pad, poison), v.masked_fill(pad, -poison))
            what = f"{name} causal={causal} {side} padding holding {poison}"
            out, got_grads = _run(attn, dirty, causal=causal, key_mask=mask)
            _same(out, want, f"{what}: output")
            for i, (got, expected) in enumerate(zip(got_grads, want_grads)):
                _same(got, expected, f"{what}: gradient {i}")
            for got in got_grads[int(not poison_q) : 3]:
                assert not got.masked_select(pad).any(), f"{what}: a padded position got a gradient"
            # The weights the forward applies see the same zeroed inputs.
            if not attnzoo.describe(name).capabilities.weights_apply_to_v:
                continue
            implied = (attn.implied_attention(*x[:2], causal=causal, key_mask=mask) for x in (dirty, clean))
            _same(*implied, f"{what}: implied_attention")


@pytest.mark.parametrize("name", ATTENTION)
def test_padded_tokens_are_inert_in_a_self_attention_layer(name):
    # The layer zeroes padded tokens before its projections: its mask marks the queries too, so
    # NaN in a padded token cannot reach any real output or gradient (weights included), whatever
    # the mechanism does with padded query rows.
    mha = _mha(name).double().eval()
    for causal, side in itertools.product(_causal_modes(name), ("right", "left")):
        mask = _padding(N, side)
        x = torch.randn(4, N, 32, dtype=torch.float64).masked_fill(~mask[..., None], 0.0)
        want, want_grads = _run(mha, (x,), causal=causal, key_mask=mask)
        for poison in POISONS:
            what = f"{name} causal={causal} {side} padding holding {poison}"
            out, got_grads = _run(mha, (x.masked_fill(~mask[..., None], poison),), causal=causal, key_mask=mask)
            _same(out, want, f"{what}: output")
            for i, (got, expected) in enumerate(zip(got_grads, want_grads)):
                _same(got, expected, f"{what}: gradient {i}")


# --- refusals name what can stand in ------------------------------------------------------------


@pytest.mark.parametrize("name", attnzoo.names(kind="attention", causal=False))
def test_causal_refusal_suggests_only_attention_mechanisms_that_are_causal(name):
    q = torch.randn(1, 2, N, 8)
    with pytest.raises(ValueError, match="does not support causal=True") as error:
        attnzoo.build(name, **sized(name, N))(q, q, q, causal=True)
    suggested = str(error.value).split("mechanisms that do: ", 1)[1].split(", ")
    assert suggested == attnzoo.names(kind="attention", causal=True)
    assert not set(suggested) & set(attnzoo.names(kind="mixer"))


# --- dtype and device at the layer boundary ----------------------------------------------------

LAYERS = {  # a float32 layer with parameters, and a matching input
    "MultiHeadAttention": (lambda: MultiHeadAttention(16, 2, "linformer", max_len=8), (2, 8, 16)),
    "TransformerEncoderLayer": (lambda: attnzoo.nn.TransformerEncoderLayer(16, 2), (2, 8, 16)),
    "TransformerEncoderLayer(gmlp)": (lambda: attnzoo.nn.TransformerEncoderLayer(16, 2, "gmlp", max_len=8), (2, 8, 16)),
    "CBAM": (lambda: attnzoo.nn.CBAM(8, reduction=2), (2, 8, 4, 4)),
    "SingleHeadAttention": (lambda: attnzoo.nn.sharnn.SingleHeadAttention(16), (2, 8, 16)),
}


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_an_input_of_another_dtype_is_refused_at_the_layer_naming_both(layer, dtype):
    make, shape = LAYERS[layer]
    module = make()
    with pytest.raises(
        TypeError,
        match=rf"x is {dtype} on cpu, but \w+'s parameters are torch.float32 on cpu; "
        rf"move the input \(x.to\('cpu', torch.float32\)\)",
    ):
        module(torch.randn(shape, dtype=dtype))
    module.to(dtype)(torch.randn(shape, dtype=dtype))  # the fix the message gives works


@pytest.mark.parametrize("layer", LAYERS)
def test_an_input_on_another_device_is_refused_at_the_layer_naming_both(layer):
    make, shape = LAYERS[layer]
    with pytest.raises(TypeError, match="x is torch.float32 on meta, but .* on cpu"):
        make()(torch.randn(shape, device="meta"))


def test_tokens_and_context_are_checked_too():
    lm = attnzoo.nn.CausalLM(vocab_size=10, dim=16, depth=1, heads=2)
    with pytest.raises(TypeError, match=r"tokens is torch.int64 on meta.*move the input \(tokens.to\('cpu'\)\)"):
        lm(torch.zeros(1, 4, dtype=torch.long, device="meta"))
    mha = MultiHeadAttention(16, 2, kv_dim=8)
    with pytest.raises(TypeError, match="context is torch.float64 on cpu, but MultiHeadAttention's parameters"):
        mha(torch.randn(1, 4, 16), torch.randn(1, 5, 8, dtype=torch.float64))


def test_autocast_may_feed_a_float32_layer_low_precision_inputs():
    mha = MultiHeadAttention(16, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mha(torch.randn(2, 8, 16, dtype=torch.bfloat16)).shape == (2, 8, 16)


# --- the command line: one error line, exit code 2, nothing trained or written -----------------

TINY = [
    "bench",
    "train",
    "--task",
    "mqar",
    "--size",
    "quick",
    "--task-set",
    "n_train=64",
    "--task-set",
    "n_val=32",
    "--task-set",
    "n_test=32",
    "--dim",
    "16",
    "--depth",
    "1",
    "--heads",
    "2",
    "--batch-size",
    "16",
    "--steps",
    "4",
    "--eval-every",
    "2",
    "--checkpoint-every",
    "1",
    "--warmup",
    "1",
    "--quiet",
]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from attnzoo.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _train(capsys, tmp_path: Path, *extra: str, run: str = "run") -> tuple[int, str]:
    where = [
        "--data-dir",
        str(tmp_path / "data"),
        "--run-dir",
        str(tmp_path / run),
        "--results",
        str(tmp_path / "results.jsonl"),
    ]
    return _cli(capsys, *TINY, *where, *extra)


def _one_error(code: int, text: str, *needles: str) -> str:
    errors = [line for line in text.splitlines() if line.startswith("error:") or ": error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in text, text
    assert all(needle in errors[0] for needle in needles), errors[0]
    return errors[0]


@pytest.mark.parametrize("flag", ["--lr", "--stop-at", "--max-seconds"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_float_flag_that_is_not_finite_is_a_usage_error(capsys, tmp_path, flag, value):
    _one_error(*_train(capsys, tmp_path, f"{flag}={value}"), f"argument {flag}", "finite")
    assert not (tmp_path / "run").exists() and not (tmp_path / "results.jsonl").exists()


def test_train_config_refuses_non_finite_floats_naming_them():
    from attnzoo.bench.train import TrainConfig

    for name in ("lr", "clip", "weight_decay", "dropout", "max_seconds", "stop_at"):
        with pytest.raises(ValueError, match=f"^{name} must be a finite number, got inf"):
            TrainConfig(task="mqar", **{name: float("inf")})


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--mechanism", "local", "--set", "left=abc"], ["'left' must be int, got 'abc'"]),
        (["--mechanism", "local:left=abc"], ["'left' must be int, got 'abc'"]),
        (["--mechanism", "local", "--set", "lfet=3"], ["unknown config key(s) 'lfet'", "left"]),
        (["--task-set", "n_train"], ["key=value", "--task-set n_train"]),
        (["--device", "tpu"], ["device 'tpu'"]),
        (["--device", "mps"], ["device 'mps'", "cpu or cuda"]),
        (["--device", "cuda:7"], ["cuda"]),
    ],
)
def test_bad_values_end_in_one_error_line_before_any_training(capsys, tmp_path, argv, needles):
    _one_error(*_train(capsys, tmp_path, *argv), *needles)
    assert not (tmp_path / "run").exists() and not (tmp_path / "results.jsonl").exists()


def test_bad_paths_end_in_one_error_line_before_any_training(capsys, tmp_path):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir").mkdir()
    cases = [
        (["--init-from", str(tmp_path / "missing.safetensors")], "--init-from", "no such checkpoint file"),
        (["--run-dir", str(tmp_path / "a_file")], "--run-dir", "is a file"),
        (["--run-dir", str(tmp_path / "a_file" / "run")], "--run-dir", "is a file"),
    ]
    for argv, *needles in cases:
        _one_error(*_train(capsys, tmp_path, *argv), *needles)
    code, text = _cli(
        capsys,
        *TINY,
        "--data-dir",
        str(tmp_path / "data"),
        "--run-dir",
        str(tmp_path / "run"),
        "--results",
        str(tmp_path / "a_dir"),
    )
    _one_error(code, text, "--results", "is a directory")
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()  # refused before training


def test_mechanism_settings_and_set_merge():
    import argparse

    from attnzoo.bench import train_cli
    from attnzoo.bench.speed import parse_mechanism

    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    args = parser.parse_args(
        ["--task", "mqar", "--mechanism", "local:left=3", "--set", "right=2", "--task-set", "n_train=64,n_val=32"]
    )
    cfg = train_cli.config_from_args(args)
    assert cfg.mechanism == "local" and cfg.config == {"left": 3, "right": 2}
    assert cfg.task_overrides == {"n_train": 64, "n_val": 32}
    assert parse_mechanism("global:indices=(0, 5)", ["indices=(3,)"]) == ("global", {"indices": (3,)})  # --set wins


def test_show_merges_mechanism_settings_and_set(capsys, tmp_path):
    code, text = _cli(capsys, "show", "local:left=3", "--set", "right=2", "--n", "16", "--out", str(tmp_path / "l.png"))
    assert code == 0 and (tmp_path / "l.png").exists(), text


def test_a_truncated_checkpoint_names_the_file_and_the_previous_one_resumes(capsys, tmp_path):
    code, text = _train(capsys, tmp_path, "--steps", "3")
    assert code == 0, text
    last, prev = tmp_path / "run" / "last.safetensors", tmp_path / "run" / "last.prev.safetensors"
    assert checkpoint.read_meta(prev)["state"]["step"] <= checkpoint.read_meta(last)["state"]["step"]
    last.write_bytes(last.read_bytes()[:1000])
    error = _one_error(*_train(capsys, tmp_path, "--steps", "3"), str(last), "cannot be read", f"mv {prev} {last}")
    assert "last.prev" in error
    prev.replace(last)  # what the message says to do
    code, text = _train(capsys, tmp_path, "--steps", "3")
    assert code == 0, text
    first, again = (json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines())
    assert again["weight_digests"] == first["weight_digests"]  # resumed to the same result


def test_a_checkpoint_of_another_model_is_a_clear_error(capsys, tmp_path):
    code, text = _train(capsys, tmp_path, "--steps", "1", run="small")
    assert code == 0, text
    _one_error(
        *_train(
            capsys, tmp_path, "--steps", "1", "--dim", "32", "--init-from", str(tmp_path / "small" / "best.safetensors")
        ),
        "holds another model's weights",
    )


# --- a run that diverges stops, fails, and is recorded as failed -------------------------------


def test_a_diverging_run_stops_with_an_error_and_a_failed_row(capsys, tmp_path):
    code, text = _train(capsys, tmp_path, "--lr", "1e30")
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "diverged" in errors[0] and "Traceback" not in text, text
    (row,) = (json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines())
    assert row["status"] == "diverged" and row["diverged_step"] >= 1 and "diverged" in row["error"]
    assert not {"test_accuracy", "val_accuracy", "steps_per_s"} & set(row)
    # The report shows it as a failed run, not as a result.
    from attnzoo.bench import sections

    cell = sections.lra_table([row])["cells"]["softmax"]["mqar"]
    assert cell["accuracy"] is None and "diverged" in cell["errors"][0]
    assert "failed: diverged" in sections.lra_section([row])


def test_the_trainer_stops_before_a_non_finite_step_reaches_the_weights(tmp_path):
    from attnzoo.bench.train import TrainConfig, TrainingDiverged, train

    cfg = TrainConfig(
        task="mqar",
        task_overrides=dict(n_train=64, n_val=32, n_test=32),
        dim=16,
        depth=1,
        heads=2,
        batch_size=16,
        steps=4,
        eval_every=2,
        warmup=1,
        lr=1e30,
    )
    with pytest.raises(TrainingDiverged, match="diverged: loss nan") as error:
        train(cfg, run_dir=tmp_path / "run", data_dir=str(tmp_path / "data"), progress=False)
    assert error.value.row["status"] == "diverged"
