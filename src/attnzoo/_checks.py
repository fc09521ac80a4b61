"""Input validation shared by every mechanism and backend.

Every check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape
or value) with a message that names the argument, what was expected, and the fix, so a user
never has to decode a shape error from inside an einsum.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(x: object, name: str, ndim: int, layout: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(
            f"{name} must have {ndim} dimensions {layout}, got shape {tuple(x.shape)}; "
            f"use einops.rearrange to move heads into dimension 1"
            if ndim == 4
            else f"{name} must have {ndim} dimensions {layout}, got shape {tuple(x.shape)}"
        )
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    return x


def check_module_input(module: nn.Module, x: Tensor, name: str, *, dtype: bool = True) -> None:
    """``x`` must be on the device of ``module``'s parameters and (with ``dtype``, outside
    autocast) of their dtype: the layer says so, instead of a matmul deep inside it."""
    param = next((p for p in module.parameters() if p.is_floating_point()), None)
    if param is None:
        return
    dtype_ok = not dtype or x.dtype == param.dtype or torch.is_autocast_enabled(x.device.type)
    if dtype_ok and x.device == param.device:
        return
    want = (param.device.type,) + ((param.dtype,) if dtype else ())
    have = (x.device.type,) + ((x.dtype,) if dtype else ())
    raise TypeError(
        f"{name} is {x.dtype} on {x.device}, but {type(module).__name__}'s parameters are {param.dtype} on "
        f"{param.device}; move the input ({name}.to{_args(want)}) or the module (module.to{_args(have)})"
    )


def _args(values: tuple) -> str:
    return "(" + ", ".join(repr(v) if isinstance(v, str) else str(v) for v in values) + ")"


def check_qkv(q: object, k: object, v: object, *, cross_attention: bool = True, allow_empty: bool = False) -> None:
    """Validate ``q (B, H, N_q, D)``, ``k (B, H_kv, N_kv, D)``, ``v (B, H_kv, N_kv, D_v)`` with
    ``H_kv`` dividing ``H`` (grouped-query attention; ``H_kv = H`` is the usual case). N_kv = 0 is
    refused unless ``allow_empty`` and the output is empty anyway (B = 0 or N_q = 0)."""
    check_tensor(q, "q", 4, "(B, H, N_q, D)")
    check_tensor(k, "k", 4, "(B, H, N_kv, D)")
    check_tensor(v, "v", 4, "(B, H, N_kv, D_v)")
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"q, k, v must agree on the batch size B (dimension 0), got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"k and v must have the same number of heads H_kv, equal to q's H or dividing it (grouped-query "
            f"attention: each K/V head serves H / H_kv query heads), got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dimension D, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same length N_kv, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[2] == 0 and not (allow_empty and (q.shape[0] == 0 or q.shape[2] == 0)):
        raise ValueError("k and v must hold at least one position (N_kv >= 1) for N_q >= 1 queries")
    if not cross_attention and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"this mechanism is self-attention only: q and k must have the same length, got "
            f"N_q={q.shape[2]} and N_kv={k.shape[2]}; use a mechanism whose capabilities list cross_attention"
        )


def check_causal(causal: object, n_q: int, n_kv: int) -> bool:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal and n_q > n_kv:
        raise ValueError(
            f"causal=True needs N_q <= N_kv (queries are aligned to the end of the keys), got "
            f"N_q={n_q} > N_kv={n_kv}; the first {n_q - n_kv} queries would see no key"
        )
    return causal


def check_key_mask(mask: object, batch: int, n_kv: int, device: torch.device) -> Tensor | None:
    """``key_mask`` is bool ``(B, N_kv)``, True = a real token (SDPA's convention)."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"key_mask must be a bool tensor (B, N_kv) or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"key_mask must have dtype torch.bool (True = real token), got {mask.dtype}; "
            f"for a 0/1 mask use mask.bool(), for an additive -inf mask use mask == 0"
        )
    if tuple(mask.shape) != (batch, n_kv):
        raise ValueError(f"key_mask must have shape (B, N_kv) = {(batch, n_kv)}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"key_mask is on {mask.device} but q, k, v are on {device}; move it with .to()")
    return mask


def check_choice(value: object, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_positive_int(value: object, name: str, *, allow_zero: bool = False) -> None:
    check_int_at_least(value, name, 0 if allow_zero else 1)


def check_int_at_least(value: object, name: str, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def check_int_fields(obj: object, **lows: int) -> None:
    """Each named attribute of ``obj`` is an int at least its bound (a config's ``__post_init__``)."""
    for name, low in lows.items():
        check_int_at_least(getattr(obj, name), name, low)


F = TypeVar("F", bound=Callable[..., Any])

KEY_PADDING_MASK_RENAMED = (
    "key_padding_mask was renamed key_mask, because torch.nn.MultiheadAttention's key_padding_mask means the "
    "opposite: there True marks padding to ignore. attnzoo's key_mask is True where a token is real (attend "
    "it), like SDPA's boolean attn_mask and Hugging Face's attention_mask. A torch-style mask becomes "
    "key_mask=~key_padding_mask."
)


def renamed_key_mask(fn: F) -> F:
    """Make ``fn`` refuse the old keyword ``key_padding_mask`` with a ``TypeError`` that explains
    the rename and the polarity, instead of Python's bare "unexpected keyword argument" (a torch
    user's mask, True = padding, must not slip in under a name that looks familiar)."""

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if "key_padding_mask" in kwargs:
            raise TypeError(KEY_PADDING_MASK_RENAMED)
        return fn(*args, **kwargs)

    return checked  # type: ignore[return-value]


def check_attn_mask(mask: object, q: Tensor, k: Tensor) -> None:
    """``attn_mask`` is ``(B | 1, H | 1, N_q, N_kv)``: bool (True = may attend) or floating
    (an additive bias on the scaled scores, ``-inf`` = masked)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"attn_mask must be a tensor (B | 1, H | 1, N_q, N_kv) or None, got {type(mask).__name__}")
    b, h, n_q, n_kv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    ok = mask.ndim == 4 and mask.shape[0] in (1, b) and mask.shape[1] in (1, h) and mask.shape[2:] == (n_q, n_kv)
    if not ok:
        raise ValueError(
            f"attn_mask must have shape (B or 1, H or 1, N_q, N_kv) = ({b} or 1, {h} or 1, {n_q}, {n_kv}), "
            f"got {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = may attend) or floating (additive), got {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"attn_mask is on {mask.device} but q, k, v are on {q.device}; move it with .to()")
