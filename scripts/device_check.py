"""Every registered mechanism on an accelerator against itself on the CPU: forward and the
gradients of q, k and v (attention) or of x (token mixers), float32 on the device against
float64 on the CPU, same weights, at an N that is not a multiple of the 128-wide tiles, B = H =
2, one batch row padded, causal and not where the mechanism has the mode. One JSON line per
(mechanism, causal): ``status`` "ok" (error relative to the largest value, or to 1e-3 where
that is smaller, <= --tol), "mismatch" or "error", the
relative errors, and the backend a pattern ran on. Each check has --seconds to finish (flex
compiles per pattern on a GPU).

    PYTHONPATH=src python scripts/device_check.py --device cuda --out device-check.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import time
from pathlib import Path

import torch

import attnzoo
from attnzoo.bench.configs import sized
from attnzoo.registry import config_fields

B, H, D = 2, 2, 16


def _relative(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is b else float("inf")
    a, b = a.double().cpu(), b.double().cpu()
    # Relative to the largest value, at least 1e-3: a gradient that is zero by definition (a
    # query that sees one key) must not turn float32 rounding into a huge ratio.
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-3))


def _module(name: str, n: int) -> torch.nn.Module:
    spec = attnzoo.describe(name)
    if spec.capabilities.kind == "mixer":
        return attnzoo.build(name, shape=attnzoo.Shape(max_len=n), dim=H * D, **sized(name, n))
    geometry = {key: value for key, value in (("heads", H), ("head_dim", D)) if key in config_fields(name)}
    return attnzoo.build(name, **{**sized(name, n), **geometry})


def _run(module: torch.nn.Module, inputs: list[torch.Tensor], causal: bool, mask: torch.Tensor):
    inputs = [x.detach().requires_grad_() for x in inputs]
    if len(inputs) == 1:
        out = module(inputs[0], causal=causal)
    else:
        out = module(*inputs, causal=causal, key_mask=mask)
    out.backward(torch.ones_like(out))
    return out.detach(), [x.grad for x in inputs]


def check(name: str, causal: bool, n: int, device: str, tol: float) -> dict:
    torch.manual_seed(0)
    cpu = _module(name, n).double().eval()
    mixer = attnzoo.describe(name).capabilities.kind == "mixer"
    shapes = [(B, n, H * D)] if mixer else [(B, H, n, D)] * 3
    inputs = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, n - 30 :] = False  # one padded row
    want, want_grads = _run(cpu, inputs, causal, mask)
    gpu = copy.deepcopy(cpu).float().to(device)
    start = time.perf_counter()
    got, got_grads = _run(gpu, [x.float().to(device) for x in inputs], causal, mask.to(device))
    errors = [_relative(got, want)] + [_relative(g, w) for g, w in zip(got_grads, want_grads, strict=True)]
    choice = attnzoo.last_choice() if hasattr(cpu, "pattern") else None
    return {
        "mechanism": name,
        "causal": causal,
        "n": n,
        "status": "ok" if max(errors) <= tol else "mismatch",
        "relative_error": {"out": errors[0], "grads": errors[1:]},
        "backend_ran": None if choice is None else " ".join(filter(None, (choice.backend, choice.path))),
        "backends_skipped": None if choice is None else choice.skipped,
        "seconds": time.perf_counter() - start,
    }


def _attempt(name: str, causal: bool, args: argparse.Namespace) -> dict:
    try:
        return check(name, causal, args.n, args.device, args.tol)
    except ValueError:  # defined on another length only (a 16 x 16 grid, a graph): 256
        return check(name, causal, 256, args.device, args.tol)


def _alarm(signum, frame):  # noqa: ANN001, ARG001
    raise TimeoutError("took longer than --seconds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--tol", type=float, default=1e-3)
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--only", default="", help="comma-separated mechanisms (default: all)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 on the device, not TF32
    torch.backends.cudnn.allow_tf32 = False
    signal.signal(signal.SIGALRM, _alarm)
    names = args.only.split(",") if args.only else attnzoo.names()
    with args.out.open("a") as out:
        for name in names:
            caps = attnzoo.describe(name).capabilities
            for causal in [c for c, ok in ((False, caps.bidirectional), (True, caps.causal)) if ok]:
                signal.alarm(args.seconds)
                try:
                    row = _attempt(name, causal, args)
                except Exception as error:  # noqa: BLE001 - every failure is a result line
                    text = f"{type(error).__name__}: {error}"[:400]
                    row = {"mechanism": name, "causal": causal, "status": "error", "error": text}
                finally:
                    signal.alarm(0)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(name, causal, row["status"], row.get("relative_error", row.get("error")), flush=True)


if __name__ == "__main__":
    main()
