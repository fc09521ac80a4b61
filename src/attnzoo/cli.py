"""The ``attnzoo`` command: ``list``, ``describe NAME``, ``demo``, ``show``, ``report``, and
``bench speed|decode|train|profile|fidelity|suite``."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import attnzoo
from attnzoo.backends.reference import reference_attention
from attnzoo.mechanisms.base import Attention
from attnzoo.registry import config_fields

_FLAGS = ("causal", "key_mask", "decode_step", "cross_attention", "score_mod", "gqa", "scale", "dropout", "attn_mask")


def cmd_list(console: Console, decode: bool = False) -> None:
    if decode:
        return cmd_list_decode(console)
    table = Table(title=f"attnzoo {attnzoo.__version__}: registered mechanisms")
    for column in ("name", "family", "kind", "time", "memory", "supports"):
        table.add_column(column, no_wrap=column in ("name", "supports"))
    for name in attnzoo.names():
        spec = attnzoo.describe(name)
        caps = spec.capabilities
        flags = [flag for flag in _FLAGS if getattr(caps, flag)]
        if not caps.bidirectional:
            flags = ["causal only" if flag == "causal" else flag for flag in flags]
        supports = ", ".join(flags) or "-"
        table.add_row(name, spec.family, caps.kind, spec.complexity.time, spec.complexity.memory, supports)
    console.print(table)


def cmd_list_decode(console: Console) -> None:
    """Every causal mechanism: whether it decodes step by step, with what state and cost, or why not."""
    table = Table(title="decoding (init_state / step): every causal mechanism")
    for column in ("name", "decode step", "state and cost per token, or why not"):
        table.add_column(column, no_wrap=column == "name")
    for name in attnzoo.names(causal=True):
        spec = attnzoo.describe(name)
        if spec.capabilities.kind != "attention":
            continue  # token mixers decode with forward over the whole sequence
        note = spec.decoding or "-"
        table.add_row(name, "yes" if spec.capabilities.decode_step else "no", note.split(": ", 1)[-1])
    console.print(table)


def cmd_describe(console: Console, name: str) -> None:
    spec = attnzoo.describe(name)
    console.print(f"[bold]{spec.name}[/bold] ({spec.family}): {spec.summary}")
    console.print(f"paper: {spec.paper}")
    console.print(f"time: {spec.complexity.time}   memory: {spec.complexity.memory}")
    caps = spec.capabilities
    flags = (*_FLAGS, "bidirectional", "weights_apply_to_v", "independent_queries")
    console.print("capabilities: " + ", ".join(f"{flag}={getattr(caps, flag)}" for flag in flags))
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
        fast = attn(q, k, v, causal=causal, key_mask=pad)
        t_fast = time.perf_counter() - start
        start = time.perf_counter()
        ref = reference_attention(q, k, v, causal=causal, key_mask=pad)
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


def cmd_show(console: Console, args: argparse.Namespace) -> None:
    from attnzoo import viz
    from attnzoo.bench.speed import parse_mechanism

    if args.all:
        paths = viz.gallery(args.out or "gallery", n=args.n, block=args.grid or 8)
        console.print(f"wrote {len(paths) - 1} pictures and {paths[-1]}")
        return
    if not args.name:
        raise ValueError("name a mechanism to draw (attnzoo list), or pass --all for the gallery")
    name, config = parse_mechanism(args.name, args.set)
    config = {**attnzoo.describe(name).config.length_values(args.n), **config}  # sized to the picture
    out = Path(args.out or f"{name}.png")
    module = attnzoo.build(name, **config)
    if getattr(module, "pattern", None) is not None:
        viz.draw_pattern(
            module.pattern.resolve_heads(2 * getattr(module.pattern, "n_groups", 1)),
            args.n,
            out,
            block=args.grid,
            causal=args.causal,
        )
    elif isinstance(module, Attention):
        # Content-based mechanisms: what a real forward pass on random inputs attended to.
        torch.manual_seed(0)
        q, k = torch.randn(2, 1, 4, args.n, 64).unbind(0)  # (B, H, N, D); D=64 matches config defaults
        weights = module.implied_attention(q, k, causal=args.causal)
        viz.draw_weights(weights, out, title=f"{name}: implied attention (random q, k; N={args.n})")
    else:
        raise ValueError(f"{name!r} has neither a pattern nor implied_attention to draw")
    console.print(f"wrote {out}")


CAUSAL_MODES = {"no": (False,), "yes": (True,), "both": (False, True)}


def cmd_bench_speed(console: Console, args: argparse.Namespace) -> None:
    from attnzoo.bench import speed

    mechanisms = tuple(speed.parse_mechanism(m) for m in args.mechanism) or tuple(
        (name, {}) for name in attnzoo.names()
    )
    setting = speed.Setting(
        mechanisms=mechanisms,
        backends=tuple(args.backend.split(",")),
        sizes=tuple(int(n) for n in args.n.split(",")),
        batch=args.batch,
        heads=args.heads,
        dim=args.dim,
        causal_modes=CAUSAL_MODES[args.causal],
        repeats=args.repeats,
        backward=not args.no_backward,
        sdpa_max_n=args.sdpa_max_n,
        device=args.device,
        input_scale=args.input_scale,
        extra={"command": "attnzoo " + " ".join(sys.argv[1:] if args.argv is None else args.argv)},
    )
    table = Table(title="attnzoo bench speed (ratios are against dense SDPA in the same run)")
    for column in (
        "mechanism",
        "backend",
        "N",
        "causal",
        "fwd ms",
        "fwd+bwd ms",
        "x SDPA fwd",
        "x SDPA f+b",
        "f+b spread",
        "bound",
        "peak MiB",
        "GFLOP/s",
        "note",
    ):
        table.add_column(column)

    def echo(row: dict) -> None:
        if row["kind"] == "meta":
            flags = " ".join(row.get("cpu_flags", []))
            console.print(
                f"{row['processor']}{f' [{flags}]' if flags else ''}, {row['cpus']} cpus, torch {row['torch']}, "
                f"2048^2 matmul {row['matmul_2048_gflops']:.0f} GFLOP/s"
            )
            return
        if row["kind"] == "fit":
            fits.append(row)
            return
        name = "SDPA (dense)" if row["kind"] == "sdpa" else _label(row)
        spread = row.get("speedup_forward_backward_spread")
        table.add_row(
            name,
            row.get("backend_ran", row.get("backend", "-")),
            str(row["n"]),
            "yes" if row.get("causal") else "no",
            _ms(row.get("forward_s")),
            _ms(row.get("forward_backward_s")),
            _x(row.get("speedup_forward_vs_sdpa")),
            _x(row.get("speedup_forward_backward_vs_sdpa")),
            f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-",
            _x(row.get("density_bound")),
            _mib(row.get("peak_forward_bytes")),
            _num(row.get("useful_gflops")),
            row.get("error", {True: "", False: "FAILED check", None: "unchecked"}[row.get("correct", True)]),
        )

    fits: list[dict] = []
    speed.write_lines(speed.run(setting), Path(args.out) if args.out else None, echo)
    console.print(table)
    for fit in fits:
        console.print(
            f"{_label(fit)} ({fit['backend']}, {'causal' if fit['causal'] else 'non-causal'}) over "
            f"N={fit['sizes']}: time ~ N^{_num2(fit['time_exponent'])}, peak memory ~ "
            f"N^{_num2(fit['memory_exponent'])}, beats SDPA from N={fit['crossover_n'] or 'never'}"
        )
    if args.out:
        console.print(f"results: {args.out}")


def cmd_bench_decode(console: Console, args: argparse.Namespace) -> None:
    from attnzoo.bench import decode, speed

    mechanisms = tuple(speed.parse_mechanism(m) for m in args.mechanism) or decode.default_mechanisms()
    command = "attnzoo " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    rows = decode.run(mechanisms, tuple(int(p) for p in args.positions.split(",")), command, args.heads, args.dim)
    table = Table(title="attnzoo bench decode: one token per step (B=1)")
    for column in ("mechanism", "position", "ms / step", "steps / s", "state MiB", "note"):
        table.add_column(column)

    def echo(row: dict) -> None:
        if row["kind"] == "decode":
            size = row.get("state_bytes")
            table.add_row(
                row["mechanism"],
                str(row.get("position", "-")),
                _ms(row.get("step_s")),
                _num(row.get("steps_per_s")),
                "-" if size is None else f"{size / 2**20:.2f}",
                row.get("error", ""),
            )

    speed.write_lines(rows, Path(args.out) if args.out else None, echo)
    console.print(table)


def _mechanism_option(parser: argparse.ArgumentParser, default: str) -> None:
    help = f"repeatable; default: {default} with its defaults"
    parser.add_argument("--mechanism", action="append", default=[], metavar="NAME[:key=value,...]", help=help)


def _label(row: dict) -> str:
    """A row's mechanism as it was asked for: ``name`` or ``name:key=value,...`` (two configs of
    one mechanism in one run stay apart)."""
    config = row.get("config") or {}
    return row["mechanism"] + (":" + ",".join(f"{k}={v}" for k, v in config.items()) if config else "")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x"


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.0f}"


def _num2(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


# Commands whose module brings its own arguments: (command, bench subcommand) -> (module, help).
_MODULE_COMMANDS = {
    ("bench", "train"): (
        "attnzoo.bench.train_cli",
        "train a small model on a generated task (resumable, torchrun-ready)",
    ),
    ("bench", "profile"): ("attnzoo.bench.profile", "share of a transformer block's time spent in attention vs FFN"),
    ("bench", "fidelity"): ("attnzoo.bench.fidelity", "swap mechanisms into a pretrained encoder (needs attnzoo[hf])"),
    ("bench", "suite"): ("attnzoo.bench.suite", "the main job: sweep every mechanism, train, and write the report"),
    ("report", None): ("attnzoo.bench.report", "write the HTML report (tables, charts, gallery) from result files"),
}


def _add_module_commands(sub: Any, bench: Any) -> dict[tuple[str, str | None], Any]:
    modules = {}
    for (command, bench_command), (module_name, help_text) in _MODULE_COMMANDS.items():
        module = importlib.import_module(module_name)
        parser = (
            bench.add_parser(bench_command, help=help_text)
            if bench_command
            else sub.add_parser(command, help=help_text)
        )
        module.add_arguments(parser)
        modules[command, bench_command] = module
    return modules


def _exit_code(result: Any) -> int:
    """A module's ``main`` returns an exit code, or its rows / failures: a non-empty list of
    strings (e.g. images the report could not draw) is a failure, anything else success."""
    if isinstance(result, int):
        return result
    return 1 if isinstance(result, list) and result and all(isinstance(x, str) for x in result) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnzoo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="list every registered mechanism with its capabilities")
    listing.add_argument("--decode", action="store_true", help="how each causal mechanism decodes, or why it cannot")
    describe = sub.add_parser("describe", help="show one mechanism: paper, complexity, capabilities, config")
    describe.add_argument("name")
    sub.add_parser("demo", help="run a small demonstration")
    show = sub.add_parser("show", help="draw a mechanism's attention pattern (or --all for a gallery)")
    show.add_argument("name", nargs="?", help="a registered mechanism")
    show.add_argument("--n", type=int, default=64, help="sequence length drawn (default 64)")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config values (repeatable)")
    show.add_argument("--grid", type=int, help="overlay the backend's tile grid of this tile size (a config's tile=)")
    show.add_argument("--causal", action="store_true")
    show.add_argument("--all", action="store_true", help="write a gallery of every sparse mechanism and index.html")
    show.add_argument("--out", help="output PNG (or folder with --all)")
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    sp = bench.add_parser("speed", help="time and memory of mechanisms vs dense SDPA in the same run")
    _mechanism_option(sp, "every registered attention mechanism")
    sp.add_argument("--backend", default="auto", help="comma-separated: auto,blocked,flex,reference")
    sp.add_argument("--n", default="1024,4096,16384", help="comma-separated sequence lengths")
    sp.add_argument("--batch", type=int, default=1)
    sp.add_argument("--heads", type=int, default=8)
    sp.add_argument("--dim", type=int, default=64)
    sp.add_argument(
        "--causal",
        nargs="?",
        const="yes",
        default="no",
        choices=tuple(CAUSAL_MODES),
        help="causal attention (vs SDPA's causal kernel); 'both' runs every size both ways",
    )
    sp.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="interleaved (SDPA, mechanism) pairs per figure, after two warm-ups each; ratios are medians",
    )
    sp.add_argument("--no-backward", action="store_true", help="time the forward only")
    sp.add_argument("--sdpa-max-n", type=int, default=16384, help="skip the dense SDPA reference above this N")
    sp.add_argument("--device", default="cpu", help="cpu (default) or cuda: where inputs and modules live")
    sp.add_argument(
        "--input-scale",
        type=float,
        default=1.0,
        help="q and k are unit-variance Gaussians times this, for SDPA and the mechanism alike (default 1); "
        "a trained model's are often several times larger, and peaky scores slow some kernels",
    )
    sp.add_argument("--out", help="write JSON lines here")
    dp = bench.add_parser("decode", help="time of one decoding step and the state's size at given positions")
    _mechanism_option(dp, "every causal attention mechanism")
    dp.add_argument("--positions", default="1024,4096,16384", help="comma-separated positions (tokens already seen)")
    dp.add_argument("--heads", type=int, default=8)
    dp.add_argument("--dim", type=int, default=64)
    dp.add_argument("--out", help="write JSON lines here")
    modules = _add_module_commands(sub, bench)
    args = parser.parse_args(argv)
    args.argv = argv
    # Piped output (CI logs, files) gets a wide console instead of rich's 80-column default.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        if args.command == "list":
            cmd_list(console, decode=args.decode)
        elif args.command == "describe":
            cmd_describe(console, args.name)
        elif args.command == "show":
            cmd_show(console, args)
        elif (args.command, getattr(args, "bench", None)) in modules:
            return _exit_code(modules[args.command, getattr(args, "bench", None)].main(args, console))
        elif args.command == "bench" and args.bench == "decode":
            cmd_bench_decode(console, args)
        elif args.command == "bench":
            cmd_bench_speed(console, args)
        else:
            cmd_demo(console)
    except ValueError as error:
        # One line, as argparse's own errors: no wrapping, and brackets in it are not markup.
        console.print(f"[red]error:[/red] {escape(' '.join(str(error).split()))}", soft_wrap=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
