"""Private PyTorch operators the library relies on, in one place: when a torch release renames
or changes them, this is the only file to touch."""

from __future__ import annotations

import torch

#: PyTorch's CPU FlashAttention forward: ``(q, k, v, dropout_p, is_causal, *, attn_mask, scale)``
#: on ``(B, H, L, D)`` -> ``(out, lse, ...)``. Accepts strided (even overlapping) k/v views and
#: a float additive mask broadcastable to ``(B, H, L_q, L_kv)``; a row whose mask is all
#: ``-inf`` gives zeros and ``lse = 0``.
flash_attention_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
#: Its backward: ``(grad_out, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask, scale)``.
flash_attention_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
#: Softmax's backward from its output: ``(grad, output, dim, input_dtype)`` -> the input's
#: gradient, ``output * (grad - (grad * output).sum(dim))`` in one fused pass (differentiable).
softmax_backward = torch.ops.aten._softmax_backward_data
