"""SHA-RNN and CBAM: shapes, causality, hand computations, parameter structure, training smoke."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnzoo.nn.cbam import CBAM
from attnzoo.nn.sharnn import SHARNN, Boom, SingleHeadAttention

# ---------------------------------------------------------------- SHA-RNN


def test_sharnn_shapes_and_tied_head():
    torch.manual_seed(0)
    model = SHARNN(13, 16, depth=2, ff_mult=3)
    logits = model(torch.randint(0, 13, (2, 7)))
    assert logits.shape == (2, 7, 13)
    assert model.head.weight is model.embed.weight
    untied = SHARNN(13, 16, tie_weights=False)
    assert untied.head.weight is not untied.embed.weight
    assert untied(torch.randint(0, 13, (1, 3))).shape == (1, 3, 13)


def test_sharnn_is_causal():
    torch.manual_seed(0)
    model = SHARNN(11, 16, depth=2).eval()
    tokens = torch.randint(0, 11, (2, 10))
    t = 4
    changed = tokens.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1 + torch.randint(0, 9, (2, 5))) % 11
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, : t + 1], b[:, : t + 1], atol=1e-6)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_attention_only_query_has_a_matrix_and_matches_hand_computation():
    torch.manual_seed(0)
    attn = SingleHeadAttention(8).double()
    with torch.no_grad():
        for g in (attn.q_gate, attn.k_gate, attn.v_gate):
            g.normal_()
    shapes = {name: tuple(p.shape) for name, p in attn.named_parameters()}
    assert shapes == {"q_proj.weight": (8, 8), "q_proj.bias": (8,), "q_gate": (8,), "k_gate": (8,), "v_gate": (8,)}
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    q = torch.sigmoid(attn.q_gate) * attn.q_proj(x)
    k, v = torch.sigmoid(attn.k_gate) * x, torch.sigmoid(attn.v_gate) * x
    s = q @ k.transpose(1, 2) / 8**0.5
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(attn(x), s.softmax(-1) @ v)


def test_boom_has_exactly_one_weight_matrix_and_sums_chunks():
    boom = Boom(6, mult=4)
    matrices = [p for p in boom.parameters() if p.ndim == 2]
    assert len(matrices) == 1 and matrices[0].shape == (24, 6)
    assert sorted(tuple(p.shape) for p in boom.parameters()) == [(24,), (24, 6)]
    x = torch.randn(3, 6)
    h = nn.functional.gelu(boom.up(x))
    assert torch.allclose(boom(x), h[:, 0:6] + h[:, 6:12] + h[:, 12:18] + h[:, 18:24], atol=1e-6)
    # inside the model, every block's Boom has a single matrix too
    model = SHARNN(10, 8, depth=3, ff_mult=2)
    for block in model.blocks:
        assert [tuple(p.shape) for p in block.ff.parameters() if p.ndim == 2] == [(16, 8)]


def test_sharnn_learns_to_copy_the_previous_token():
    torch.manual_seed(0)
    model = SHARNN(8, 32, depth=1, ff_mult=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        tokens = torch.randint(0, 8, (16, 12))
        logits = model(tokens)[:, 1:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, 8), tokens[:, :-1].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses


@pytest.mark.parametrize(
    "tokens, err",
    [
        (torch.zeros(2, 3, 4, dtype=torch.long), ValueError),
        (torch.zeros(2, 3), TypeError),
        (torch.full((2, 3), 9), ValueError),
        (torch.full((2, 3), -1), ValueError),
    ],
)
def test_sharnn_rejects_bad_tokens(tokens, err):
    with pytest.raises(err):
        SHARNN(9, 8)(tokens)


def test_sharnn_rejects_bad_config():
    for kwargs in (
        {"vocab_size": 0, "dim": 8},
        {"vocab_size": 5, "dim": 8, "depth": 0},
        {"vocab_size": 5, "dim": 8, "dropout": 1.5},
        {"vocab_size": 5, "dim": 8, "ff_mult": 0},
    ):
        with pytest.raises(ValueError):
            SHARNN(**kwargs)


# ---------------------------------------------------------------- CBAM


def test_cbam_shapes():
    assert CBAM(32, reduction=16)(torch.randn(2, 32, 9, 5)).shape == (2, 32, 9, 5)
    assert CBAM(3)(torch.randn(1, 3, 1, 1)).shape == (1, 3, 1, 1)


def test_cbam_matches_hand_computation():
    torch.manual_seed(0)
    cbam = CBAM(8, reduction=2).double()
    x = torch.randn(2, 8, 6, 5, dtype=torch.float64)
    w1, b1 = cbam.mlp[0].weight, cbam.mlp[0].bias
    w2, b2 = cbam.mlp[2].weight, cbam.mlp[2].bias
    mlp = lambda v: torch.relu(v @ w1.T + b1) @ w2.T + b2  # noqa: E731
    avg, mx = x.mean(dim=(2, 3)), x.flatten(2).max(dim=2).values
    xc = x * torch.sigmoid(mlp(avg) + mlp(mx))[:, :, None, None]
    pooled = torch.stack([xc.mean(dim=1), xc.max(dim=1).values], dim=1)
    spatial = torch.sigmoid(nn.functional.conv2d(pooled, cbam.spatial.weight, padding=3))
    assert torch.allclose(cbam(x), xc * spatial)


def test_cbam_parameter_structure():
    cbam = CBAM(32, reduction=16)
    shapes = {name: tuple(p.shape) for name, p in cbam.named_parameters()}
    # one shared MLP (C -> C/r -> C) for both pooling paths, and one 2->1 7x7 conv
    assert shapes == {
        "mlp.0.weight": (2, 32),
        "mlp.0.bias": (2,),
        "mlp.2.weight": (32, 2),
        "mlp.2.bias": (32,),
        "spatial.weight": (1, 2, 7, 7),
    }
    assert cbam.spatial.padding == (3, 3)


def test_cbam_channels_below_reduction_uses_hidden_one():
    cbam = CBAM(4, reduction=16)
    assert cbam.hidden == 1 and cbam.mlp[0].weight.shape == (1, 4)
    assert CBAM(4, 16)(torch.randn(1, 4, 3, 3)).shape == (1, 4, 3, 3)


def test_cbam_errors():
    cbam = CBAM(4, reduction=2)
    with pytest.raises(ValueError, match="4 dimensions"):
        cbam(torch.randn(4, 5, 5))
    with pytest.raises(ValueError, match="channels"):
        cbam(torch.randn(1, 3, 5, 5))
    with pytest.raises(ValueError, match="odd"):
        CBAM(4, kernel_size=4)
    with pytest.raises(ValueError):
        CBAM(0)


def test_cbam_training_smoke():
    torch.manual_seed(0)
    # label: is the mean of channel 0 in the top-left 4x4 quadrant above the mean of channel 1 there?
    x = torch.randn(128, 2, 8, 8)
    y = (x[:, 0, :4, :4].mean((1, 2)) > x[:, 1, :4, :4].mean((1, 2))).long()
    model = nn.Sequential(
        nn.Conv2d(2, 8, 3, padding=1),
        nn.ReLU(),
        CBAM(8, reduction=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
