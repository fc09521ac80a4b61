"""Hugging Face ``transformers`` integration: run a registered mechanism inside a pretrained
model, without retraining, through transformers' ``AttentionInterface``.

>>> import attnzoo.hf
>>> model = AutoModel.from_pretrained(path).eval()
>>> attnzoo.hf.use(model, "longformer", left=64, right=64, global_indices=(0,))  # CLS token global
>>> out = model(**batch)                                   # every self-attention layer runs it

``use`` registers ``"attnzoo"`` with ``AttentionInterface`` (and a mask function with
``AttentionMaskInterface``), checks the mechanism against the model (a causal model needs a
causal mechanism), stores the choice on the model's config as ``attnzoo_mechanism`` and
``attnzoo_config`` (one name, or a list indexed by layer for a hybrid model), and builds every
layer's mechanism at once, so its parameters train with the model and ``save_pretrained`` saves
them. ``attnzoo.hf.load(ModelClass, path)`` reloads such a model with its mechanisms' tensors
(``from_pretrained(..., attn_implementation="attnzoo")`` alone rebuilds the mechanisms from the
config but drops their saved tensors).

Notes:
    - transformers hands the attention function ``query/key/value (B, H, N, D)`` and takes
      ``(B, N, H, D)`` back; the mechanism sees ``(B, H, N, D)``, attnzoo's layout.
    - One mechanism module is built per attention layer by ``use`` (heads, head width and the
      model's ``max_position_embeddings`` as an ``attnzoo.Shape``, which sizes per-head and
      per-position parameters) and kept on that layer as the submodule ``attnzoo_mechanism`` (so
      ``.to()``, ``.eval()``, ``parameters()`` and ``state_dict`` reach parameters such as
      Linformer's projections). It is rebuilt if the config changes.
    - Sliding-window models (Mistral; Qwen2/Gemma sliding layers): with the default ``softmax``, a
      sliding layer of window W runs ``local(left=W-1, right=0)``, exactly the model's attention;
      another mechanism on such a layer is refused (the model's window would be dropped).
    - The model's own softmax scale (``scaling``) is kept: it becomes the mechanism's ``scale``
      config where it has one (so ``scale`` may not be given to ``use``).
    - Masks: a padding mask reaches the mechanism as ``key_mask (B, N_kv)``, True = real
      token; causality comes from the layer (``is_causal``). Any other mask (sliding windows,
      packed sequences, a custom 4-D mask) raises unless it is exactly key padding (+ causal).
    - Decoding (``model.generate``): a mechanism that attends over keys it has not seen as
      queries (``cross_attention``) runs its causal forward over transformers' cache, end-aligned,
      which equals the full forward's rows (``step`` == ``forward`` is a contract); a
      self-attention-only one that decodes (``lsh``, ``routing``, ...) keeps its own decode
      state on the mechanism between calls (greedy and sampled generation; beam search, which
      reorders the cache, is not supported for these); one without a decode step (``random``,
      ``bigbird``, ...) refuses a call with cached keys.
    - Attention-probability dropout (the model's, in training mode) is applied by mechanisms with
      ``Capabilities.dropout`` (``softmax``, the pattern mechanisms) and refused, naming them, by the others (set the
      model's attention dropout to 0 to train those). Attention weights are not returned
      (``None``, as SDPA).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo
from attnzoo.registry import EXACT, config_fields, make_config

try:
    from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel, masking_utils
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "attnzoo.hf needs Hugging Face transformers; install it with: pip install 'attnzoo[hf]'"
    ) from error

NAME = "attnzoo"
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "position_bias", "sinks")


def register() -> None:
    """Register the ``"attnzoo"`` attention and mask functions with transformers (idempotent).
    Afterwards ``from_pretrained(..., attn_implementation="attnzoo")`` and
    ``model.set_attn_implementation("attnzoo")`` are accepted."""
    AttentionInterface.register(NAME, attention)
    masking_utils.AttentionMaskInterface.register(NAME, mask)


Choice = str | tuple[str, dict[str, Any]]
"""One layer's mechanism: a registered name, or ``(name, config)``."""


def use(
    model: PreTrainedModel,
    mechanism: Choice | Sequence[Choice] | Callable[[int], Choice] = "softmax",
    **config: Any,
) -> PreTrainedModel:
    """Make every attention layer of ``model`` run ``mechanism`` with ``config``, and build the
    mechanisms now, so their parameters are in ``model.parameters()`` (an optimiser made next
    trains them) and in its state dict (``save_pretrained`` saves them; ``attnzoo.hf.load``
    reads them back).

    Args:
        model: a transformers model whose attention goes through ``AttentionInterface``
            (``model._supports_attention_backend``; BERT, GPT-2, Llama and most recent models).
        mechanism: a registered attention mechanism (``attnzoo.names(kind="attention")``) for
            every layer; or, for a hybrid model, one choice per layer — a sequence indexed by the
            layer's ``layer_idx``, or a function of it — each a name or ``(name, config)``.
        **config: the mechanism's config keys (``attnzoo describe NAME``) when ``mechanism`` is
            one name, except ``scale``, which is the model's own.

    Returns:
        ``model``, changed in place (config attributes, attention implementation, and one
        ``attnzoo_mechanism`` submodule per attention layer).

    Raises:
        ValueError: unknown mechanism or config key, a token mixer, ``scale`` given, a causal
            model with a mechanism that cannot be causal, or per-layer choices that do not
            cover the model's layers.
    """
    register()
    layers = attention_layers(model)
    choices = _per_layer(mechanism, config, [m.layer_idx for m in layers])
    for layer in layers:  # a sliding-window layer's exact attention is `local` over its window
        window = sliding_window(layer)
        if window is not None and choices[layer.layer_idx] == (EXACT, {}):
            choices[layer.layer_idx] = ("local", {"left": window - 1, "right": 0})
    causal = is_causal(model)
    for name, cfg in choices.values():
        check(name, cfg, causal=causal)
    distinct = {(name, repr(sorted(cfg.items()))) for name, cfg in choices.values()}
    count = max(choices, default=-1) + 1
    for cfg in _configs(model):
        if len(distinct) <= 1:  # one mechanism for every layer: stored as one name
            name, values = next(iter(choices.values()), (mechanism, config))
            cfg.attnzoo_mechanism, cfg.attnzoo_config = name, dict(values)
        else:
            cfg.attnzoo_mechanism = [choices[i][0] for i in range(count)]
            cfg.attnzoo_config = [dict(choices[i][1]) for i in range(count)]
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise ValueError(
            f"{type(model).__name__} cannot switch attention implementation (it does not go through "
            "transformers' AttentionInterface), so attnzoo cannot run inside it"
        )
    build_mechanisms(model)
    return model


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of ``model``: those with a transformers ``config``, a
    ``layer_idx`` and a head width (``head_dim`` or ``attention_head_size``)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "config", None), PretrainedConfig)
        and isinstance(getattr(m, "layer_idx", None), int)
        and _head_dim(m) is not None
    ]


def build_mechanisms(model: nn.Module) -> None:
    """Build every attention layer's mechanism from the model's config, with the layer's
    geometry (heads, head width, the model's maximum length) and scale."""
    causal = is_causal(model)
    for layer in attention_layers(model):
        heads = getattr(layer, "num_heads", None) or getattr(layer, "num_attention_heads", None)
        heads = heads or getattr(layer.config, "num_attention_heads", None)
        head_dim = _head_dim(layer)
        max_len = getattr(layer.config, "max_position_embeddings", None)
        shape = attnzoo.Shape(heads=heads, head_dim=head_dim, value_dim=head_dim, max_len=max_len)
        scaling = getattr(layer, "scaling", None)
        _mechanism(layer, head_dim**-0.5 if scaling is None else float(scaling), causal, shape)


def load(model_class: Any, path: Any, **kwargs: Any) -> PreTrainedModel:
    """``model_class.from_pretrained(path, attn_implementation="attnzoo", **kwargs)`` with the
    mechanisms a model saved after ``use`` had, built and holding their saved tensors.

    ``from_pretrained`` alone drops the mechanisms' tensors (the modules holding them do not
    exist until attnzoo builds them): this builds them from the saved config, then reads their
    tensors from the checkpoint's safetensors files. Raises ``ValueError`` if a mechanism tensor
    is missing from the checkpoint."""
    register()
    model = model_class.from_pretrained(path, attn_implementation=NAME, **kwargs)
    build_mechanisms(model)
    wanted = {k for k in model.state_dict() if ".attnzoo_mechanism." in f".{k}"}
    saved = {k: v for k, v in _checkpoint_tensors(Path(path)).items() if k in wanted}
    missing = sorted(wanted - saved.keys())
    if missing:
        raise ValueError(
            f"the checkpoint at {path} lacks {len(missing)} attnzoo mechanism tensors (e.g. {missing[0]}): "
            "was it saved after attnzoo.hf.use(...) with this mechanism?"
        )
    model.load_state_dict(saved, strict=False)
    return model


def _checkpoint_tensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    tensors: dict[str, Tensor] = {}
    for name in files:
        if not (path / name).exists():
            raise ValueError(f"no safetensors checkpoint at {path / name}; attnzoo.hf.load reads safetensors only")
        tensors.update(load_file(str(path / name)))
    return tensors


def sliding_window(layer: nn.Module) -> int | None:
    """The layer's sliding window W (it sees its last W keys, itself included), or None: the
    layer's own ``sliding_window`` (Qwen2, Gemma: per layer), else its config's (Mistral)."""
    if hasattr(layer, "sliding_window"):
        return layer.sliding_window
    return getattr(layer.config, "sliding_window", None)


def _head_dim(layer: nn.Module) -> int | None:
    value = getattr(layer, "head_dim", None) or getattr(layer, "attention_head_size", None)
    return value if isinstance(value, int) else None


def _per_layer(mechanism: Any, config: dict[str, Any], indices: list[int]) -> dict[int, tuple[str, dict[str, Any]]]:
    """``{layer_idx: (name, config)}`` from ``use``'s arguments."""
    if isinstance(mechanism, str):
        return {i: (mechanism, dict(config)) for i in indices}
    if config:
        raise ValueError("config keywords go with one mechanism name; per-layer choices carry (name, config) each")
    if callable(mechanism):
        picked = {i: mechanism(i) for i in indices}
    elif isinstance(mechanism, Sequence):
        if indices and max(indices) >= len(mechanism):
            raise ValueError(f"mechanism: {len(mechanism)} per-layer choices for layers up to {max(indices)}")
        picked = {i: mechanism[i] for i in indices}
    else:
        raise TypeError(f"mechanism must be a name, a sequence of per-layer choices or a function, got {mechanism!r}")
    out = {}
    for i, choice in picked.items():
        name, cfg = (choice, {}) if isinstance(choice, str) else choice
        if not isinstance(name, str) or not isinstance(cfg, dict):
            raise TypeError(f"layer {i}: a choice is a name or (name, config dict), got {choice!r}")
        out[i] = (name, dict(cfg))
    return out


def is_causal(model: nn.Module) -> bool:
    """Whether any attention layer of ``model`` is causal (decoder self-attention)."""
    return any(getattr(cfg, "is_decoder", False) for cfg in _configs(model)) or any(
        getattr(m, "is_causal", False) is True for m in model.modules()
    )


def check(mechanism: str, config: dict[str, Any], *, causal: bool) -> None:
    """Raise ``ValueError`` unless ``mechanism`` with ``config`` can replace a model's attention
    (causal or not)."""
    spec = attnzoo.describe(mechanism)
    if spec.capabilities.kind != "attention":
        raise ValueError(
            f"{mechanism!r} is a token mixer: it replaces the whole attention layer (it takes x, not q, k, v) "
            f"and needs trained weights, so it cannot stand in for a model's attention function; "
            f"use one of {', '.join(attnzoo.names(kind='attention'))}"
        )
    if causal and not spec.capabilities.causal:
        raise ValueError(
            f"the model is causal (decoder self-attention) but {mechanism!r} cannot be causal; "
            f"mechanisms that can: {', '.join(attnzoo.names(kind='attention', causal=True))}"
        )
    if "scale" in config:
        raise ValueError("do not pass 'scale': the model's own attention scale (module.scaling) is used")
    values = _tuples(config)
    if "scale" in config_fields(mechanism):
        values["scale"] = 1.0
    make_config(mechanism, **values)


def attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The ``"attnzoo"`` attention function (``AttentionInterface`` signature).

    Shapes:
        query ``(B, H, N_q, D)``, key/value ``(B, H_kv, N_kv, D)`` (``H_kv`` divides ``H``: passed
        un-repeated; see ``Capabilities.gqa``), attention_mask ``(B, N_kv)`` bool from ``mask`` or a 4-D bool/additive
        mask ``(B, 1, N_q, N_kv)`` -> ``((B, N_q, H, D_v), None)``.
    """
    extra = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if extra:
        raise ValueError(f"the attnzoo attention function does not support {', '.join(extra)} (given by the model)")
    # transformers passes the model's attention dropout in training and 0 in eval: honoured by
    # mechanisms with Capabilities.dropout (softmax, the patterns), refused by the others with their names.
    dropout = float(dropout) if module.training else 0.0
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False)) if causal is None else bool(causal)
    head_dim = query.shape[-1]
    window = kwargs.get("sliding_window")
    scaling = head_dim**-0.5 if scaling is None else float(scaling)
    # The layer's geometry, from its inputs (a transformers config names it many ways): it sizes
    # per-head parameters (Synthesizer, Sinkhorn, RFA's gate, ...) when the mechanism is built.
    shape = attnzoo.Shape(heads=query.shape[1], head_dim=head_dim, value_dim=value.shape[-1])
    mech = _mechanism(module, scaling, causal, shape)
    if window is not None:
        _check_window(mech, window)
    # Grouped-query K/V (B, H_kv, N, D) go in as they are: a mechanism that attends them itself
    # (Capabilities.gqa: softmax through SDPA's enable_gqa, the kernel family's per-K/V-head sums, ...)
    # never repeats them; the others repeat them per call.
    key_mask, causal = key_padding(attention_mask, query.shape[2], key.shape[2], causal)
    if not mech._attnzoo_takes_scale and abs(scaling * head_dim**0.5 - 1) > 1e-6:
        # Mechanisms without a scale key use 1/sqrt(D) (Linformer, Nystrom, compressed, and the
        # Performer's exp(q.k/sqrt(D)) estimate) or no temperature at all (linear, efficient).
        # Multiplying q by scaling*sqrt(D) turns their q.k/sqrt(D) into the model's q.k*scaling;
        # for the temperature-free kernels it is the same rescaling of the scores.
        query = query * (scaling * head_dim**0.5)
    caps = mech.spec.capabilities
    if causal and query.shape[2] < key.shape[2] and not caps.decode_step:
        # A call with cached keys (generate): the rows of an end-aligned forward over them would
        # not be the full forward's rows for this mechanism, so it is refused, not approximated.
        mech._refuse(
            "decoding with a cache (transformers' generate; use_cache=False recomputes instead)", "decode_step"
        )
    if causal and caps.decode_step and not caps.cross_attention and not dropout:
        out = _stepped(mech, query, key, value, key_mask)
    elif dropout:
        out = mech(query, key, value, causal=causal, key_mask=key_mask, dropout_p=dropout)
    else:
        out = mech(query, key, value, causal=causal, key_mask=key_mask)  # (B, H, N_q, D_v)
    return out.transpose(1, 2).contiguous(), None


def _check_window(mech: nn.Module, window: int) -> None:
    """A sliding-window layer (the model passes ``sliding_window=W``) runs ``local`` over that
    window; anything else would silently drop the model's window, so it is refused."""
    config = mech.config
    if mech.spec.name != "local" or (config.left, config.right) != (window - 1, 0):
        raise ValueError(
            f"the layer attends a sliding window of {window} keys; attnzoo.hf.use maps its exact attention to "
            f"local(left={window - 1}, right=0) but this layer runs {mech.spec.name!r} ({config}); to put another "
            "mechanism there, set the model config's sliding_window to None first"
        )


def _stepped(mech: nn.Module, query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None) -> Tensor:
    """A causal self-attention-only mechanism that decodes (``lsh``, ``routing``, ...) cannot
    attend new queries over transformers' cached keys with ``forward`` (it needs the past
    queries, or its own routing state), so in inference it keeps its own decode state on the
    mechanism: a call over a whole sequence (the prefill) starts it with ``step``, and each
    call with cached keys continues it. With gradients enabled a whole-sequence call is the plain
    forward (training) and keeps nothing."""
    n_q, n_kv = query.shape[2], key.shape[2]
    if n_q == n_kv and torch.is_grad_enabled():
        mech._attnzoo_decode = None
        return mech(query, key, value, causal=True, key_mask=key_mask)
    if n_q == n_kv:
        b, h, _, d = query.shape
        state = mech.init_state(b, h, d, value.shape[-1], kv_heads=key.shape[1], device=query.device, dtype=query.dtype)
    else:
        held = getattr(mech, "_attnzoo_decode", None)
        if held is None or held[1] != n_kv - n_q or held[2] != query.shape[0]:
            raise ValueError(
                f"{mech.spec.name!r} decodes with its own state, which does not match transformers' cache "
                f"({n_kv - n_q} cached tokens): run the prompt through the model first, without gradients, "
                "and do not edit or reorder the cache (beam search is not supported with this mechanism)"
            )
        state = held[0]
    new = slice(n_kv - n_q, None)
    mask = None if key_mask is None else key_mask[:, new]
    out, state = mech.step(state, query, key[:, :, new], value[:, :, new], key_mask=mask)
    mech._attnzoo_decode = (state, n_kv, query.shape[0])
    return out


def mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> Tensor | None:
    """The ``"attnzoo"`` mask function (``AttentionMaskInterface``): for a plain causal or
    bidirectional mask over a 2-D padding mask, return that padding mask as ``(B, N_kv)`` bool
    (None when nothing is padded) -- no N x N tensor. Anything else is built by transformers'
    ``sdpa_mask`` and checked by ``key_padding`` in each layer."""
    plain = mask_function in (masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function)
    # A plain sliding-window causal mask (no extra or/and/packed masks: allow_is_causal_skip)
    # comes with local_size = W; the layer's `local` mechanism applies the window itself.
    windowed = kwargs.get("local_size") is not None and kwargs.get("allow_is_causal_skip", False)
    if windowed and attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = attention_mask[:, kv_offset : kv_offset + kv_length]  # a sliding cache keeps the last keys
        kv_offset = 0
    pad_2d = attention_mask is None or (attention_mask.ndim == 2 and attention_mask.shape[-1] == kv_length)
    if (plain or windowed) and pad_2d and kv_offset == 0 and not kwargs.get("use_vmap", False):
        if attention_mask is None or bool(attention_mask.all()):
            return None
        return attention_mask.to(torch.bool)
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    return masking_utils.sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        **kwargs,
    )


def key_padding(attention_mask: Tensor | None, n_q: int, n_kv: int, causal: bool) -> tuple[Tensor | None, bool]:
    """``(key_mask, causal)`` equivalent to ``attention_mask``, or ValueError.

    Args:
        attention_mask: None; ``(B, N_kv)`` bool (True = real); or ``(B, 1 or H, N_q, N_kv)``
            bool (True = attend) or additive float (0 = attend, very negative = masked).
        causal: whether the layer is causal; a 4-D mask that is exactly a causal mask over key
            padding also makes the result causal.

    Notes:
        A 4-D mask must equal ``real[b, j]`` (and ``j <= i + N_kv - N_q`` where causal) for every
        query; any other structure (sliding windows, packed sequences, biases) is refused rather
        than approximated.
    """
    if attention_mask is None:
        return None, causal
    if attention_mask.ndim == 2:
        if attention_mask.shape[-1] != n_kv:
            raise ValueError(f"attention_mask has {attention_mask.shape[-1]} key positions, keys have {n_kv}")
        return attention_mask.to(torch.bool), causal
    if attention_mask.ndim != 4:
        shape = tuple(attention_mask.shape)
        raise ValueError(f"attention_mask must be (B, N_kv) or (B, 1, N_q, N_kv), got shape {shape}")
    allowed = attention_mask
    if attention_mask.dtype != torch.bool:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        if bool((attention_mask[allowed] != 0).any()):
            raise ValueError(
                "attention_mask is an additive bias (non-zero values at attended pairs), not a mask; "
                "attnzoo mechanisms take key padding (+ causal) only"
            )
    allowed = allowed.expand(-1, -1, n_q, n_kv)
    real = allowed.any(dim=(1, 2))  # (B, N_kv): keys some query attends
    tri = torch.ones(n_q, n_kv, dtype=torch.bool, device=real.device).tril(n_kv - n_q)
    for as_causal in (causal, True):
        want = real[:, None, None, :] & tri if as_causal else real[:, None, None, :]
        if torch.equal(allowed, want.expand_as(allowed)):
            return (None if bool(real.all()) else real), as_causal
    raise ValueError(
        "the model's attention mask is not a key-padding mask (e.g. a sliding window, packed sequences or a "
        "custom 4-D mask); attnzoo.hf maps only key padding (+ causal) onto key_mask"
    )


def _mechanism(module: nn.Module, scaling: float, causal: bool, shape: attnzoo.Shape) -> nn.Module:
    """The layer's mechanism, kept on the layer as the submodule ``attnzoo_mechanism``: built
    by ``use`` / ``load`` (or, for a model loaded with ``attn_implementation="attnzoo"`` alone,
    on its first call), rebuilt only when the layer's config changes."""
    name, config = _layer_choice(module)
    cache_key = (name, repr(sorted(config.items())), scaling)
    mech = getattr(module, "attnzoo_mechanism", None)
    if mech is not None and mech._attnzoo_key == cache_key:
        if mech._attnzoo_shape.heads != shape.heads or mech._attnzoo_shape.head_dim != shape.head_dim:
            raise ValueError(
                f"{type(module).__name__}: attnzoo built {name!r} for {mech._attnzoo_shape.heads} heads of "
                f"{mech._attnzoo_shape.head_dim}, the layer gives {shape.heads} of {shape.head_dim}"
            )
        return mech
    check(name, config, causal=causal)
    takes_scale = "scale" in config_fields(name)
    if takes_scale:
        config["scale"] = scaling
    mech = attnzoo.build(name, shape=shape, **config)
    mech._attnzoo_key, mech._attnzoo_takes_scale, mech._attnzoo_shape = cache_key, takes_scale, shape
    param = next(module.parameters(), None)
    if param is not None:
        mech.to(device=param.device)
    mech.train(module.training)
    module.attnzoo_mechanism = mech  # a submodule: follows .to(), .eval(), state_dict
    return mech


def _layer_choice(module: nn.Module) -> tuple[str, dict[str, Any]]:
    """``(name, config)`` for this layer from its transformers config (one name for all layers,
    or a list indexed by ``layer_idx``)."""
    cfg = getattr(module, "config", None)
    name = getattr(cfg, "attnzoo_mechanism", None)
    if name is None:
        raise ValueError(
            f"{type(module).__name__} runs attn_implementation='attnzoo' but its config names no mechanism; "
            "call attnzoo.hf.use(model, NAME, **config) or set config.attnzoo_mechanism / config.attnzoo_config"
        )
    config = getattr(cfg, "attnzoo_config", None) or {}
    if isinstance(name, (list, tuple)):
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or index >= len(name):
            raise ValueError(f"config.attnzoo_mechanism lists {len(name)} layers, no entry for layer {index}")
        name, config = name[index], (config[index] if isinstance(config, (list, tuple)) else config)
    return name, _tuples(config)


def _configs(model: nn.Module) -> list[PretrainedConfig]:
    """Every distinct transformers config in ``model`` (composite models have several)."""
    found: dict[int, PretrainedConfig] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig):
            found.setdefault(id(cfg), cfg)
    return list(found.values())


def _tuples(config: dict[str, Any]) -> dict[str, Any]:
    """Lists back to tuples: a config saved to config.json comes back with JSON lists."""

    def conv(v: Any) -> Any:
        return tuple(conv(x) for x in v) if isinstance(v, (list, tuple)) else v

    return {k: conv(v) for k, v in dict(config).items()}


__all__ = [
    "attention",
    "attention_layers",
    "build_mechanisms",
    "check",
    "is_causal",
    "key_padding",
    "load",
    "mask",
    "register",
    "use",
]
