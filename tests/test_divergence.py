"""A run whose loss will not settle stops, and says what to change (issue #30, finding 3):
rollbacks to one checkpoint are bounded (train.max_rollbacks), a checkpoint written while
the loss was already abnormal is never the rollback target (nor pruned in its place), and
train.max_skipped_steps non-finite steps in a row end the run; `monitor --check` flags
both."""

from __future__ import annotations

import pytest

from epscale.cli import main as cli_main
from epscale.config import ConfigError
from epscale.monitor import evaluate, load_run
from epscale.training import checkpoint as ckpt
from epscale.training.loop import train
from test_train import _patch_loss, read_metrics, tiny_cfg, tiny_overrides


def test_rollbacks_are_bounded_and_go_back_to_a_normal_checkpoint(tmp_path, monkeypatch):
    # Steps 1-4 normal; every step from 5 on spikes (x40). Checkpoints every 2 steps:
    # step 2 (guard not warmed up: 4 losses needed) and step 6 (loss already above the
    # threshold) are no targets; step 4 is. ckpt_keep=1 must not prune it for step 6.
    _patch_loss(monkeypatch, {n: 40.0 for n in range(5, 200)})
    cfg = tiny_cfg(tmp_path, **{"train.spike_factor": 3.0, "train.spike_window": 4,
                                "train.spike_patience": 3, "train.max_rollbacks": 2,
                                "train.ckpt_every": 2, "train.ckpt_keep": 1,
                                "train.steps": 40, "train.eval_every": 0})
    run = tmp_path / "r"
    with pytest.raises(ConfigError, match=r"after 2 rollback\(s\) to the checkpoint of step 4 "
                                          r"\(train.max_rollbacks = 2\).*Lower train.lr"):
        train(cfg, run)
    _steps, events = read_metrics(run)
    rb = [e for e in events if e["event"] == "rollback"]
    assert [(e["ok"], e["to_step"]) for e in rb] == [(True, 4), (True, 4)]
    (div,) = [e for e in events if e["event"] == "diverged"]
    assert div["reason"] == "rollback_limit" and div["step"] == 7
    metas = {s: ckpt.read_meta(p) for s, p in ckpt.list_checkpoints(run)}
    assert metas[4]["guard"]["healthy"] and not metas[6]["guard"]["healthy"]
    said = [a.message for a in evaluate(load_run(run)) if a.rule == "diverged"]
    assert len(said) == 1 and "max_rollbacks" in said[0], said


def test_non_finite_steps_in_a_row_end_the_run(tmp_path, capsys):
    """A real divergence (train.lr=1e5, as reported): every update after the first is
    non-finite; the run stops after train.max_skipped_steps of them, exit 2."""
    run = tmp_path / "r"
    code = cli_main(["train", "--run-dir", str(run), *tiny_overrides(
        tmp_path, **{"train.lr": 1e5, "train.min_lr": 0, "train.warmup_steps": 0,
                     "train.max_skipped_steps": 3, "train.steps": 30, "train.ckpt_every": 0,
                     "train.eval_every": 0})])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "3 steps in a row had a non-finite loss or gradient" in err
    assert "train.max_skipped_steps = 3" in err and "Lower train.lr" in err
    steps, events = read_metrics(run)
    assert [r["skipped"] for r in steps][-3:] == [True, True, True] and len(steps) < 30
    assert [e["reason"] for e in events if e["event"] == "diverged"] == ["skipped_steps"]
    said = [a.message for a in evaluate(load_run(run)) if a.rule == "diverged"]
    assert len(said) == 1 and "max_skipped_steps" in said[0], said


def test_the_limits_are_validated():
    from epscale.config import load_config

    for key in ("train.max_rollbacks", "train.max_skipped_steps"):
        with pytest.raises(ConfigError, match=f"'{key}'.*positive integer"):
            load_config(None, [f"{key}=0"])
