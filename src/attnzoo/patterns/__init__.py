"""Which (query, key) pairs are computed: pure index functions and their block structure.

>>> from attnzoo import patterns as P
>>> p = P.local(2) | P.global_tokens([0])
>>> p.dense(6).int()[1].tolist()        # query 1 sees keys 0..3
[1, 1, 1, 1, 0, 0]
"""

from attnzoo.patterns.algebra import BlockList, Intersection, Pattern, PerHead, Union, per_head
from attnzoo.patterns.atomic import (
    Band,
    BlockLocal,
    GlobalTokens,
    Graph,
    KeyColumns,
    PeriodicColumns,
    Random,
    RandomBlocks,
    block_local,
    causal,
    dilated,
    full,
    global_tokens,
    graph,
    key_columns,
    local,
    random,
    random_blocks,
    sliding_window,
    strided,
)
from attnzoo.patterns.compound import (
    Axial,
    Block2D,
    axial,
    bigbird,
    block2d,
    etc,
    longformer,
    sinks,
    sparse_transformer_fixed,
    sparse_transformer_strided,
    star,
)
from attnzoo.patterns.parse import parse

__all__ = [
    "Axial",
    "Band",
    "Block2D",
    "BlockList",
    "BlockLocal",
    "GlobalTokens",
    "Graph",
    "Intersection",
    "KeyColumns",
    "Pattern",
    "PerHead",
    "PeriodicColumns",
    "Random",
    "RandomBlocks",
    "Union",
    "axial",
    "bigbird",
    "block2d",
    "block_local",
    "causal",
    "dilated",
    "etc",
    "full",
    "global_tokens",
    "graph",
    "key_columns",
    "local",
    "longformer",
    "parse",
    "per_head",
    "random",
    "random_blocks",
    "sinks",
    "sliding_window",
    "sparse_transformer_fixed",
    "sparse_transformer_strided",
    "star",
    "strided",
]
