"""One module per family; importing this package registers every mechanism."""

from attnzoo.mechanisms import softmax, sparse  # noqa: F401
from attnzoo.mechanisms.base import Attention

__all__ = ["Attention"]
