"""The ``attnzoo`` command: ``list``, ``describe NAME``, ``demo``."""

from __future__ import annotations

import argparse
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

import attnzoo
from attnzoo.backends.reference import reference_attention
from attnzoo.registry import config_fields

_FLAGS = ("causal", "key_padding", "decode_step", "cross_attention", "score_mod")


def cmd_list(console: Console) -> None:
    table = Table(title=f"attnzoo {attnzoo.__version__}: registered mechanisms")
    for column in ("name", "family", "kind", "time", "memory", "supports"):
        table.add_column(column, no_wrap=column == "name")
    for name in attnzoo.names():
        spec = attnzoo.describe(name)
        caps = spec.capabilities
        supports = ", ".join(flag for flag in _FLAGS if getattr(caps, flag)) or "-"
        table.add_row(name, spec.family, caps.kind, spec.complexity.time, spec.complexity.memory, supports)
    console.print(table)


def cmd_describe(console: Console, name: str) -> None:
    spec = attnzoo.describe(name)
    console.print(f"[bold]{spec.name}[/bold] ({spec.family}): {spec.summary}")
    console.print(f"paper: {spec.paper}")
    console.print(f"time: {spec.complexity.time}   memory: {spec.complexity.memory}")
    caps = spec.capabilities
    console.print("capabilities: " + ", ".join(f"{flag}={getattr(caps, flag)}" for flag in _FLAGS))
    if caps.backends:
        console.print("backends: " + ", ".join(caps.backends))
    table = Table(title="config (attnzoo.build keys)")
    for column in ("key", "type", "default"):
        table.add_column(column)
    for key, (kind, default) in config_fields(name).items():
        table.add_row(key, kind, repr(default))
    console.print(table)
    for note in spec.notes:
        console.print(f"note: {note}")


def cmd_demo(console: Console) -> None:
    """A small check a user can read: the fast path equals the reference, and a language model
    decodes token by token to the same logits as its full forward."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 512, 64).unbind(0)  # (B, H, N, D) each
    pad = torch.ones(2, 512, dtype=torch.bool)
    pad[1, 400:] = False
    attn = attnzoo.build("softmax")
    for causal in (False, True):
        start = time.perf_counter()
        fast = attn(q, k, v, causal=causal, key_padding_mask=pad)
        t_fast = time.perf_counter() - start
        start = time.perf_counter()
        ref = reference_attention(q, k, v, causal=causal, key_padding_mask=pad)
        t_ref = time.perf_counter() - start
        console.print(
            f"softmax causal={causal}: SDPA fast path vs dense reference, max |diff| = "
            f"{(fast - ref).abs().max():.2e}; one call each: {t_fast * 1e3:.1f} ms vs {t_ref * 1e3:.1f} ms"
        )
    lm = attnzoo.nn.CausalLM(vocab_size=100, dim=64, depth=2, heads=4, positional="rope").eval()
    tokens = torch.randint(0, 100, (2, 32))
    with torch.no_grad():
        full = lm(tokens)
        state, steps = lm.init_state(2), []
        for i in range(tokens.shape[1]):
            logits, state = lm.step(tokens[:, i : i + 1], state)
            steps.append(logits)
    diff = (torch.cat(steps, dim=1) - full).abs().max()
    console.print(f"CausalLM (softmax + RoPE, KV cache): 32 decode steps vs full forward, max |diff| = {diff:.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnzoo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list every registered mechanism with its capabilities")
    describe = sub.add_parser("describe", help="show one mechanism: paper, complexity, capabilities, config")
    describe.add_argument("name")
    sub.add_parser("demo", help="run a small demonstration")
    args = parser.parse_args(argv)
    # Piped output (CI logs, files) gets a wide console instead of rich's 80-column default.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        if args.command == "list":
            cmd_list(console)
        elif args.command == "describe":
            cmd_describe(console, args.name)
        else:
            cmd_demo(console)
    except ValueError as error:
        console.print(f"[red]error:[/red] {error}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
