"""Layers built on the registry: multi-head attention, encoder blocks, a causal LM."""

from attnzoo.nn.attention import MHAState, MultiHeadAttention
from attnzoo.nn.global_tokens import GlobalTokens
from attnzoo.nn.pooling import LAMAPooling
from attnzoo.nn.transformer import CausalLM, LMState, TransformerEncoder, TransformerEncoderLayer

__all__ = ["CausalLM", "GlobalTokens", "LAMAPooling", "LMState", "MHAState", "MultiHeadAttention", "TransformerEncoder", "TransformerEncoderLayer"]
