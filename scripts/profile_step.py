"""torch.profiler tables of one mechanism's fwd+bwd steps (three, after three warm-ups), by
device time and by host time: how a GPU spends a step, and how many launches it takes.

    PYTHONPATH=src python scripts/profile_step.py performer 16384 0 [cuda]   # name, N, causal
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import attnzoo


def main() -> None:
    name, n, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    device = sys.argv[4] if len(sys.argv) > 4 else "cuda"
    on_gpu = device == "cuda"
    attn = attnzoo.build(name).to(device)
    q, k, v = (torch.randn(1, 8, n, 64, device=device, requires_grad=True) for _ in range(3))

    def step():
        attn(q, k, v, causal=causal).sum().backward()

    for _ in range(3):
        step()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        if on_gpu:
            torch.cuda.synchronize()
    print(name, n, "causal" if causal else "non-causal", device)
    table = prof.key_averages()
    if on_gpu:
        print(table.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=40))
    print(table.table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=40))


if __name__ == "__main__":
    main()
