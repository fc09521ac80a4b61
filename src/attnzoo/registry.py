"""The mechanism registry: ``register`` a module class with its config and spec, ``build`` one
by name, list ``names``, ``describe`` one.

Config classes subclass ``Config``: frozen, keyword-only dataclasses. ``build`` rejects unknown
keys with the list of valid ones; constructing a config (through ``build`` or directly) checks
every value against its annotation (``int``, ``float``, ``bool``, ``str``, ``Literal[...]``,
``X | None``, ``tuple[...]``), then every range declared beside a field (``bounded``), then the
class's own ``validate()`` for what one field cannot say alone (``a < b``, "even or 1").

A config also carries its own example: ``Config.for_length(n)`` is the config to use on
sequences of length ``n`` (what benchmarks, the gallery and tests on short sequences build), so
no table keyed by mechanism name has to grow when a mechanism is added.

Layer geometry reaches a config one way: ``build(name, shape=Shape(heads=..., head_dim=...,
max_len=...))``. A config field named like a ``Shape`` field (``heads``, ``head_dim``,
``value_dim``, ``max_len``) is that geometry; ``make_config`` fills it from the shape unless the
caller set it, and ignores the shape's other fields. So a layer passes what it knows and never
asks which fields a mechanism has.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Self

from torch import nn

from attnzoo.spec import Capabilities, Complexity, Shape, Spec


def bounded(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    none: str = "",
    for_length: Any = None,
) -> Any:
    """A config field with its range declared beside it: ``chunk: int = bounded(64, ge=1)``.

    ``Config`` checks every such field once, on construction, so a config class states its
    ranges instead of writing a check per field; the error names the config, the field, the
    bound and the value. ``ge``/``gt`` are the lower bound (inclusive/exclusive), ``le`` the upper.
    ``none`` says what None means for a field typed ``X | None`` (None is never range-checked),
    e.g. ``scale: float | None = bounded(None, gt=0, none="for 1/sqrt(D)")``.

    ``for_length``: the field's value in ``Config.for_length(n)``, declared beside it like the
    range: a function of ``n`` (``window: int = bounded(64, ge=1, for_length=quarter)``) or a
    value used at every length (``for_length=4``). Fields without one keep their default there.
    """
    limits = {"ge": ge, "gt": gt, "le": le}
    metadata = {key: value for key, value in limits.items() if value is not None}
    if none:
        metadata["none"] = none
    if for_length is not None:
        metadata["for_length"] = for_length
    return dataclasses.field(default=default, metadata=metadata)


def _bound_text(limits: typing.Mapping[str, Any]) -> str:
    low = limits.get("ge", limits.get("gt"))
    if "le" in limits:
        opening = "[" if "ge" in limits else "("
        return f"in {opening}{low}, {limits['le']}]" if low is not None else f"<= {limits['le']}"
    return f">= {low}" if "ge" in limits else f"> {low}"


def _within(value: Any, limits: typing.Mapping[str, Any]) -> bool:
    return (
        ("ge" not in limits or value >= limits["ge"])
        and ("gt" not in limits or value > limits["gt"])
        and ("le" not in limits or value <= limits["le"])
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Base of every mechanism config: on construction, checks each field's type against its
    annotation and its range against its ``bounded`` declaration, then runs ``validate``.

    ``for_length(n)`` gives the config for sequences of length ``n``; a mechanism with a setting
    that should follow the length overrides ``length_values``.

    ``renamed`` maps a field's old name to what replaced it (``{"window": "left and right"}``):
    ``build`` refuses the old name with the new one in the message. A class declares only its
    own renames; those of its bases apply too, and a name that is a field again is not refused."""

    renamed: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and not _matches(value, hints[f.name]) and _matches(tuple(value), hints[f.name]):
                # A list where a tuple is declared (global_indices=[0]): the config stays hashable.
                value = tuple(value)
                object.__setattr__(self, f.name, value)
            if not _matches(value, hints[f.name]):
                # A value of the right type but outside a Literal's choices is a ValueError.
                literal = typing.get_origin(hints[f.name]) is Literal
                error = ValueError if literal else TypeError
                raise error(f"{type(self).__name__}: {f.name!r} must be {_show(hints[f.name])}, got {value!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and not _within(value, f.metadata):
                nullable = _matches(None, hints[f.name])
                none = f" or None ({f.metadata['none']})" if "none" in f.metadata else " or None" if nullable else ""
                raise ValueError(
                    f"{type(self).__name__}: {f.name} must be {_bound_text(f.metadata)}{none}, got {value}"
                )
        self.validate()

    def validate(self) -> None:
        """Check what one field's range cannot say (relations between fields); override in
        subclasses. Raise ValueError naming the fields."""

    @classmethod
    def length_values(cls, n: int) -> dict[str, Any]:
        """The values ``for_length(n)`` sets (the rest keep their defaults): here, each field's
        ``bounded(..., for_length=...)``, called with ``n`` where it is a function.

        Declare one where a default is sized for long inputs: on a short sequence a window of 64
        or 64 landmarks would cover every key and make the mechanism full attention. The rule
        of thumb is about a quarter of the keys per query (``quarter(n)``) and blocks of an
        eighth (``eighth(n)``). Override this where fields are sized together (a grid's ``h``
        and ``w``) or one follows another."""
        return {
            f.name: rule(n) if callable(rule) else rule
            for f in dataclasses.fields(cls)
            if (rule := f.metadata.get("for_length")) is not None
        }

    @classmethod
    def for_length(cls, n: int) -> Self:
        """The config for sequences of ``n`` tokens: ``length_values(n)`` over the defaults."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{cls.__name__}.for_length: n must be an int >= 1, got {n!r}")
        return cls(**cls.length_values(n))


#: What None means for a geometry field (``heads``, ``head_dim``) of a mechanism whose parameters
#: can wait for the first input: ``heads: int | None = bounded(None, ge=1, none=LAZY_GEOMETRY)``.
LAZY_GEOMETRY = "created on the first forward; a layer's Shape sets it"


def quarter(n: int) -> int:
    """About a quarter of ``n`` (at least 2): the keys per query of a length-sized config."""
    return max(2, n // 4)


def eighth(n: int) -> int:
    """About an eighth of ``n`` (at least 2): the block size of a length-sized config."""
    return max(2, n // 8)


_SPECS: dict[str, Spec] = {}
_BY_CONFIG: dict[type, Spec] = {}


def register(
    name: str,
    *,
    config: type,
    family: str,
    summary: str,
    paper: str,
    capabilities: Capabilities,
    complexity: Complexity,
    notes: tuple[str, ...] = (),
) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: register ``module`` under ``name``; ``build(name, **kw)`` then returns
    ``module(config(**kw))``. Each name has its own config class."""
    params = getattr(config, "__dataclass_params__", None)
    frozen_kw = params is not None and params.frozen and all(f.kw_only for f in dataclasses.fields(config))
    if not (isinstance(config, type) and issubclass(config, Config) and frozen_kw):
        raise TypeError(f"config for {name!r} must be a frozen, keyword-only dataclass subclassing Config")
    if name in _SPECS:
        raise ValueError(f"a mechanism named {name!r} is already registered")
    if config in _BY_CONFIG:
        raise ValueError(f"{config.__name__} already configures {_BY_CONFIG[config].name!r}; give {name!r} its own")

    def decorate(module: type[nn.Module]) -> type[nn.Module]:
        spec = Spec(
            name=name,
            family=family,
            summary=summary,
            paper=paper,
            config=config,
            module=module,
            capabilities=capabilities,
            complexity=complexity,
            notes=notes,
        )
        _SPECS[name] = spec
        _BY_CONFIG[config] = spec
        return module

    return decorate


#: The exact attention every other mechanism is measured against (benchmarks, reports, the
#: gallery, the default of layers and training runs): one name, here.
EXACT = "softmax"


def names(*, family: str | None = None, kind: str | None = None, **capabilities: bool) -> list[str]:
    """Registered names, sorted; optionally only a ``family``, a ``kind`` ("attention" or
    "mixer"), or those with the given capability flags, e.g. ``names(causal=True)``."""
    valid = {f.name for f in dataclasses.fields(Capabilities)} - {"backends", "kind"}
    unknown = set(capabilities) - valid
    if unknown:
        raise ValueError(f"unknown capability {sorted(unknown)}; valid: {sorted(valid)}")
    return sorted(
        spec.name
        for spec in _SPECS.values()
        if (family is None or spec.family == family)
        and (kind is None or spec.capabilities.kind == kind)
        and all(getattr(spec.capabilities, key) == want for key, want in capabilities.items())
    )


def describe(name: str) -> Spec:
    """The ``Spec`` of a registered mechanism: family, paper, complexity, capabilities, config."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name not in _SPECS:
        close = difflib.get_close_matches(name, list(_SPECS), n=3)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise ValueError(f"no mechanism named {name!r}{hint}; registered: {', '.join(sorted(_SPECS))}")
    return _SPECS[name]


def spec_of_config(config: object) -> Spec:
    """The spec whose config class ``config`` is an instance of."""
    spec = _BY_CONFIG.get(type(config))
    if spec is None:
        raise TypeError(f"{type(config).__name__} is not the config of any registered mechanism")
    return spec


def make_config(name: str, *, shape: Shape | None = None, **values: Any) -> Any:
    """Validate ``values`` against ``name``'s config class and return the config.

    ``shape``: the layer's geometry; it fills the config's geometry fields (those named like a
    ``Shape`` field) that ``values`` leaves out. A value set by the caller wins over the shape.
    """
    spec = describe(name)
    _check_keys(name, values)
    return spec.config(**{**geometry(spec.config, shape), **values})


def geometry(config: type, shape: Shape | None) -> dict[str, int]:
    """The values ``shape`` gives ``config``: its known fields that ``config`` also has.

    The one place where layer geometry meets a config (see the module docstring)."""
    if shape is None:
        return {}
    if not isinstance(shape, Shape):
        raise TypeError(f"shape must be an attnzoo.Shape, got {type(shape).__name__}")
    fields = {f.name for f in dataclasses.fields(config)}
    return {key: value for key, value in shape.known().items() if key in fields}


def check_values(name: str, values: dict[str, Any]) -> None:
    """Check the keys and value types of part of ``name``'s config (not ranges, not required
    fields), e.g. settings parsed from a command line before the rest is known. A value of the
    wrong type is a bad value there: ``ValueError`` naming the key."""
    _check_keys(name, values)
    hints = typing.get_type_hints(describe(name).config)
    for key, value in values.items():
        if not _matches(value, hints[key]):
            raise ValueError(f"{name!r}: config key {key!r} must be {_show(hints[key])}, got {value!r}")


def _check_keys(name: str, values: dict[str, Any]) -> None:
    config = describe(name).config
    fields = [f.name for f in dataclasses.fields(config)]
    unknown = sorted(set(values) - set(fields))
    renamed = {old: new for klass in reversed(config.__mro__) for old, new in vars(klass).get("renamed", {}).items()}
    for old in unknown:
        if old in renamed:
            raise ValueError(
                f"{name!r}: config key {old!r} was renamed: use {renamed[old]} (valid keys: {', '.join(fields)})"
            )
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(map(repr, unknown))} for {name!r}; "
            f"valid keys: {', '.join(fields) or '(none)'}"
        )


def build(name: str, *, shape: Shape | None = None, **config: Any) -> nn.Module:
    """Build the mechanism registered as ``name`` with the given config values.

    ``shape``: the geometry of the layer it goes into (``attnzoo.Shape``); it fills the config's
    ``heads`` / ``head_dim`` / ``value_dim`` / ``max_len`` fields where ``config`` does not set
    them, so mechanisms with per-head or per-position parameters create them here, not on the
    first forward.

    >>> attn = build("softmax", normalizer="relu")
    >>> synth = build("synthesizer", shape=Shape(heads=4, head_dim=16, max_len=128))
    """
    return describe(name).module(make_config(name, shape=shape, **config))


def config_fields(name: str) -> dict[str, tuple[str, Any]]:
    """``{key: (type as text, default)}`` for ``name``'s config (for ``attnzoo describe``)."""
    spec = describe(name)
    hints = typing.get_type_hints(spec.config)
    out = {}
    for f in dataclasses.fields(spec.config):
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        out[f.name] = (_show(hints[f.name]), default)
    return out


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(x, args[0]) for x in value)
        return len(args) == len(value) and all(_matches(x, a) for x, a in zip(value, args))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _show(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return " | ".join(map(repr, args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_show(a) for a in args)
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))
