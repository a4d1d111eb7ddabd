"""Checkpoints written in the background (``train.async_checkpoint``, DCP's async_save):
the step loop goes on while the shards are written, the checkpoint equals a blocking one
(a resume from it continues bit for bit), the state saved is the state at the save step
(not what training wrote into the weights while the save ran), and a process killed
mid-save leaves the previous checkpoint the latest and resumes from it. The multi-rank
case (FSDP on 4 gloo ranks) is in tests/test_fsdp.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from epscale.config import dump_yaml
from epscale.training import checkpoint as ckpt
from epscale.training.loop import train
from test_train import REPO, losses_by_step, read_metrics, tiny_cfg

ASYNC = {"train.async_checkpoint": True, "train.eval_every": 0, "train.ckpt_keep": 3}


def test_background_checkpoints_resume_bit_for_bit(tmp_path, monkeypatch):
    # slow writes: training has changed the weights by the time the shards are written,
    # so a save that did not copy the state first would hold later weights
    plain = FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        time.sleep(0.5)
        return plain(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write)
    run = tmp_path / "async"
    full = train(tiny_cfg(tmp_path, **{**ASYNC, "train.steps": 6, "train.ckpt_every": 2}), run)
    _, events = read_metrics(run)
    started = [e["step"] for e in events if e["event"] == "checkpoint_started"]
    done = {e["step"]: e["background"] for e in events if e["event"] == "checkpoint"}
    assert started == [2, 4]                            # the last step's save blocks
    assert done == {2: True, 4: True, 6: False}
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4, 6]
    for _, path in ckpt.list_checkpoints(run):
        ckpt.validate(path)
    assert not list((run / "checkpoints").glob(".tmp_*"))
    # resume from the step-2 background checkpoint: steps 3-6 as the run that went on
    again = tmp_path / "again"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt.step_dir(run, 2), ckpt.step_dir(again, 2))
    res = train(tiny_cfg(tmp_path, **{**ASYNC, "train.steps": 6, "train.ckpt_every": 0}), again)
    want = losses_by_step(full.records)
    assert losses_by_step(res.records) == {s: want[s] for s in (3, 4, 5, 6)}


KILLED_RUN = """
import os, signal, sys
from pathlib import Path
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from epscale.config import load_config
from epscale.training.loop import train

plain = FileSystemWriter.write_data
calls = []

def write_data(self, plan, planner):
    calls.append(1)
    if len(calls) == 2:   # the step-4 save, in DCP's background thread: part of it, then die
        (Path(self.path) / "__0_0.distcp").write_bytes(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)
    return plain(self, plan, planner)

FileSystemWriter.write_data = write_data
train(load_config(sys.argv[1]), sys.argv[2])
"""


def test_a_process_killed_mid_save_keeps_the_previous_checkpoint(tmp_path):
    cfg = tiny_cfg(tmp_path, **{**ASYNC, "train.steps": 6, "train.ckpt_every": 2})
    recipe = tmp_path / "recipe.yaml"
    dump_yaml(cfg, recipe)
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_RUN))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(recipe), str(run)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    # the step-4 save never finished: only its temporary directory; step 2 is intact
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]
    ckpt.validate(ckpt.step_dir(run, 2))
    assert (run / "checkpoints" / ".tmp_step_00000004").is_dir()
    assert ckpt.latest_valid(run)[0] == ckpt.step_dir(run, 2)
    # run again: from step 2, the same losses as a run that was never killed
    res = train(cfg, run)
    ref = train(cfg, tmp_path / "reference")
    want = losses_by_step(ref.records)
    assert losses_by_step(res.records) == {s: want[s] for s in (3, 4, 5, 6)}
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4, 6]
    assert not list((run / "checkpoints").glob(".tmp_*"))      # the partial one cleared


def test_staging_is_pinned_and_kept_on_cuda_only():
    """Background saves stage into pinned CPU memory kept between saves on CUDA (DCP's
    DefaultStager: pinned, staged before the save returns, non-blocking copies); on CPU
    DCP's default copy (no stager)."""
    import torch
    from torch.distributed.checkpoint.staging import StagingOptions

    assert ckpt.staging_options(torch.device("cpu")) is None
    assert ckpt.background_stager(torch.device("cpu")) is None
    assert ckpt.staging_options(torch.device("cuda", 0)) == StagingOptions(
        use_pinned_memory=True, use_shared_memory=False, use_async_staging=False,
        use_non_blocking_copy=True)


def test_a_kept_stager_saves_each_steps_own_state(tmp_path):
    """One stager for every background save (its buffers reused): each checkpoint holds
    the state of its own step, though the second save staged into the first's buffers
    and training changed the weights in between. (On CPU with the CUDA stager's options
    less what needs CUDA: pinning, non-blocking copies.)"""
    import copy

    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from test_checkpoint import DIMS, assert_same, cfg, trained

    c = cfg()
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    model, opt = trained(c, steps=1)
    snapshots, paths = [], []
    try:
        for step in (1, 2):
            snapshots.append(trained(c, steps=0, seed=9))
            snap_m, snap_o = snapshots[-1]
            snap_m.load_state_dict(model.state_dict())
            snap_o.load_state_dict(copy.deepcopy(opt.state_dict()))  # AdamW's step: no alias
            pending = ckpt.save_async(tmp_path, step, model, opt, DIMS, {}, keep=5, stager=stager)
            x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
            (model.loss(x, x) + model.aux_loss()).backward()   # training goes on
            opt.step()
            opt.zero_grad()
            paths.append(pending.wait())
        staged = stager._state_dict_stager._cached_storage_mapping
        assert len(staged) > 0   # the buffers are kept for the next save
    finally:
        stager.close()
    for path, (snap_m, snap_o) in zip(paths, snapshots):
        got_m, got_o = trained(c, steps=1, seed=5)
        ckpt.load(path, got_m, got_o, DIMS)
        assert_same(snap_m, snap_o, got_m, got_o)
