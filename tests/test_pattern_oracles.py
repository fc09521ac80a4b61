"""Hand-checked sanity tests of the sparse-pattern oracles themselves (not of the library)."""

from __future__ import annotations

import torch

from oracles import (
    axial_oracle,
    bigbird_oracle,
    block2d_oracle,
    block_local_oracle,
    causal_oracle,
    dilated_oracle,
    etc_oracle,
    full_oracle,
    global_tokens_oracle,
    graph_oracle,
    logsparse_oracle,
    longformer_oracle,
    per_head_oracle,
    random_blocks_oracle,
    random_oracle,
    sinks_oracle,
    sliding_window_oracle,
    sparse_transformer_fixed_oracle,
    sparse_transformer_strided_oracle,
    star_oracle,
    strided_oracle,
)


def B(rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_full_and_causal_aligned():
    assert full_oracle(2, 3).all() and full_oracle(2, 3).shape == (2, 3)
    assert torch.equal(causal_oracle(2, 4), B([[1, 1, 1, 0], [1, 1, 1, 1]]))
    assert torch.equal(causal_oracle(3, 3), B([[1, 0, 0], [1, 1, 0], [1, 1, 1]]))


def test_sliding_window():
    assert torch.equal(
        sliding_window_oracle(5, 5, 1, 0),
        B([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]),
    )
    # aligned: n_q=1, n_kv=4 -> p = 3; window [1, 4] clipped to the keys
    assert torch.equal(sliding_window_oracle(1, 4, 2, 1), B([[0, 1, 1, 1]]))


def test_dilated_and_strided():
    # p = 4, offsets -2*2, -1*2, 0, +1*2 -> keys 0, 2, 4, 6
    assert dilated_oracle(9, 9, 2, 1, 2)[4].nonzero().flatten().tolist() == [0, 2, 4, 6]
    # strided is symmetric: negative p - j counts too; p = 1 with stride 3 -> keys 1, 4
    assert strided_oracle(6, 6, 3)[1].nonzero().flatten().tolist() == [1, 4]
    assert strided_oracle(2, 5, 2)[0].nonzero().flatten().tolist() == [1, 3]  # p = 3


def test_logsparse():
    # p = 9: itself and distances 1, 2, 4 (levels 3) on both sides; 8 is beyond 2^(levels - 1)
    assert logsparse_oracle(16, 16, 3)[9].nonzero().flatten().tolist() == [5, 7, 8, 9, 10, 11, 13]
    # end-aligned: n_q = 1, n_kv = 12 -> p = 11; levels 4 reaches distance 8
    assert logsparse_oracle(1, 12, 4)[0].nonzero().flatten().tolist() == [3, 7, 9, 10, 11]


def test_global_random_and_blocks():
    g = global_tokens_oracle(4, 4, [2])
    assert torch.equal(g, B([[0, 0, 1, 0], [0, 0, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]]))
    r = random_oracle(2, 4, torch.tensor([[3, -1], [0, 0]]))
    assert torch.equal(r, B([[0, 0, 0, 1], [1, 0, 0, 0]]))
    # n_q=2, n_kv=5, block 2 -> 3 blocks; rows sit at p = 3, 4 -> query blocks 1, 2
    rb = random_blocks_oracle(2, 5, 2, torch.tensor([[-1], [0], [2]]))
    assert torch.equal(rb, B([[1, 1, 0, 0, 0], [0, 0, 0, 0, 1]]))
    assert torch.equal(block_local_oracle(3, 5, 2), B([[0, 0, 1, 1, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]))


def test_longformer_bigbird():
    lf = longformer_oracle(6, 6, 1, [0], dilation=2)
    assert lf[3].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert lf[0].all() and lf[:, 0].all()
    # 4 blocks of 1 token, window 3 -> |qb-kb| <= 1, g=3 -> GB = {0, 1, 3}
    bb = bigbird_oracle(4, 4, 1, 3, 3, torch.full((4, 1), -1))
    assert bb.all()
    bb = bigbird_oracle(6, 6, 1, 1, 1, torch.tensor([[-1]] * 5 + [[2]]))  # GB = {0}
    assert bb[3].nonzero().flatten().tolist() == [0, 3]
    assert bb[5].nonzero().flatten().tolist() == [0, 2, 5]


def test_star_etc():
    s = star_oracle(5, 5, relay=0)
    assert s[3].nonzero().flatten().tolist() == [0, 2, 3, 4] and s[0].all()
    assert not s[1, 4] and not s[4, 1]  # first and last satellites: a band, no wrap
    e = etc_oracle(6, 6, 1, 2)
    assert e[4].nonzero().flatten().tolist() == [0, 1, 3, 4, 5] and e[1].all()
    k = sinks_oracle(8, 8, 2, 1, 0)  # the first 2 keys + self and the previous one; no sink rows
    assert k[6].nonzero().flatten().tolist() == [0, 1, 5, 6] and k[1].nonzero().flatten().tolist() == [0, 1]


def test_sparse_transformer():
    st = sparse_transformer_strided_oracle(5, 2, 2)
    assert st[0, 4].nonzero().flatten().tolist() == [3, 4]  # A: 4 - 2 < j <= 4
    assert st[1, 4].nonzero().flatten().tolist() == [0, 2, 4]  # B: (4 - j) % 2 == 0
    assert sparse_transformer_strided_oracle(3, 2, 1)[0].equal(st[1, :3, :3])  # one head -> B
    fx = sparse_transformer_fixed_oracle(6, 3, 1, 2)
    assert fx[0, 4].nonzero().flatten().tolist() == [3, 4]  # A: same block, causal
    assert fx[1, 5].nonzero().flatten().tolist() == [2, 5]  # B: j % 3 == 2, causal
    assert fx[1, 1].nonzero().flatten().tolist() == []


def test_block2d_axial():
    m = block2d_oracle(4, 4, (2, 2), (0, 0))
    # query (0, 0) -> block rows 0..1, cols 0..1 -> positions 0, 1, 4, 5
    assert m[0].nonzero().flatten().tolist() == [0, 1, 4, 5]
    assert m[10].nonzero().flatten().tolist() == [10, 11, 14, 15]  # (2, 2)
    assert torch.equal(m, m.T) and int(m.sum()) == 16 * 4
    m = block2d_oracle(4, 4, (2, 2), (1, 0))
    assert m[0].nonzero().flatten().tolist() == [0, 1, 4, 5, 8, 9]  # rows -1..2, cols 0..1
    assert torch.equal(
        axial_oracle(2, 3),
        B(
            [
                [1, 1, 1, 1, 0, 0],
                [1, 1, 1, 0, 1, 0],
                [1, 1, 1, 0, 0, 1],
                [1, 0, 0, 1, 1, 1],
                [0, 1, 0, 1, 1, 1],
                [0, 0, 1, 1, 1, 1],
            ]
        ),
    )


def test_graph_per_head():
    ring = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    assert torch.equal(graph_oracle(4, ring), B([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]]))
    assert torch.equal(
        graph_oracle(4, ring, self_loops=False), B([[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0]])
    )
    a, b = causal_oracle(3, 3), full_oracle(3, 3)
    ph = per_head_oracle([a, b], 4)
    assert ph.shape == (4, 3, 3) and all(ph[h].equal(m) for h, m in enumerate([a, a, b, b]))
