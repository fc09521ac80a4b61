"""A/B of RFA's features without their ``sqrt(1/m)``, in one process (issue 12).

RFA's output is a ratio (``phi(q)^T S / phi(q)^T z``) in which the features' scale cancels, but
``_ScaledSinCos`` made a pass over the ``(B, H, N, 2m)`` features of q and of k to apply it. Now
``RFAAttention`` asks ``fourier_features(scaled=False)`` and carries the scale in its ``eps``
(``config.eps * m``). The old rule (scaled features, ``config.eps``) is swapped in per call;
each pair is timed forward+backward interleaved with dense SDPA's (B=1, H=8, D=64, median of
the repeats). Usage: ``python scripts/ab_rfa_unscaled.py N CAUSAL(0|1) [REPEATS]``.
"""

from __future__ import annotations

import sys

from ab_timing import fwd_bwd_ab
from torch import Tensor

from attnzoo.mechanisms import kernel_features

NEW = (kernel_features.fourier_features, kernel_features.RFAAttention.eps)


def scaled_features(x: Tensor, w: Tensor, sigma: float, *, scaled: bool = True) -> Tensor:
    return NEW[0](x, w, sigma)


def use(rule: str) -> None:
    kernel_features.fourier_features = scaled_features if rule == "old" else NEW[0]
    kernel_features.RFAAttention.eps = property(lambda self: self.config.eps) if rule == "old" else NEW[1]


if __name__ == "__main__":
    n, causal = int(sys.argv[1]), sys.argv[2] == "1"
    fwd_bwd_ab(n, causal, ["rfa"], int(sys.argv[3]) if len(sys.argv) > 3 else 7, use)
