"""topk (explicit sparse attention) and sac (sparse adaptive connections) beyond the contracts
(tests/test_contracts.py): fast == reference on sizes and predictors the contracts do not reach,
float32 against a float64 golden run, limit laws (k >= N is full attention), the selection rule
(ties, short rows), sac's candidates and its learned predictor, decode steps of several tokens."""

from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.mechanisms import topk as topk_module
from attnzoo.mechanisms.sac import SACConfig, sac_candidates
from attnzoo.mechanisms.topk import auto_chunk, kept_indices, largest, select_topk, topk_keep, topk_mask
from conftest import LargestTensor as Largest
from conftest import grads, make_qkv, padding_mask
from tolerances import assert_path_close_to_golden, assert_same

B, H, N, D = 2, 3, 37, 8
SAC = dict(topk=4, candidates=7, n_random=3, seed=1, head_dim=D)
CPU = torch.device("cpu")


def _mask(padded: bool = True) -> torch.Tensor | None:
    if not padded:
        return None
    mask = padding_mask(B, N)  # batch 0 is all padding: its rows see no key
    mask[1, -3:] = False
    return mask


def _build(name: str, **config):
    return attnzoo.build(name, **config) if name == "topk" else attnzoo.build("sac", **{**SAC, **config})


@pytest.mark.parametrize("n_q", [N, 23])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_topk_fast_equals_reference_in_chunks_that_do_not_divide_n(n_q, causal, padded):
    mask = _mask(padded)
    module = attnzoo.build("topk", topk=5, chunk=10)  # 10 does not divide 37 or 23
    q, k, v = make_qkv(B, H, n_q, N, D, d_v=5)
    fast = module(q, k, v, causal=causal, key_mask=mask)
    ref = module.reference(q, k, v, causal=causal, key_mask=mask)
    assert_same(fast, ref)
    fast_grads = grads(fast, (q, k, v))
    for a, r, name in zip(fast_grads, grads(ref, (q, k, v)), "qkv"):
        assert_same(a, r, what=f"grad {name}")
    if padded:
        assert torch.equal(fast[0], torch.zeros_like(fast[0]))
        assert all(torch.equal(g[0], torch.zeros_like(g[0])) for g in fast_grads)


@pytest.mark.parametrize("name", ["topk", "sac"])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_is_as_accurate_as_the_reference(name, causal):
    mask = _mask()
    module = _build(name, topk=5, chunk=16) if name == "topk" else _build(name)
    fast = lambda q, k, v: module(q, k, v, causal=causal, key_mask=mask)  # noqa: E731
    reference = lambda q, k, v: module.reference(q, k, v, causal=causal, key_mask=mask)  # noqa: E731
    assert_path_close_to_golden(fast, reference, make_qkv(B, H, N, N, D, dtype=torch.float32), what=name)


@pytest.mark.parametrize("chunk", [1, 7, 256])
def test_topk_does_not_depend_on_the_chunk(chunk):
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    expected = attnzoo.build("topk", topk=6, chunk=N)(q, k, v, causal=True)
    assert_same(attnzoo.build("topk", topk=6, chunk=chunk)(q, k, v, causal=True), expected)


@pytest.mark.parametrize("n_q", [N, 23])
@pytest.mark.parametrize("causal", [False, True])
def test_topk_with_k_at_least_n_is_full_attention(n_q, causal):
    mask = _mask()
    q, k, v = make_qkv(B, H, n_q, N, D)
    full = attnzoo.build("softmax")(q, k, v, causal=causal, key_mask=mask)
    full_grads = grads(full, (q, k, v))
    for topk in (N, N + 10):
        out = attnzoo.build("topk", topk=topk, chunk=9)(q, k, v, causal=causal, key_mask=mask)
        assert_same(out, full)
        for a, r, name in zip(grads(out, (q, k, v)), full_grads, "qkv"):
            assert_same(a, r, what=f"grad {name}")


def test_topk_rows_with_fewer_than_k_visible_keys_keep_them_all():
    q, k, v = make_qkv(1, 2, N, N, D, requires_grad=False)
    out = attnzoo.build("topk", topk=6)(q, k, v, causal=True)
    full = attnzoo.build("softmax")(q, k, v, causal=True)
    assert_same(out[:, :, :6], full[:, :, :6])
    assert not torch.allclose(out[:, :, 6:], full[:, :, 6:])
    weights = attnzoo.build("topk", topk=6).implied_attention(q, k, causal=True)
    assert torch.equal((weights > 0).sum(-1), torch.arange(N).clamp(max=5).add(1).expand(1, 2, N))


def test_topk_ties_go_to_the_lower_key_index():
    # Every key is the same vector: all scores of a row tie, so the first k visible keys win.
    q, _, v = make_qkv(1, 1, 9, 9, 4, requires_grad=False)
    k = torch.ones(1, 1, 9, 4, dtype=torch.float64)
    mask = torch.tensor([[False, True] + [True] * 7])
    out = attnzoo.build("topk", topk=3, chunk=4)(q, k, v, key_mask=mask)
    assert_same(out, v[:, :, 1:4].mean(2, keepdim=True).expand_as(out))
    keep = topk_mask(torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]]), None, 2)
    assert keep.tolist() == [[False, True, True, False, False]]


@pytest.mark.parametrize("k", [1, 3, 8, 40])
def test_topk_keep_makes_the_rules_selection(k):
    # Small integers tie often (across the cut too); some rows see fewer than k entries or none;
    # NaN and -inf scores; k = 40 > 37 entries per row.
    gen = torch.Generator().manual_seed(k)
    scores = torch.randint(-3, 4, (2, 3, 50, 37), generator=gen).double()
    scores[0, 0, 0, 5] = float("nan")
    scores[0, 1, 1, :4] = float("-inf")
    visible = torch.rand(2, 1, 50, 37, generator=gen) < 0.6
    visible[:, :, :3, 2:] = False  # two visible entries at most
    visible[1, :, 3] = False  # none
    for vis in (visible, None):
        assert torch.equal(topk_keep(scores, vis, k), topk_mask(scores, vis, k))
    distinct = torch.randn(4, 37, generator=gen, dtype=torch.float64)  # no tie: no row takes the rule's path
    assert torch.equal(topk_keep(distinct, None, k), topk_mask(distinct, None, k))


@pytest.mark.parametrize(("n", "k"), [(1000, 33), (300, 9), (161, 10), (129, 4), (64, 32), (40, 25)])
@pytest.mark.parametrize("from_ratio", [None, 2], ids=["default", "two-stages-from-2k"])
def test_largest_returns_the_k_largest_values_in_order_ties_and_infinities_included(n, k, from_ratio, monkeypatch):
    # Rows of small integers (ties everywhere, across the cut too), distinct values, rows with
    # fewer than k finite entries, an all -inf row and a NaN; n not a multiple of the group size.
    # With two stages from rows of 2 k on, every case takes them (groups of 1 to 8 columns).
    if from_ratio is not None:
        monkeypatch.setattr(topk_module, "TWO_STAGES_FROM", from_ratio)
    gen = torch.Generator().manual_seed(n)
    scores = torch.cat(
        [torch.randint(-3, 4, (2, 3, n), generator=gen).double(), torch.randn(2, 2, n, generator=gen)], 1
    )
    scores[0, 0, 3:] = float("-inf")
    scores[0, 1] = float("-inf")
    scores[1, 2, 7] = float("nan")
    inf = float("inf")
    want = scores.topk(k, dim=-1).values.nan_to_num(nan=inf)  # NaN ranks first, as +inf would
    values, idx = largest(scores, k)
    assert torch.equal(values.nan_to_num(nan=inf), want)
    for ordered in (True, False):  # unordered: the same values in some order, at their indices
        values, idx = largest(scores, k, ordered=ordered)
        assert torch.equal(values.nan_to_num(nan=inf).sort(-1, descending=True).values, want)
        assert torch.equal(scores.gather(-1, idx).nan_to_num(), values.nan_to_num())
        assert torch.equal(idx.sort(-1).values.diff(dim=-1) > 0, torch.ones_like(idx[..., 1:], dtype=torch.bool))


def test_cut_drops_the_smallest_and_says_when_it_splits_a_tie():
    # k + 1 values in any order: ties at the cut, -inf (fewer than k + 1 visible), NaN (ranks
    # above everything, so never the one dropped unless every value is NaN).
    gen = torch.Generator().manual_seed(0)
    top = torch.randint(0, 5, (500, 9), generator=gen).double()
    top[:50, 3] = float("nan")
    top[50:100, :4] = float("-inf")
    idx = torch.rand(500, 9, generator=gen).argsort(-1)
    values, kept, ambiguous = topk_module._cut(top, idx)
    ranked = top.nan_to_num(nan=float("inf")).sort(-1, descending=True).values
    assert torch.equal(ambiguous, ranked[:, 8] == ranked[:, 7])
    assert torch.equal(values.nan_to_num(nan=float("inf")).sort(-1, descending=True).values, ranked[:, :8])
    assert torch.equal(top.gather(-1, idx.argsort(-1).gather(-1, kept)).nan_to_num(), values.nan_to_num())


@pytest.mark.parametrize("n", [700, 100], ids=["two-stages", "one-stage"])
def test_select_topk_makes_the_rules_selection(n):
    # Long rows take largest's two stages; integer scores tie across the cut in most rows;
    # distinct scores in some rows; a key whose scores are NaN; rows with fewer than k visible.
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(-20, 21, (2, 3, 40, n), generator=gen).float()
    scores[1] = torch.randn(3, 40, n, generator=gen)
    scores[:, :, :, 5] = float("nan")
    visible = torch.rand(2, 1, 40, n, generator=gen) < 0.9
    visible[:, :, :4, 20:] = False
    idx, valid = select_topk(scores, visible, 32)
    want_idx, want_valid = kept_indices(topk_mask(scores, visible, 32), 32)
    assert torch.equal(valid, want_valid)
    assert torch.equal(idx.masked_fill(~valid, 0).sort(-1).values, want_idx.sort(-1).values)


def test_topk_never_allocates_more_than_one_chunk_of_scores():
    # Real tensors (the sparse attention's sizes depend on the data, which the meta device
    # cannot run); every intermediate is recorded, forward and backward.
    n, heads = 4096, 2
    q, k, v = (torch.randn(1, heads, n, 16, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, n, dtype=torch.bool)
    with Largest() as largest:
        attnzoo.build("topk")(q, k, v, causal=True, key_mask=mask).sum().backward()
    assert largest.numel == heads * auto_chunk(n) * n  # one chunk of scores: H x chunk x N, never N x N


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("slabs", [False, True], ids=["one-slab", "a-slab-per-row"])
def test_sac_fast_equals_reference_with_a_predictor_that_is_not_the_identity(causal, padded, slabs, monkeypatch):
    # The contracts run sac with its initial predictor W = I, where the edge scores are the
    # attention scores; a perturbed W selects other edges. With slabs, each (batch, head) row
    # runs alone (_ops.in_slabs), with its batch row's padding; W's gradient sums over them.
    if slabs:
        monkeypatch.setattr(attnzoo.mechanisms._ops, "SLAB_BYTES", 1)
    mask = _mask(padded)
    module = _build("sac").double()
    with torch.no_grad():
        module.predictor.add_(0.5 * torch.randn(D, D, dtype=torch.float64))
    q, k, v = make_qkv(B, H, N, N, D, d_v=5)
    inputs = (q, k, v, module.predictor)
    fast = module(q, k, v, causal=causal, key_mask=mask)
    ref = module.reference(q, k, v, causal=causal, key_mask=mask)
    assert_same(fast, ref)
    for a, r, name in zip(grads(fast, inputs), grads(ref, inputs), ("q", "k", "v", "predictor")):
        assert_same(a, r, what=f"grad {name}")
    if padded:
        assert torch.equal(fast[0], torch.zeros_like(fast[0]))


def test_sac_candidates_are_bounded_distinct_causal_and_independent_of_the_length():
    cfg = SACConfig(candidates=7, n_random=3, seed=1)
    cand, valid = sac_candidates(N, cfg, True, CPU)
    assert cand.shape == (N, 10)
    rows = torch.arange(N)[:, None]
    assert bool(((cand <= rows) | ~valid).all())
    assert bool((valid & (cand >= rows - 6)).sum(1).eq(torch.arange(N).clamp(max=6) + 1).all())  # the window
    for row, ok in zip(cand, valid):
        assert len(set(row[ok].tolist())) == int(ok.sum())
    # What decoding rests on: a causal row's candidates are the same whatever the final length.
    long_cand, long_valid = sac_candidates(4096, cfg, True, CPU)
    assert torch.equal(long_valid[:N], valid) and torch.equal(long_cand[:N][valid], cand[valid])
    cand, valid = sac_candidates(N, SACConfig(candidates=7, n_random=0, seed=1), False, CPU)
    assert bool(valid.all()) and bool(((cand - rows).abs() <= 6).all())


@pytest.mark.parametrize("causal", [False, True])
def test_sac_ties_go_to_the_lower_key_index_in_the_fast_path(causal):
    # Small integers and a scale of 1/2: every score is exact whatever the summation order, so
    # nodes' candidate edges tie often and exactly, between window keys and random ones too; the
    # fast path must keep the lower positions, as the reference does.
    module = _build("sac", scale=0.5).double()
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randint(-1, 2, (B, H, N, D), generator=gen).double().requires_grad_() for _ in range(2))
    v = torch.randn(B, H, N, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    fast = module(q, k, v, causal=causal)
    ref = module.reference(q, k, v, causal=causal)
    assert_same(fast, ref)
    for a, r, name in zip(grads(fast, (q, k, v)), grads(ref, (q, k, v)), "qkv"):
        assert_same(a, r, what=f"grad {name}")


def test_sac_steps_of_several_tokens_equal_the_causal_forward():
    # The contract decodes one token at a time after a prefill; here every step draws several
    # rows of random candidates from the carried generator.
    module = _build("sac").double()
    q, k, v = make_qkv(B, H, N, N, D, requires_grad=False)
    want = module(q, k, v, causal=True)
    state, outs = module.init_state(B, H, D, D, dtype=torch.float64), []
    for lo, hi in ((0, 11), (11, 12), (12, 25), (25, N)):
        out, state = module.step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi])
        outs.append(out)
    assert_same(torch.cat(outs, dim=2), want)


@pytest.mark.parametrize("causal", [False, True])
def test_sac_with_every_candidate_kept_is_full_attention(causal):
    mask = _mask()
    module = attnzoo.build("sac", topk=N, candidates=N, n_random=2, head_dim=D).double()
    q, k, v = make_qkv(B, H, N, N, D)
    out = module(q, k, v, causal=causal, key_mask=mask)
    # sac zeroes padded queries (self-attention only); softmax, a cross-attention mechanism, does not.
    full = attnzoo.build("softmax")(*module.zero_padded(mask, q, k, v), causal=causal, key_mask=mask)
    assert_same(out, full)
    for a, r, name in zip(grads(out, (q, k, v)), grads(full, (q, k, v)), "qkv"):
        assert_same(a, r, what=f"grad {name}")


def test_sac_predictor_gets_gradient_and_a_tiny_training_loop_learns():
    torch.manual_seed(0)
    module = attnzoo.build("sac", topk=3, candidates=6, n_random=2, head_dim=D)
    q, k, v = (torch.nn.Parameter(x) for x in make_qkv(1, 2, 24, 24, D, dtype=torch.float32, requires_grad=False))
    target = torch.randn(1, 2, 24, D)
    loss = (module(q, k, v, causal=True) - target).pow(2).mean()
    loss.backward()
    assert module.predictor.grad is not None and module.predictor.grad.abs().sum() > 0
    opt = torch.optim.Adam([q, k, v, *module.parameters()], lr=0.05)
    start = module.predictor.detach().clone()
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = (module(q, k, v, causal=True) - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert not torch.equal(module.predictor.detach(), start)


def test_sac_refuses_a_head_size_it_was_not_built_for():
    q = torch.randn(1, 2, 10, D)
    with pytest.raises(ValueError, match="head_dim=8"):
        attnzoo.build("sac")(q, q, q)
    with pytest.raises(ValueError, match="head_dim=8"):
        attnzoo.build("sac").step(attnzoo.build("sac").init_state(1, 2, D, D), q[:, :, :1], q[:, :, :1], q[:, :, :1])


@pytest.mark.parametrize("causal", [False, True])
def test_selected_softmax_gradients_with_invalid_slots_and_an_empty_row(causal):
    """``selected_softmax`` (topk's and dsa's fast path) against autograd's numerical gradient: a
    shared (head dim 1) selection with unused slots, a row whose every slot is unused (zeros out,
    zero gradient), and per-head selections."""
    from attnzoo.mechanisms.selected import selected_softmax

    torch.manual_seed(0)
    m, n, kk = 7, 9, 3
    q, k, v = (torch.randn(2, 2, size, 4, dtype=torch.float64, requires_grad=True) for size in (m, n, n))
    reach = torch.arange(m).view(m, 1) + n - m + 1 if causal else torch.full((m, 1), n)  # keys a row may pick
    idx = torch.stack([torch.randperm(int(reach[i]))[:kk] for _ in range(4) for i in range(m)]).view(2, 2, m, kk)
    valid = torch.rand(2, 2, m, kk) > 0.3
    valid[0, :, 2] = False
    for shared in (True, False):
        sel = (idx[:, :1], valid[:, :1]) if shared else (idx, valid)
        out, weights = selected_softmax(q, k, v, *sel)
        assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2])) and not weights.requires_grad
        assert bool((weights[~sel[1].expand_as(weights)] == 0).all())  # unused slots weigh 0
        assert torch.autograd.gradcheck(lambda a, b, c, sel=sel: selected_softmax(a, b, c, *sel)[0], (q, k, v))


def test_select_in_chunks_scores_each_chunk_up_to_its_reach():
    from attnzoo.mechanisms.selected import select_in_chunks

    q, k = torch.randn(1, 2, 7, 4, dtype=torch.float64), torch.randn(1, 2, 9, 4, dtype=torch.float64)
    seen = []

    def select(start, stop, reach, scores):
        torch.testing.assert_close(scores, q[:, :, start:stop] @ k[:, :, :reach].transpose(-1, -2))
        seen.append((start, stop, reach))
        top = scores.topk(2, -1).indices
        return top, torch.ones_like(top, dtype=torch.bool)

    idx, valid = select_in_chunks(q, k, select, 3, causal=True)
    assert seen == [(0, 3, 5), (3, 6, 8), (6, 7, 9)] and idx.shape == valid.shape == (1, 2, 7, 2)
