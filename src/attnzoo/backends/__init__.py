"""How exact attention is computed; every backend computes the same function."""

from attnzoo.backends.reference import reference_attention

__all__ = ["reference_attention"]
