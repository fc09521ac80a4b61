"""A/B of ``selected.selected_softmax`` pointing unused slots at extra zero keys, masked, so
every row keeps all its slots and the CSR structures are built in batched calls, against the
function as revision OLD_REV had it (structures built one by one where some slot is unused:
causal ``topk``'s first rows, padding), in one process.

The old function is loaded from ``git show OLD_REV:src/attnzoo/mechanisms/selected.py`` and
swapped into ``topk`` and ``dsa`` per call; each pair is timed forward+backward interleaved with
dense SDPA's (B=1, H=8, D=64, median of the repeats). Usage: ``python
scripts/ab_selected_slots.py OLD_REV N CAUSAL(0|1) topk[,dsa] [REPEATS]``.
"""

from __future__ import annotations

import sys

from ab_timing import ab_main, module_at

from attnzoo.mechanisms import dsa_functions, selected, topk

if __name__ == "__main__":
    rev, *args = sys.argv[1:]
    rules = {
        "old": module_at(rev, "src/attnzoo/mechanisms/selected.py").selected_softmax,
        "new": selected.selected_softmax,
    }

    def use(rule: str) -> None:
        topk.selected_softmax = dsa_functions.selected_softmax = rules[rule]

    ab_main(use, args)
