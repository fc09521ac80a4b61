"""A/B of ``softcap``'s hand-written chunks (``mechanisms/softcap_chunks.py``) against the generic
path it replaced (``chunked_attention``: the reference with the cap as a ``score_mod``, each chunk
checkpointed), in one process; or, given two more numbers, of two values of
``softcap_chunks.CHUNK_SCORES`` (old, new). Each pair is timed forward+backward interleaved with
dense SDPA's (B=1, H=8, D=64, median of the repeats).

    python scripts/ab_softcap_chunks.py N CAUSAL(0|1) softcap [REPEATS [OLD_SCORES NEW_SCORES]]
"""

from __future__ import annotations

import sys

from ab_timing import ab_main

from attnzoo.mechanisms import softcap_chunks as chunks
from attnzoo.mechanisms import softmax_variants as sv
from attnzoo.score_mods import softcap

BY_HAND = sv.softcap_chunks


def generic(q, k, v, cap, *, causal, key_mask, scale):  # noqa: ANN001, ANN201
    """The path before: the reference per chunk of 4M scores, checkpointed."""
    return sv.chunked_attention(q, k, v, causal=causal, key_mask=key_mask, score_mod=softcap(cap), scale=scale)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 6:
        sizes = {"old": int(args[4]), "new": int(args[5])}
        ab_main(lambda rule: setattr(chunks, "CHUNK_SCORES", sizes[rule]), args[:4])
    else:
        ab_main(lambda rule: setattr(sv, "softcap_chunks", generic if rule == "old" else BY_HAND), args)
