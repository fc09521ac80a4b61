"""attnzoo: every self-attention mechanism behind one PyTorch API.

>>> import torch, attnzoo
>>> attn = attnzoo.build("softmax")
>>> q = k = v = torch.randn(2, 4, 128, 32)          # (B, H, N, D)
>>> attn(q, k, v, causal=True).shape
torch.Size([2, 4, 128, 32])
"""

from attnzoo import mechanisms as _mechanisms  # noqa: F401  (registers every mechanism)
from attnzoo import nn, patterns, positional
from attnzoo.backends import attend, last_choice
from attnzoo.registry import build, describe, names
from attnzoo.spec import Shape

__all__ = ["Shape", "attend", "build", "describe", "last_choice", "names", "nn", "patterns", "positional"]
__version__ = "0.1.0"
