"""How exact attention is computed over a pattern; every backend computes the same function."""

from attnzoo.backends.dispatch import BACKENDS, Choice, attend, last_choice
from attnzoo.backends.reference import reference_attention

__all__ = ["BACKENDS", "Choice", "attend", "last_choice", "reference_attention"]
