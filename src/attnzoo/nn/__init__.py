"""Layers built on the registry: multi-head attention, encoder blocks, a causal LM."""

from attnzoo.mechanisms.auxiliary import auxiliary_loss
from attnzoo.nn.attention import MHAState, MultiHeadAttention
from attnzoo.nn.axial import AxialAttention
from attnzoo.nn.cbam import CBAM
from attnzoo.nn.global_tokens import GlobalTokens
from attnzoo.nn.pooling import LAMAPooling
from attnzoo.nn.sampling import Sampling
from attnzoo.nn.sharnn import SHARNN
from attnzoo.nn.transformer import CausalLM, LMState, TransformerEncoder, TransformerEncoderLayer

__all__ = [
    "AxialAttention",
    "CBAM",
    "CausalLM",
    "GlobalTokens",
    "LAMAPooling",
    "LMState",
    "MHAState",
    "MultiHeadAttention",
    "SHARNN",
    "Sampling",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "auxiliary_loss",
]
