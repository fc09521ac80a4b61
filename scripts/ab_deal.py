"""A/B of dense sub-sequence parts on views of the inputs, in one process (issue 12).

A dense part of the structured path (``strided``, ``axial``'s columns, the strided heads of
``sparse_transformer_strided``) de-interleaves q, k and v into sub-sequences. With no padded key
and N a multiple of the stride it now takes them as views (``window_parts._deal``: batch row
``b H + h``, the residue class as the head) where ``_split`` copied each input, and the output
gradient likewise in backward. The old rule is the same code with ``_head_major`` answering
False, swapped per call; each pair is timed forward+backward interleaved with dense SDPA's (B=1,
H=8, D=64, median of the repeats). Usage: ``python scripts/ab_deal.py N CAUSAL(0|1)
NAME[,NAME...] [REPEATS]``.
"""

from __future__ import annotations

from ab_timing import swap_main

from attnzoo.backends import window_parts

if __name__ == "__main__":
    swap_main(window_parts, "_head_major", lambda *args: False)
