"""``CBAM``: Convolutional Block Attention Module (Woo et al. 2018)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnzoo._checks import check_module_input, check_positive_int, check_tensor


class CBAM(nn.Module):
    """Convolutional Block Attention Module (Woo et al. 2018, https://arxiv.org/abs/1807.06521).

    Channel attention then spatial attention, each a sigmoid gate multiplied into the map::

        M_c = sigmoid(MLP(avgpool(x)) + MLP(maxpool(x)))          # (B, C, 1, 1), one shared MLP
        x'  = x * M_c
        M_s = sigmoid(conv_kxk([mean_c(x'); max_c(x')]))          # (B, 1, H, W), 2 in-channels
        out = x' * M_s

    The shared MLP is ``Linear(C, hidden) -> ReLU -> Linear(hidden, C)`` (with biases) with
    ``hidden = max(channels // reduction, 1)``, so ``channels < reduction`` still works (hidden
    width 1). The spatial conv has ``padding = kernel_size // 2`` (3 for the default 7) and no bias,
    as in the paper's reference code.

    Args:
        channels: number of input channels ``C``.
        reduction: MLP reduction ratio ``r``. Default 16.
        kernel_size: odd size of the spatial convolution. Default 7.

    Shapes:
        ``x (B, C, H, W) -> (B, C, H, W)``.
    """

    def __init__(self, channels: int, reduction: int = 16, kernel_size: int = 7) -> None:
        super().__init__()
        check_positive_int(channels, "channels")
        check_positive_int(reduction, "reduction")
        check_positive_int(kernel_size, "kernel_size")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd so the output keeps the input's H and W, got {kernel_size}")
        self.channels = channels
        self.hidden = max(channels // reduction, 1)
        self.mlp = nn.Sequential(nn.Linear(channels, self.hidden), nn.ReLU(), nn.Linear(self.hidden, channels))
        self.spatial = nn.Conv2d(2, 1, kernel_size, padding=kernel_size // 2, bias=False)

    def channel_attention(self, x: Tensor) -> Tensor:
        """``(B, C, H, W) -> (B, C, 1, 1)`` gate in (0, 1)."""
        avg, mx = x.mean(dim=(2, 3)), x.amax(dim=(2, 3))
        return torch.sigmoid(self.mlp(avg) + self.mlp(mx))[..., None, None]

    def spatial_attention(self, x: Tensor) -> Tensor:
        """``(B, C, H, W) -> (B, 1, H, W)`` gate in (0, 1)."""
        pooled = torch.cat([x.mean(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)], dim=1)
        return torch.sigmoid(self.spatial(pooled))

    def forward(self, x: Tensor) -> Tensor:
        check_tensor(x, "x", 4, f"(B, C={self.channels}, H, W) feature map")
        if x.shape[1] != self.channels:
            raise ValueError(f"x must have {self.channels} channels (dimension 1), got shape {tuple(x.shape)}")
        check_module_input(self, x, "x")
        if x.shape[2] == 0 or x.shape[3] == 0:
            raise ValueError(f"x must have H >= 1 and W >= 1, got shape {tuple(x.shape)}")
        x = x * self.channel_attention(x)
        return x * self.spatial_attention(x)
