"""Patterns from text, for command lines (``--set pattern=...``): the builder calls of
``attnzoo.patterns`` with literal arguments, joined by ``|`` and ``&``, and ``per_head[a, b]``
(the form a ``PerHead`` prints); a bare name calls a builder without arguments (``causal``).
Patterns that print as builder calls read back to an equal pattern; display forms such as
``axial(4x4)`` do not (write ``axial(4, 4)``). Nothing else is evaluated: the text is walked as a Python
syntax tree, never passed to ``eval``.

>>> parse("local(2) | global_tokens([0])").dense(4).int()[3].tolist()
[1, 1, 1, 1]
>>> parse("per_head[local(8), strided(8)]")
per_head[local(8), strided(8)]
"""

from __future__ import annotations

import ast
from typing import Any

from attnzoo.patterns.algebra import Pattern


def builders() -> dict[str, Any]:
    """The names ``parse`` accepts: the public lower-case builders of ``attnzoo.patterns``."""
    import attnzoo.patterns as P

    return {name: getattr(P, name) for name in P.__all__ if name.islower() and name != "parse"}


def parse(text: str) -> Pattern:
    """The pattern ``text`` describes; ``ValueError`` naming the part it cannot read."""
    if not isinstance(text, str):
        raise TypeError(f"parse takes a pattern as text, got {type(text).__name__}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"pattern {text!r} is not an expression: {error.msg}") from None
    pattern = _build(tree.body, text)
    if not isinstance(pattern, Pattern):
        kind = type(pattern).__name__
        raise ValueError(f"pattern {text!r} is {kind} {pattern!r}, not a pattern; call a builder, e.g. local(64)")
    return pattern


def _build(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr | ast.BitAnd):
        left, right = _build(node.left, text), _build(node.right, text)
        return left | right if isinstance(node.op, ast.BitOr) else left & right
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        builder = _builder(node.func.id, text)
        args = [_build(arg, text) for arg in node.args]
        kwargs = {kw.arg: _build(kw.value, text) for kw in node.keywords if kw.arg is not None}
        try:
            return builder(*args, **kwargs)
        except TypeError as error:  # wrong arguments: say where in the text
            raise TypeError(f"pattern {text!r}: {ast.unparse(node)}: {error}") from None
    if isinstance(node, ast.Name):  # a builder without arguments, as causal and full print
        return _build(ast.Call(func=node, args=[], keywords=[]), text)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "per_head":
        heads = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return _builder("per_head", text)([_build(head, text) for head in heads])
    if isinstance(node, ast.List):
        return [_build(e, text) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_build(e, text) for e in node.elts)
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(
            f"pattern {text!r}: cannot read {ast.unparse(node)!r}; use builder calls with literal "
            f"arguments joined by | and & (builders: {', '.join(sorted(builders()))})"
        ) from None


def _builder(name: str, text: str) -> Any:
    known = builders()
    if name not in known:
        raise ValueError(f"pattern {text!r}: unknown builder {name!r}; known: {', '.join(sorted(known))}")
    return known[name]
