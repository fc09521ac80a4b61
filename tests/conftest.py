"""Shared fixtures: fixed seeds, and a factory for (q, k, v) with awkward shapes."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def make_qkv(
    b: int,
    h: int,
    n_q: int,
    n_kv: int,
    d: int = 8,
    d_v: int | None = None,
    dtype: torch.dtype = torch.float64,
    requires_grad: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Random ``q (B, H, N_q, D)``, ``k (B, H, N_kv, D)``, ``v (B, H, N_kv, D_v)``."""
    d_v = d if d_v is None else d_v
    q = torch.randn(b, h, n_q, d, dtype=dtype)
    k = torch.randn(b, h, n_kv, d, dtype=dtype)
    v = torch.randn(b, h, n_kv, d_v, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def padding_mask(b: int, n: int, *, empty_row: bool = True) -> torch.Tensor:
    """A key padding mask (True = real) with varied lengths; batch 0 is all padding when
    ``empty_row`` (so its rows see no key), the last batch row is unpadded."""
    lengths = torch.linspace(0 if empty_row else 1, n, b).round().long()
    return torch.arange(n)[None, :] < lengths[:, None]


def grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Gradients of ``<out, g>`` for a fixed random ``g`` (so every output element matters)."""
    if not out.requires_grad:  # e.g. an oracle whose every row sees no key: the gradient is 0
        return tuple(torch.zeros_like(x) for x in inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    found = torch.autograd.grad(out, inputs, g, allow_unused=True)
    return tuple(torch.zeros_like(x) if d is None else d for x, d in zip(inputs, found))


def _stored(t: torch.Tensor) -> int:
    """Elements a tensor stores: a sparse tensor's values (its ``numel`` is the dense size)."""
    if t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return t.values().numel()
    return t._values().numel() if t.layout == torch.sparse_coo else t.numel()


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any operation creates inside the
    ``with`` block — the structural check that nothing N x N is ever allocated (run it on the
    meta device to check shapes without computing)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        sizes = [_stored(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.numel = max([self.numel, *sizes])
        return out


def largest_tensor(fn, *args, **kwargs) -> int:  # noqa: ANN001
    """The element count of the largest tensor created while running ``fn(*args, **kwargs)``
    (under ``LargestTensor``): the one probe every "allocates nothing N x N" test uses."""
    with LargestTensor() as probe:
        fn(*args, **kwargs)
    return probe.numel


def small_mechanism(name: str, n: int, *, heads: int, head_dim: int, **extra: object) -> torch.nn.Module:
    """``name`` with a config sized for length ``n`` (``attnzoo.bench.configs.sized``) and its
    geometry fields (``heads``, ``head_dim``, where the config has them) set; float64, eval mode
    (no dropout, Gumbel noise, EMA updates or fresh random draws)."""
    import attnzoo
    from attnzoo.bench.configs import sized

    fields = attnzoo.registry.config_fields(name)
    geometry = {key: value for key, value in (("heads", heads), ("head_dim", head_dim)) if key in fields}
    return attnzoo.build(name, **{**sized(name, n), **geometry, **extra}).double().eval()


def decode_all(attn: torch.nn.Module, state: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill: int):
    """``attn.step`` over a ``prefill``-token prompt, then one token at a time: the outputs
    concatenated along N, ``(B, H, N, D_v)``, to compare with the causal forward."""
    out, state = attn.step(state, q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill])
    outs = [out]
    for t in range(prefill, q.shape[2]):
        out, state = attn.step(state, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(out)
    return torch.cat(outs, dim=2)


def refused(what: str):
    """A stand-in for a code path that must not run: calling it fails the test with ``what``."""

    def refuse(*args, **kwargs):
        raise AssertionError(what)

    return refuse
