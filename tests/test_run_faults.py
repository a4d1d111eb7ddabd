"""Faults that used to lose a user's work or surface only after launch (issue #24):
corrupt checkpoints counted toward train.ckpt_keep, a failed resume rewriting the run's
config, a full disk or an unwritable directory during a save, bad run directories, and
errors that each rank printed after torchrun had started. Faults are injected for real:
truncated and bit-flipped files, a size-limited tmpfs, an immutable directory, /proc."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epscale.cli import main as cli_main
from epscale.training import checkpoint as ckpt
from epscale.training.loop import train
from test_train import REPO, read_metrics, tiny_cfg, tiny_overrides

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _short(tmp_path, **extra):
    over = {"train.eval_every": 0}
    over.update(extra)
    return tiny_cfg(tmp_path, **over)


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {r.stderr.strip()}")


def _truncate(path: Path) -> None:
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _flip_a_bit(path: Path) -> None:
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


# ------------------------------------------------------------------ finding 1 (and 9)

@pytest.mark.parametrize("damage", [_truncate, _flip_a_bit])
def test_a_corrupt_checkpoint_never_counts_toward_ckpt_keep(tmp_path, damage):
    """Step 10 damaged; resuming with ckpt_keep=2 (saving at the end, step 12) must keep
    steps 5 and 12, the only sound ones, and set step 10 aside, not delete step 5 and
    keep the corrupt one."""
    run = tmp_path / "run"
    train(_short(tmp_path, **{"train.steps": 10, "train.ckpt_every": 5, "train.ckpt_keep": 3}), run)
    damage(ckpt.step_dir(run, 10))
    res = train(_short(tmp_path, **{"train.steps": 12, "train.ckpt_every": 0,
                                    "train.ckpt_keep": 2}), run)
    assert res.step == 12
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [5, 12]
    for _, path in ckpt.list_checkpoints(run):
        ckpt.validate(path)
    (aside,) = ckpt.corrupt_root(run).iterdir()
    assert aside.name == "step_00000010" and "corrupt" in (aside / "REASON.txt").read_text()
    _, events = read_metrics(run)
    assert [e["path"] for e in events if e["event"] == "resume"] == [str(ckpt.step_dir(run, 5))]
    log = (run / "logs" / "rank0.log").read_text()
    assert "moved it to" in log and "step_00000010" in log


def test_prune_sets_aside_a_checkpoint_damaged_during_the_run(tmp_path):
    run = tmp_path / "run"
    train(_short(tmp_path, **{"train.steps": 4, "train.ckpt_every": 2, "train.ckpt_keep": 5}), run)
    _truncate(ckpt.step_dir(run, 4))
    kept = ckpt.prune(run, keep=1, report=lambda msg: None)
    assert kept == [ckpt.step_dir(run, 2)]
    assert (ckpt.corrupt_root(run) / "step_00000004").is_dir()


def test_every_checkpoint_corrupt_is_loud_and_keeps_them(tmp_path, capsys):
    run = tmp_path / "run"
    train(_short(tmp_path, **{"train.steps": 4, "train.ckpt_every": 2}), run)
    for _, path in ckpt.list_checkpoints(run):
        _flip_a_bit(path)
    capsys.readouterr()
    res = train(_short(tmp_path, **{"train.steps": 2, "train.ckpt_every": 0}), run)
    out = capsys.readouterr().out
    assert "all 2 checkpoint(s)" in out and "STARTING FROM STEP 0" in out
    assert res.records[0]["step"] == 1
    assert sorted(p.name for p in ckpt.corrupt_root(run).iterdir()) == [
        "step_00000002", "step_00000004"]


# ------------------------------------------------------------------ finding 2

def test_a_failed_resume_leaves_the_run_directory_as_it_was(tmp_path, capsys):
    run = tmp_path / "run"
    train(_short(tmp_path, **{"train.steps": 2, "train.ckpt_every": 2}), run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    over = tiny_overrides(tmp_path, **{"train.eval_every": 0, "train.steps": 4})
    rc = cli_main(["train", "--run-dir", str(run), *over, "model.dim=128", "moe.dim=128"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit this model" in err and err.count("error:") == 1
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before  # config.yaml not rewritten, nothing added
    # and the plain resume still works
    assert train(_short(tmp_path, **{"train.steps": 3, "train.ckpt_every": 0}), run).step == 3


# ------------------------------------------------------------------ finding 6

@pytest.mark.skipif(not IS_ROOT, reason="mounting a size-limited tmpfs needs root")
def test_a_full_disk_during_a_save_keeps_training_and_the_last_checkpoint(tmp_path):
    """A 4 MB checkpoints/ holds one checkpoint (about 3 MB) of this model: the save of
    step 2 runs out of space. Its partial directory goes, a line names the path and the
    cause, a checkpoint_failed event is written, training goes on; the second failure in
    a row (train.ckpt_fail_limit=2) stops the run with the step-1 checkpoint intact."""
    run = tmp_path / "run"
    mnt = run / "checkpoints"
    _mount_tmpfs(mnt, "4m")
    try:
        with pytest.raises(ckpt.CheckpointSaveError, match="2 checkpoint saves failed in a row"):
            train(_short(tmp_path, **{"train.steps": 6, "train.ckpt_every": 1,
                                      "train.ckpt_fail_limit": 2}), run)
        assert [s for s, _ in ckpt.list_checkpoints(run)] == [1]
        ckpt.validate(ckpt.step_dir(run, 1))
        assert not list(mnt.glob(".tmp_*"))  # the disk is not left full of partial saves
        steps, events = read_metrics(run)
        assert [r["step"] for r in steps] == [1, 2, 3]
        failed = [e for e in events if e["event"] == "checkpoint_failed"]
        assert [e["step"] for e in failed] == [2, 3]
        assert "No space left on device" in failed[0]["error"]
        assert "step_00000002" in failed[0]["error"]
        log = (run / "logs" / "rank0.log").read_text()
        assert "could not be saved: No space left on device" in log and "training goes on" in log
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.skipif(not IS_ROOT or shutil.which("chattr") is None,
                    reason="an immutable directory needs root and chattr")
def test_an_unwritable_checkpoint_directory(tmp_path, capsys):
    """Immutable checkpoints/: refused before the run starts (exit 2, one message); and
    when it becomes immutable during the run, the save fails with its cause and the run
    goes on."""
    run = tmp_path / "run"
    train(_short(tmp_path, **{"train.steps": 1, "train.ckpt_every": 1}), run)
    mnt = run / "checkpoints"
    if subprocess.run(["chattr", "+i", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported on this file system")
    try:
        over = tiny_overrides(tmp_path, **{"train.eval_every": 0, "train.steps": 3})
        assert cli_main(["train", "--run-dir", str(run), *over]) == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and "cannot be written" in err and str(mnt) in err
        res = train(_short(tmp_path, **{"train.steps": 2, "train.ckpt_every": 1}), run,
                    checked=True)  # as if it became unwritable after the checks
        assert res.step == 2
        _, events = read_metrics(run)
        failed = [e for e in events if e["event"] == "checkpoint_failed"]
        assert failed and "Operation not permitted" in failed[-1]["error"]
    finally:
        subprocess.run(["chattr", "-i", str(mnt)], check=False)


@pytest.mark.parametrize("where", ["proc", "file", "under-file"])
def test_bad_run_directories_are_one_clear_error(tmp_path, capsys, where):
    target = {"proc": Path("/proc/epscale-run"), "file": tmp_path / "a-file",
              "under-file": tmp_path / "a-file" / "run"}[where]
    (tmp_path / "a-file").write_text("not a directory")
    over = tiny_overrides(tmp_path, **{"train.eval_every": 0, "train.steps": 1})
    assert cli_main(["train", "--run-dir", str(target), *over]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--run-dir" in err
    assert (tmp_path / "a-file").read_text() == "not a directory"


# ------------------------------------------------------------------ finding 8

def _bin(path: Path, ids, dtype=np.uint16) -> Path:
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


@pytest.mark.parametrize("case", ["dispatcher", "empty-folder", "id-beyond-vocab", "odd-bin",
                                  "too-little-data"])
def test_errors_found_before_launch_print_once_and_exit_2(tmp_path, capsys, case):
    """What used to surface inside every rank after torchrun started is found before it
    starts: one message, exit status 2, no run directory created."""
    empty = tmp_path / "empty"
    empty.mkdir()
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    extra = {
        "dispatcher": ["parallel.ep=2", "parallel.dispatcher=nope"],
        "empty-folder": [f"data.source={empty}"],
        "id-beyond-vocab": [f"data.source={_bin(tmp_path / 'big.bin', [1, 2, 300] * 400)}"],
        "odd-bin": [f"data.source={odd}"],
        "too-little-data": [f"data.source={_bin(tmp_path / 'small.bin', [1, 2, 3] * 20)}"],
    }[case]
    want = {"dispatcher": "parallel key 'dispatcher' = 'nope'", "empty-folder": str(empty),
            "id-beyond-vocab": "300", "odd-bin": str(odd), "too-little-data": "model.seq_len"}[case]
    run = tmp_path / "run"
    over = tiny_overrides(tmp_path, **{"train.eval_every": 0, "train.steps": 1})
    rc = cli_main(["train", "--nproc", "2", "--run-dir", str(run), *over, *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("error:") == 1 and want in err, err
    assert not run.exists()


def test_under_an_outside_launcher_rank_0_checks_and_reports_once(tmp_path):
    """Started by torchrun directly (as srun torchrun does), the trainer checks on rank 0
    before any write: one message from rank 0, every rank exits 2, no run directory."""
    run = tmp_path / "run"
    over = tiny_overrides(tmp_path, **{"train.eval_every": 0, "train.steps": 1,
                                       "parallel.ep": 2, "train.preflight": "false"})
    missing = tmp_path / "nope.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=0", "-m", "epscale", "train", "--run-dir", str(run), *over,
           f"data.source={missing}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("EPSCALE_PRELAUNCH_CHECKED", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count(f"data.source '{missing}' does not exist") == 1, out[-3000:]
    assert "exitcode  : 2" in out or "exit code: 2" in out.lower() or "exitcode: 2" in out, out[-3000:]
    assert not run.exists()
