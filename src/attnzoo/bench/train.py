"""``attnzoo bench train``: train a small model over any registered mechanism on a generated task.

AdamW with linear warm-up and cosine decay, gradient clipping, evaluation on the validation
split every ``eval_every`` steps with early stopping, test accuracy of the best validation
weights, and one JSON results line per run. Checkpoints (safetensors) are written every
``checkpoint_every`` steps, at every evaluation and when the run is interrupted (SIGINT,
SIGTERM), so running the same command again resumes where it stopped.

The batch of step ``s`` is a pure function of (seed, s), and the RNG state is checkpointed, so a
resumed run ends with the same weights as an uninterrupted one. Under ``torchrun`` each process
takes its share of every global batch and DistributedDataParallel averages the gradients
(gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo.bench import checkpoint
from attnzoo.bench.distributed import Distributed
from attnzoo.bench.models import build_model, resolve_positional
from attnzoo.bench.monitor import PeakMemory, Reporter
from attnzoo.bench.tasks import Split, TaskInfo, load_task
from attnzoo.mechanisms.auxiliary import auxiliary_loss
from attnzoo.registry import EXACT

# Budgets per task and size: what `attnzoo bench train --task T` uses unless told otherwise.
PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    ("listops", "quick"): dict(steps=600, batch_size=32, lr=2e-3, warmup=50, eval_every=100),
    ("listops", "full"): dict(
        steps=5000,
        batch_size=32,
        lr=5e-4,
        warmup=1000,
        eval_every=500,
        dim=512,
        depth=4,
        heads=8,
        ff_mult=2,
        patience=10,
    ),
    ("mqar", "quick"): dict(steps=600, batch_size=32, lr=3e-3, warmup=50, eval_every=100),
    # From scratch, MQAR at length 256 sits on its plateau for 1000+ steps on a CPU; the committed
    # result starts from the quick run's weights (--init-from; see benchmarks/README.md).
    ("mqar", "standard"): dict(
        steps=1500, batch_size=64, lr=3e-3, warmup=100, eval_every=250, patience=4, stop_at=0.99
    ),
    ("mqar", "full"): dict(steps=20000, batch_size=64, lr=1e-3, warmup=1000, eval_every=1000, dim=128, patience=10),
    ("pathfinder", "quick"): dict(steps=600, batch_size=32, lr=2e-3, warmup=50, eval_every=100),
    ("pathfinder", "full"): dict(
        steps=62500, batch_size=512, lr=1e-3, warmup=8000, eval_every=2500, dim=128, depth=4, heads=8, patience=10
    ),
    ("text", "quick"): dict(steps=600, batch_size=16, lr=1e-3, warmup=50, eval_every=100),
    ("text", "full"): dict(
        steps=20000, batch_size=32, lr=5e-4, warmup=8000, eval_every=1000, dim=256, depth=4, heads=4, patience=10
    ),
}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that determines a run's result (and must match when it resumes)."""

    task: str
    mechanism: str = EXACT
    config: dict[str, Any] = field(default_factory=dict)  # the mechanism's config
    size: str = "quick"
    task_overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    dim: int = 64
    depth: int = 2
    heads: int = 4
    ff_mult: int = 2
    dropout: float = 0.0
    positional: str | None = "auto"  # see attnzoo.bench.models.resolve_positional
    batch_size: int = 32
    steps: int = 600
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 50
    clip: float = 1.0
    eval_every: int = 100
    patience: int = 5  # evaluations without a better validation accuracy before stopping
    stop_at: float | None = None  # stop once validation accuracy reaches this
    # Stop after this many seconds of training steps (evaluation excluded). Makes the number of
    # steps depend on the machine, so a resumed run may differ from an uninterrupted one.
    max_seconds: float | None = None
    # Start from these weights (a best.safetensors or last.safetensors of a run with the same
    # model), e.g. a curriculum: a model trained on a short task size continues on a longer one.
    init_from: str | None = None
    # Size the mechanism's config to the task's length (attnzoo.bench.configs.sized; `config` wins).
    sized: bool = False
    # Classification tasks: a causal encoder that classifies the last real token
    # (attnzoo.bench.models.SequenceClassifier); how causally defined mechanisms run them.
    causal_encoder: bool = False
    checkpoint_every: int = 50

    def __post_init__(self) -> None:
        for name in (
            "dim",
            "depth",
            "heads",
            "ff_mult",
            "batch_size",
            "steps",
            "eval_every",
            "checkpoint_every",
            "patience",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("lr", "clip", "weight_decay", "dropout", "max_seconds", "stop_at"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not (self.lr > 0 and self.clip > 0):
            raise ValueError(f"lr and clip must be > 0, got lr={self.lr!r}, clip={self.clip!r}")
        if not (isinstance(self.warmup, int) and self.warmup >= 0 and 0 <= self.dropout < 1):
            raise ValueError(
                f"warmup must be an int >= 0 and dropout in [0, 1), got warmup={self.warmup!r}, "
                f"dropout={self.dropout!r}"
            )
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0 (or None for no time budget), got {self.max_seconds!r}")
        if self.stop_at is not None and not 0 < self.stop_at <= 1:
            raise ValueError(f"stop_at is a validation accuracy in (0, 1], got {self.stop_at!r}")

    @classmethod
    def with_preset(cls, task: str, size: str = "quick", **values: Any) -> TrainConfig:
        """The preset budget for (task, size), then ``values`` (None values are ignored)."""
        chosen = {**PRESETS.get((task, size), {}), **{k: v for k, v in values.items() if v is not None}}
        return cls(task=task, size=size, **chosen)


def effective_config(cfg: TrainConfig, info: TaskInfo) -> dict[str, Any]:
    """The mechanism config a run uses: ``cfg.config`` over the sized one when ``cfg.sized``."""
    if not cfg.sized:
        return dict(cfg.config)
    from attnzoo.bench.configs import sized

    return {**sized(cfg.mechanism, info.seq_len), **cfg.config}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to zero at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def batch_indices(n_examples: int, step: int, cfg: TrainConfig) -> Tensor:
    """The global batch of ``step``: epoch ``e`` walks a permutation seeded by (seed, e)."""
    per_epoch = max(1, n_examples // cfg.batch_size)
    epoch, position = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
    order = torch.randperm(n_examples, generator=generator)
    return order[position * cfg.batch_size : (position + 1) * cfg.batch_size]


def loss_and_counts(
    model: nn.Module, info: TaskInfo, split: Split, rows: Tensor, device: Any
) -> tuple[Tensor, int, int]:
    """Mean cross-entropy over the scored targets of ``rows``, and (correct, scored) counts."""
    tokens, mask, labels = (t[rows].to(device) for t in (split.tokens, split.mask, split.labels))
    logits = model(tokens, mask)
    if info.kind == "lm":
        logits, labels = logits.flatten(0, 1), labels.flatten()
    loss = F.cross_entropy(logits.float(), labels, ignore_index=-100)
    scored = labels != -100
    correct = int((logits.argmax(-1) == labels)[scored].sum())
    return loss, correct, int(scored.sum())


@torch.no_grad()
def evaluate(model: nn.Module, info: TaskInfo, split: Split, cfg: TrainConfig, dist: Distributed) -> float:
    """Accuracy on ``split``; under torchrun each process scores its share and the counts are summed."""
    model.eval()
    rows = torch.arange(split.tokens.shape[0])[dist.rank :: dist.world]
    correct = total = 0
    for chunk in rows.split(cfg.batch_size):
        _, c, t = loss_and_counts(model, info, split, chunk, dist.device)
        correct, total = correct + c, total + t
    model.train()
    correct, total = dist.sum(correct), dist.sum(total)
    return correct / max(total, 1)


def weight_digest(model: nn.Module) -> str:
    """sha256 of every parameter's bytes: equal digests mean bit-identical weights."""
    digest = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        digest.update(name.encode())
        # reshape(-1): a 0-dim tensor (a seed, a counter) cannot be viewed as bytes
        digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


class _Interrupt:
    """SIGINT/SIGTERM set a flag; the loop checkpoints at the next step boundary and stops."""

    def __init__(self) -> None:
        self.raised = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Interrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave the signals alone
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.raised = True

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _fresh_state() -> dict[str, Any]:
    return {
        "step": 0,
        "best_val": -1.0,
        "best_step": 0,
        "bad_evals": 0,
        "train_s": 0.0,
        "wall_s": 0.0,
        "finished": False,
        "history": [],
        "losses": [],
        "loss_sum": 0.0,
        "loss_count": 0,
    }


def _resume(run_dir: Path, cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    last = run_dir / "last.safetensors"
    if not last.exists():
        return _fresh_state()
    stored = checkpoint.read_meta(last)["config"]
    wanted = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))  # as the checkpoint stores it
    if stored != wanted:
        changed = sorted(k for k in wanted if stored.get(k) != wanted[k])
        raise ValueError(
            f"{run_dir} holds a run with a different config (differs in: {', '.join(changed)}); "
            f"pass another --run-dir, or delete it to start over"
        )
    return checkpoint.load(last, model, optimizer)["state"]


def _optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # Weight decay on matrices only: decaying biases, norms' gains and 1-D tables hurts small models.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}], lr=cfg.lr
    )


def _load(cfg: TrainConfig, data_dir: str | None, dist: Distributed) -> tuple[TaskInfo, dict[str, Split]]:
    # The main process generates and caches the data first, so the others read the cache.
    if not dist.main:
        dist.barrier()
    loaded = load_task(cfg.task, size=cfg.size, data_dir=data_dir, seed=cfg.seed, **cfg.task_overrides)
    if dist.main:
        dist.barrier()
    return loaded


class TrainingDiverged(RuntimeError):
    """A run whose loss or gradient norm went non-finite (NaN or inf); ``row`` is its results row,
    marked ``status: "diverged"`` with the ``error`` and ``diverged_step``, without accuracies."""

    def __init__(self, message: str, row: dict[str, Any]) -> None:
        super().__init__(message)
        self.row = row


class _Diverged(Exception):
    def __init__(self, step: int, loss: float, norm: float) -> None:
        super().__init__(f"loss {loss} and gradient norm {norm} at step {step}")
        self.step, self.loss, self.norm = step, loss, norm


@dataclass
class _Run:
    """The live objects of one run (not persisted: ``state`` is what checkpoints carry)."""

    cfg: TrainConfig
    info: TaskInfo
    splits: dict[str, Split]
    model: nn.Module
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    dist: Distributed
    run_dir: Path
    state: dict[str, Any]

    def save(self, name: str = "last.safetensors", optimizer: bool = True) -> None:
        if self.dist.main:
            meta = {"config": dataclasses.asdict(self.cfg), "state": self.state}
            checkpoint.save(
                self.run_dir / name,
                self.model,
                self.optimizer if optimizer else None,
                meta,
                keep_previous=name == "last.safetensors",
            )
        self.dist.barrier()

    def train_step(self) -> float:
        step = self.state["step"]
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.cfg)
        rows = batch_indices(self.splits["train"].tokens.shape[0], step, self.cfg)[self.dist.rank :: self.dist.world]
        loss, _, _ = loss_and_counts(self.wrapped, self.info, self.splits["train"], rows, self.dist.device)
        extra = auxiliary_loss(self.model)  # e.g. dsa's indexer, which the task loss cannot train
        loss = loss if extra is None else loss + extra
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = float(nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip))
        value = float(loss.detach())
        # Stop before a non-finite loss or gradient reaches the weights. Gradients are averaged
        # across processes and losses are not: one collective so that every process stops.
        (diverged,) = self.dist.any(not (math.isfinite(value) and math.isfinite(norm)))
        if diverged:
            raise _Diverged(step + 1, value, norm)
        self.optimizer.step()
        self.state.update(
            step=step + 1, loss_sum=self.state["loss_sum"] + value, loss_count=self.state["loss_count"] + 1
        )
        return value

    def validate(self) -> bool:
        """Evaluate on val, keep the best weights; True when early stopping says stop."""
        accuracy = evaluate(self.model, self.info, self.splits["val"], self.cfg, self.dist)
        self.state["history"].append([self.state["step"], accuracy])
        # Mean training loss since the previous evaluation (this process's share of the batches).
        self.state["losses"].append([self.state["step"], self.state["loss_sum"] / max(self.state["loss_count"], 1)])
        self.state.update(loss_sum=0.0, loss_count=0)
        if accuracy > self.state["best_val"]:
            self.state.update(best_val=accuracy, best_step=self.state["step"], bad_evals=0)
            self.save("best.safetensors", optimizer=False)
        else:
            self.state["bad_evals"] += 1
        reached = self.cfg.stop_at is not None and accuracy >= self.cfg.stop_at
        return reached or self.state["bad_evals"] >= self.cfg.patience


def _loop(run: _Run, reporter: Reporter, interrupt: _Interrupt) -> bool:
    """Train until the step budget, early stop or an interruption; True when the run finished."""
    cfg, state = run.cfg, run.state
    kill_at = int(os.environ.get("ATTNZOO_TRAIN_KILL_AT_STEP", "0"))  # fault injection for the resume test
    start, started_at = state["step"], time.perf_counter()
    while state["step"] < cfg.steps:
        t0 = time.perf_counter()
        loss = run.train_step()
        state["train_s"] += time.perf_counter() - t0
        step = state["step"]
        reporter.step(step, loss, (step - start) / max(time.perf_counter() - started_at, 1e-9))
        # A time budget ends the run at the first step past it; a signal seen by any process
        # stops all of them at this step boundary (one collective per step for both).
        out_of_time, interrupted = run.dist.any(
            cfg.max_seconds is not None and state["train_s"] >= cfg.max_seconds, interrupt.raised
        )
        stop = False
        if step % cfg.eval_every == 0 or step == cfg.steps or out_of_time:
            stop = run.validate() or out_of_time
            reporter.note(f"val {state['history'][-1][1]:.3f} (best {state['best_val']:.3f} @ {state['best_step']})")
        # Early stop and the last step are recorded before saving, so a resumed run that had
        # already stopped does not train on.
        state["finished"] = stop or step == cfg.steps
        if interrupted and not state["finished"]:
            run.save()
            return False
        if state["finished"] or step % cfg.checkpoint_every == 0 or step % cfg.eval_every == 0:
            run.save()
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if stop:
            break
    state["finished"] = True
    return True


def train(
    cfg: TrainConfig,
    *,
    run_dir: str | Path,
    data_dir: str | None = None,
    device: str | None = None,
    progress: bool = True,
    console: Any = None,
) -> dict[str, Any] | None:
    """Run (or resume) one training run in ``run_dir``; returns its results row, or None when it
    was interrupted (its checkpoint is saved: call again with the same arguments to resume).
    Raises ``TrainingDiverged`` (with the failed row) at the first non-finite loss or gradient,
    before that step updates the weights."""
    dist = Distributed.from_env(device)
    run_dir = Path(run_dir)
    if dist.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    info, splits = _load(cfg, data_dir, dist)
    torch.manual_seed(cfg.seed)  # after loading: a cache hit and a fresh generation leave the same RNG
    model = build_model(
        kind=info.kind,
        vocab_size=info.vocab_size,
        n_classes=info.n_classes,
        seq_len=info.seq_len,
        dim=cfg.dim,
        depth=cfg.depth,
        heads=cfg.heads,
        mechanism=cfg.mechanism,
        config=effective_config(cfg, info),
        positional=cfg.positional,
        ff_mult=cfg.ff_mult,
        dropout=cfg.dropout,
        causal_encoder=cfg.causal_encoder,
    ).to(dist.device)
    optimizer = _optimizer(model, cfg)
    if cfg.init_from is not None:
        checkpoint.load(Path(cfg.init_from), model)  # a resumed run then overwrites it with its own
    state = _resume(run_dir, cfg, model, optimizer)
    run = _Run(cfg, info, splits, model, dist.wrap(model), optimizer, dist, run_dir, state)
    memory, wall_start = PeakMemory(dist.device), time.perf_counter()
    title = f"{cfg.mechanism} on {cfg.task}/{cfg.size}"
    try:
        with (
            Reporter(
                enabled=progress and dist.main, total=cfg.steps, start=state["step"], title=title, console=console
            ) as reporter,
            _Interrupt() as interrupt,
        ):
            finished = state["finished"] or _loop(run, reporter, interrupt)
    except _Diverged as error:
        row = {
            **_describe(run),
            "status": "diverged",
            "diverged_step": error.step,
            "error": f"diverged: {error}; lower lr (now {cfg.lr:g})",
        }
        raise TrainingDiverged(f"{title} {row['error']}", row) from None
    state["wall_s"] += time.perf_counter() - wall_start
    if not finished:
        return None
    run.save()  # with the wall time
    return _results(run, memory.peak())


def _results(run: _Run, peak: int | None) -> dict[str, Any]:
    """Test accuracy of the best validation weights, and the run's results row."""
    cfg, state, info = run.cfg, run.state, run.info
    digests = run.dist.gather(weight_digest(run.model))  # of the final weights, before loading the best
    checkpoint.load(run.run_dir / "best.safetensors", run.model)
    test = evaluate(run.model, info, run.splits["test"], cfg, run.dist)
    tokens_per_step = cfg.batch_size * info.seq_len
    steps_per_s = state["step"] / state["train_s"] if state["train_s"] else None
    return {
        **_describe(run),
        "status": "ok",
        "test_accuracy": test,
        "val_accuracy": state["best_val"],
        "best_step": state["best_step"],
        "chance": info.chance,
        "steps": state["step"],
        "steps_per_s": steps_per_s,
        "tokens_per_s": steps_per_s * tokens_per_step if steps_per_s else None,
        "peak_memory_bytes": peak,
        "wall_s": state["wall_s"],
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "weight_digests": digests,
    }


def _describe(run: _Run) -> dict[str, Any]:
    """What every results row says about its run, finished or failed: task, model, optimiser."""
    cfg, state, info = run.cfg, run.state, run.info
    return {
        "kind": "train",
        "task": cfg.task,
        "size": cfg.size,
        "mechanism": cfg.mechanism,
        "config": effective_config(cfg, info),
        "sized": cfg.sized,
        "seq_len": info.seq_len,
        "task_params": info.params,
        "model": {
            **{k: getattr(cfg, k) for k in ("dim", "depth", "heads", "ff_mult", "dropout")},
            "positional": resolve_positional(cfg.positional, info.kind, cfg.mechanism),
            **({"causal_encoder": True} if cfg.causal_encoder else {}),
        },
        "optim": {
            k: getattr(cfg, k)
            for k in (
                "batch_size",
                "steps",
                "lr",
                "weight_decay",
                "warmup",
                "clip",
                "eval_every",
                "patience",
                "stop_at",
                "max_seconds",
                "init_from",
            )
        },
        "seed": cfg.seed,
        "world_size": run.dist.world,
        "device": str(run.dist.device),
        "history": state["history"],
        "train_losses": state["losses"],
        "git": git_revision(),
    }


def git_revision() -> str:
    """``git describe``-like revision of the source tree this package runs from ("+dirty" when
    it has uncommitted changes), or "unknown" outside a checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")
