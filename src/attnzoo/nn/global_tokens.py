"""``GlobalTokens``: learned tokens prepended to a sequence and stripped afterwards — ETC's
external global tokens and Star-Transformer's relay node."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnzoo._checks import check_module_input, check_positive_int, check_tensor, renamed_key_mask


class GlobalTokens(nn.Module):
    """``n`` learned vectors of width ``dim``.

    ``add(x, key_mask)`` returns ``(B, n + N, dim)`` with the tokens first and the mask
    extended with True for them; ``strip(y)`` drops them again. Use with ``etc(window, n)`` or
    ``star(relay=0)``, whose global positions are the first ``n``.
    """

    def __init__(self, dim: int, n: int = 1) -> None:
        super().__init__()
        check_positive_int(dim, "dim")
        check_positive_int(n, "n")
        self.n = n
        self.tokens = nn.Parameter(torch.randn(n, dim) * 0.02)

    @renamed_key_mask
    def add(self, x: Tensor, key_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        check_tensor(x, "x", 3, f"(B, N, dim={self.tokens.shape[1]})")
        if x.shape[-1] != self.tokens.shape[1]:
            raise ValueError(f"x must have last dimension {self.tokens.shape[1]}, got {tuple(x.shape)}")
        check_module_input(self, x, "x", dtype=False)  # the tokens are cast to x's dtype
        tokens = self.tokens.to(x.dtype).expand(x.shape[0], -1, -1)
        if key_mask is not None:
            real = torch.ones(x.shape[0], self.n, dtype=torch.bool, device=x.device)
            key_mask = torch.cat([real, key_mask], dim=1)
        return torch.cat([tokens, x], dim=1), key_mask

    def strip(self, y: Tensor) -> Tensor:
        return y[:, self.n :]

    @renamed_key_mask
    def forward(self, x: Tensor, key_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return self.add(x, key_mask)
