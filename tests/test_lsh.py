"""Reformer LSH attention beyond ``tests/test_contracts.py``: fast path == dense reference with
D_v != D and three rounds, low precision, limit laws, fresh rotations in training, the
independent union oracle, quality, no N x N in the backward, and decode steps on configs and
step sizes the contract does not reach."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms.lsh import reference_lsh
from conftest import grads, make_qkv, padding_mask, small_mechanism
from tolerances import assert_close_to_golden, assert_same

CONFIG = dict(n_hashes=3, n_buckets=4, block=8, seed=0)


def build(**kwargs) -> torch.nn.Module:
    """An eval-mode module: fixed rotations, so a second call (or the reference) sees the same."""
    return attnzoo.build("lsh", **{**CONFIG, **kwargs}).eval()


def reference(lsh, q, v, **kwargs):
    return reference_lsh(q, v, lsh.config, lsh.rotations(q.shape[1], q.shape[-1]), **kwargs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_hashes", [1, 2, 3])  # one round: its own path (no merge); two: shared pairs weigh ln 2
def test_fast_path_equals_reference_float64_with_value_width_unlike_the_keys(causal, n_hashes):
    q, k, v = make_qkv(2, 3, 45, 45, d=8, d_v=6)  # D_v != D: the kernel pads v's head
    mask = padding_mask(2, 45)
    lsh = build(n_hashes=n_hashes)
    out = lsh(q, k, v, causal=causal, key_mask=mask)
    ref = reference(lsh, q, v, causal=causal, key_mask=mask)
    assert_same(out, ref)
    for got, want, name in zip(grads(out, (q, v)), grads(ref, (q, v)), "qv"):
        assert_same(got, want, what=f"d{name}")


def test_fp32_within_policy():
    q, k, v = make_qkv(2, 2, 70, 70, d=16, dtype=torch.float32)
    lsh = build()
    golden = reference(lsh, q.double(), v.double(), causal=True)
    assert_close_to_golden(lsh(q, k, v, causal=True), reference(lsh, q, v, causal=True), golden.detach())


def test_one_bucket_and_one_chunk_is_full_attention_without_self():
    q, k, v = make_qkv(2, 2, 30, 30, requires_grad=False)
    lsh = build(n_hashes=2, n_buckets=1, block=64)
    keys = torch.nn.functional.normalize(q, dim=-1)
    not_self = lambda b, h, i, j: i != j  # noqa: E731
    assert_same(lsh(q, k, v), reference_attention(q, keys, v, mask_mod=not_self))
    causal = lsh(q, k, v, causal=True)
    assert_same(causal[:, :, 1:], reference_attention(q, keys, v, mask_mod=not_self, causal=True)[:, :, 1:])
    assert_same(causal[:, :, 0], v[:, :, 0])  # nothing else visible: the token attends to itself


def test_error_shrinks_as_hashing_rounds_grow():
    # Planted clusters: tokens near one of 8 directions. Full attention (the 1-bucket limit)
    # concentrates on a token's cluster; more hashing rounds find more of it.
    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(8, 16, generator=g, dtype=torch.float64), dim=-1)
    q = centres[torch.randint(0, 8, (256,), generator=g)] * 4 + 0.3 * torch.randn(
        256, 16, generator=g, dtype=torch.float64
    )
    q, v = q.view(1, 1, 256, 16), torch.randn(1, 1, 256, 16, generator=g, dtype=torch.float64)
    full = build(n_buckets=1, block=256)(q, q, v)
    errors = [
        float((build(n_hashes=h, n_buckets=16, block=32)(q, q, v) - full).norm() / full.norm()) for h in (1, 2, 4, 8)
    ]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.5 * errors[0], errors


def test_config_errors():
    with pytest.raises(ValueError, match="n_buckets must be 1 or even"):
        attnzoo.build("lsh", n_buckets=3)
    with pytest.raises(ValueError, match="block must be >= 1"):
        attnzoo.build("lsh", block=0)
    with pytest.raises(ValueError, match="self-attention only"):
        attnzoo.build("lsh")(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))


def test_training_draws_fresh_rotations_per_pass_head_and_layer():
    q, k, v = make_qkv(1, 2, 64, 64, requires_grad=False)
    torch.manual_seed(5)
    a, b = attnzoo.build("lsh", **{**CONFIG, "seed": None}), attnzoo.build("lsh", **{**CONFIG, "seed": None})
    assert int(a.rotation_seed) != int(b.rotation_seed)  # two layers, two seeds
    rot = a.rotations(2, 8)
    assert rot.shape == (3, 2, 8, 2) and not torch.equal(rot[:, 0], rot[:, 1])  # per head
    assert not torch.equal(a(q, k, v), a(q, k, v))  # training: a fresh draw every pass
    torch.manual_seed(1)
    first = a(q, k, v, causal=True)
    torch.manual_seed(1)
    assert torch.equal(a(q, k, v, causal=True), first)  # ...from torch's global RNG
    a.eval()
    assert torch.equal(a(q, k, v), a(q, k, v)) and not torch.equal(a(q, k, v), b.eval()(q, k, v))
    c = attnzoo.build("lsh", **{**CONFIG, "seed": None}).eval()
    c.load_state_dict(a.state_dict())  # the seed travels with the weights
    assert torch.equal(c(q, k, v), a(q, k, v))
    assert not torch.equal(
        attnzoo.build("lsh", **CONFIG, resample=False)(q, k, v),
        attnzoo.build("lsh", **CONFIG, resample=False)(q, k, v) * 0,
    )  # builds, runs


def test_causal_under_fresh_rotations():
    q, k, v = make_qkv(1, 2, 64, 64, requires_grad=False)
    lsh = attnzoo.build("lsh", **{**CONFIG, "seed": None})
    q2 = q.clone()
    q2[:, :, 40:] = torch.randn_like(q2[:, :, 40:]) * 3
    torch.manual_seed(3)
    before = lsh(q, k, v, causal=True)
    torch.manual_seed(3)
    assert_same(lsh(q2, k, v, causal=True)[:, :, :40], before[:, :, :40])


def test_dedupe_false_weighs_a_key_once_per_round():
    q, k, v = make_qkv(1, 2, 40, 40, requires_grad=False)
    union, multiset = build(n_hashes=4, block=4), build(n_hashes=4, block=4, dedupe=False)
    w_union, w_multi = union.implied_attention(q, k), multiset.implied_attention(q, k)
    assert_same(w_union.sum(-1), torch.ones_like(w_union.sum(-1)))
    assert_same(w_multi.sum(-1), torch.ones_like(w_multi.sum(-1)))
    assert not torch.allclose(w_union, w_multi)
    assert_same(union(q, k, v), w_union @ v)
    assert_same(multiset(q, k, v), w_multi @ v)


@pytest.mark.parametrize("causal, padded, dedupe", [(False, False, True), (True, True, True), (False, True, False)])
def test_rounds_combine_as_the_independent_union_oracle(causal, padded, dedupe):
    from attnzoo.mechanisms.lsh import buckets
    from oracles import lsh_union_oracle

    q, k, v = make_qkv(2, 2, 21, 21, d=4, d_v=3)
    mask = padding_mask(2, 21) if padded else None
    lsh = build(n_hashes=3, n_buckets=4, block=3, dedupe=dedupe)
    real = torch.ones(2, 21, dtype=torch.bool) if mask is None else mask
    keys = torch.nn.functional.normalize(q.detach(), dim=-1)
    table = torch.stack([buckets(keys, rot, real) for rot in lsh.rotations(2, 4)])  # [R, B, H, N]
    out = lsh(q, k, v, causal=causal, key_mask=mask)
    want = lsh_union_oracle(q, v, table, 3, causal=causal, key_mask=mask, dedupe=dedupe)
    assert_same(out, want)
    for got, exp, name in zip(grads(out, (q, v)), grads(want, (q, v)), "qv"):
        assert_same(got, exp, what=f"d{name}")


@pytest.mark.parametrize("causal", [False, True])
def test_no_n_by_n_tensor_forward_or_backward(causal):
    from conftest import LargestTensor

    n = 2048
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
    lsh = build(n_hashes=2, n_buckets=16, block=32)
    with LargestTensor() as probe:
        lsh(q, k, v, causal=causal).sum().backward()
    # Each round holds (chunks, c, 2c) mask entries per head: about 2 c N, far below N x N.
    assert probe.numel < n * n // 8, probe.numel


# --- decode steps: the contract checks step == causal forward on the sized config ------------


def steps(lsh, q, v, sizes, mask=None):
    """Decode in steps of ``sizes`` tokens (k is not read: shared QK)."""
    state = lsh.init_state(q.shape[0], q.shape[1], q.shape[3], v.shape[3], dtype=q.dtype)
    outs, lo = [], 0
    for size in sizes:
        new = slice(lo, lo + size)
        out, state = lsh.step(state, q[:, :, new], q[:, :, new], v[:, :, new], key_mask=mask[:, new])
        outs.append(out)
        lo += size
    return torch.cat(outs, 2)


@pytest.mark.parametrize(
    "config",
    [
        dict(n_hashes=3, n_buckets=4, block=3),
        dict(n_buckets=1, block=5),
        dict(n_hashes=4, n_buckets=2, block=1, dedupe=False),
    ],
)
def test_steps_of_any_size_equal_the_causal_forward(config):
    # A prompt, then steps longer than a block (lsh_decode.BLOCK) among single tokens, with
    # padding at the start of one row and in the middle of the other.
    q, _, v = make_qkv(2, 3, 120, 120, d=8, d_v=5, requires_grad=False)
    mask = torch.ones(2, 120, dtype=torch.bool)
    mask[0, :30], mask[1, 50:60] = False, False
    lsh = build(**config)
    got = steps(lsh, q, v, [33, 1, 1, 40, 5, *[1] * 40], mask)
    assert_same(got, lsh(q, q, v, causal=True, key_mask=mask))


def test_a_step_attends_the_same_number_of_keys_at_any_position(monkeypatch):
    # Per round the bucket's last 2c tokens and the step's own: O(n_hashes c D) work per token.
    import attnzoo.mechanisms.lsh_decode as decode

    attended = []
    real_attend = decode.attend_gathered
    monkeypatch.setattr(
        decode, "attend_gathered", lambda q, k, *a: attended.append(k.shape[-2]) or real_attend(q, k, *a)
    )
    q, _, v = make_qkv(1, 2, 600, 600, requires_grad=False)
    lsh = build(block=4)
    steps(lsh, q, v, [*[1] * 20, 560, *[1] * 20], torch.ones(1, 600, dtype=torch.bool))
    assert attended[:20] == attended[-20:] == [3 * (2 * 4 + 1)] * 20  # n_hashes (2c + 1), at t < 20 and t > 580


def test_steps_refuse_fresh_rotations_and_follow_fixed_ones_in_training():
    q, _, v = make_qkv(1, 2, 40, 40, requires_grad=False)
    with pytest.raises(ValueError, match=r"resample=True.*\.eval\(\)"):
        attnzoo.build("lsh", **CONFIG).init_state(1, 2, 8, 8)
    fixed = attnzoo.build("lsh", **CONFIG, resample=False).double()  # training mode, fixed rotations
    got = steps(fixed, q, v, [9, *[1] * 31], torch.ones(1, 40, dtype=torch.bool))
    assert_same(got, fixed(q, q, v, causal=True))


@pytest.mark.parametrize("causal", [False, True])
def test_the_off_cpu_kernel_twin_gives_the_cpu_kernels_answer(monkeypatch, causal):
    # Off the CPU (CUDA) the chunk attention runs the flash kernel's plain-op twin: same output
    # and gradients, forced here on the CPU.
    from attnzoo.mechanisms import block_attend, lsh_chunks

    module = small_mechanism("lsh", 200, heads=2, head_dim=16)
    q, v = (torch.randn(2, 2, 200, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = padding_mask(2, 200)
    results = []
    for forward, backward in [
        (block_attend.flash_forward, block_attend.flash_backward),
        (block_attend._plain_forward, block_attend._plain_backward),
    ]:
        monkeypatch.setattr(lsh_chunks, "flash_forward", forward)
        monkeypatch.setattr(lsh_chunks, "flash_backward", backward)
        out = module(q, q, v, causal=causal, key_mask=mask)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, v))))
    for kernel, plain in zip(*results, strict=True):
        torch.testing.assert_close(plain, kernel)


def test_missed_rounds_counts_the_rounds_whose_codes_differ_by_more_than_0_or_1_at_any_code_width():
    # Codes that fit int16 are compared narrowed; larger ones (long sequences, many buckets) keep
    # their width: here every other position's codes move by 2**16 in one round, which an int16
    # difference would not see.
    import dataclasses

    import torch.nn.functional as F

    from attnzoo.mechanisms import lsh_chunks

    g = torch.Generator().manual_seed(0)
    laid = [lsh_chunks.layout(torch.randint(0, 4, (2, 3, 70), generator=g), 4, 8) for _ in range(3)]
    rounds = [r for r, *_ in laid]
    moved = rounds[1].code + (torch.arange(70) % 2) * 2**16
    for others in ([rounds[1], rounds[2]], [dataclasses.replace(rounds[1], code=moved), rounds[2]]):
        position = laid[0][1]
        bh, chunks = position.shape[0], position.shape[1] // 8
        key_pos = lsh_chunks._windows(F.pad(position, (8, 0)), 8).flatten(1)
        want = torch.zeros(bh, chunks, 8, 16, dtype=torch.long)
        for o in others:  # the rule itself, in int64
            code = o.code.flatten(0, 1)
            d = code.gather(1, position).view(bh, chunks, 8, 1) - code.gather(1, key_pos).view(bh, chunks, 1, 16)
            want += (d != 0) & (d != 1)
        missed = lsh_chunks.missed_rounds(others, position, 8)
        assert torch.equal(missed.long(), want) and int(want.min()) < 2 and int(want.max()) == 2


@pytest.mark.parametrize("others", [1, 2, 3])
def test_discounted_mask_subtracts_log_of_the_rounds_that_show_each_pair(others):
    from attnzoo.mechanisms import lsh_chunks

    g = torch.Generator().manual_seed(1)
    key_term = torch.zeros(2, 3, 1, 8).masked_fill_(torch.rand(2, 3, 1, 8, generator=g) < 0.3, float("-inf"))
    fixed = torch.zeros(4, 8).masked_fill_(torch.rand(4, 8, generator=g) < 0.3, float("-inf"))
    missed = torch.randint(0, others + 1, (2, 3, 4, 8), generator=g, dtype=torch.int16)
    shown = 1 + others - missed.double()  # N_ij: this round and the others that show the pair
    want = (key_term.double() + fixed.double() - shown.log()).float()
    torch.testing.assert_close(lsh_chunks.discounted(key_term, fixed, missed, others), want)


@pytest.mark.parametrize("n_buckets", [1, 2, 8])
def test_round_buckets_hash_every_round_as_buckets_does_one_at_a_time(n_buckets):
    # Ties included: zero keys (unit(0) = 0) project to 0 everywhere, where argmax takes the
    # first index; padded tokens go to the extra bucket.
    import torch.nn.functional as F

    from attnzoo.mechanisms.lsh_chunks import buckets, round_buckets

    g = torch.Generator().manual_seed(3)
    keys = F.normalize(torch.randn(2, 3, 40, 8, generator=g), dim=-1)
    keys[:, :, :5] = 0
    real = torch.rand(2, 40, generator=g) > 0.2
    rotations = torch.randn(3, 3, 8, n_buckets // 2, generator=g)
    want = torch.stack([buckets(keys, r, real) for r in rotations])
    assert torch.equal(round_buckets(keys, rotations, real), want)


@pytest.mark.parametrize("shift", [0, 2**25])
def test_met_once_is_the_discounted_mask_of_one_other_round(shift):
    # The two-round mask from float codes equals the int16 count's, also where the codes pass
    # float32's 24 bits (shift): they are then differenced in float64.
    import dataclasses

    from attnzoo.mechanisms import lsh_chunks

    g = torch.Generator().manual_seed(4)
    laid = [lsh_chunks.layout(torch.randint(0, 4, (2, 3, 70), generator=g), 4, 8) for _ in range(2)]
    position, other = laid[0][1], dataclasses.replace(laid[1][0], code=laid[1][0].code + shift)
    chunks = position.shape[1] // 8
    key_ok = torch.rand(position.shape[0], chunks, 16, generator=g) > 0.3
    fixed = torch.zeros(8, 16).masked_fill_(torch.rand(8, 16, generator=g) < 0.3, float("-inf"))
    key_term = torch.zeros(position.shape[0], chunks, 1, 16).masked_fill_(~key_ok[:, :, None], float("-inf"))
    want = lsh_chunks.discounted(key_term, fixed, lsh_chunks.missed_rounds([other], position, 8), 1)
    got = lsh_chunks.met_once(other, position, key_ok, fixed, 8)
    finite = want[torch.isfinite(want)]
    assert (finite == 0).any() and (finite < 0).any()  # pairs the other round shows, and pairs it does not
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
