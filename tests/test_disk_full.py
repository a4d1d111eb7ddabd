"""A full disk under every writer (issue #30, finding 4): the run directory on a small
tmpfs, filled for real while `train.async_checkpoint` saves run in the background. The
metrics/events writer, the rank log and the heartbeats survive it (one line naming the
path, no partial line left, the records written once there is space again), the failed
background save leaves no partial files and writes its checkpoint_failed event, and
training goes on; `monitor` on the full disk says so instead of a traceback."""

from __future__ import annotations

import errno
import json
import subprocess

import pytest

from epscale.cli import main as cli_main
from epscale.metrics import JsonlSink
from epscale.training import checkpoint as ckpt
from epscale.training.loop import Trainer, train
from test_run_faults import IS_ROOT, _mount_tmpfs, _short


def _fill(path) -> None:
    """Write ``path`` until the file system is full (real ENOSPC)."""
    with open(path, "ab", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e


@pytest.mark.skipif(not IS_ROOT, reason="mounting a size-limited tmpfs needs root")
def test_a_full_disk_under_background_saves_and_the_metrics_writer(tmp_path, monkeypatch,
                                                                   capsys):
    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, "32m")
    run, filler = mnt / "run", mnt / "filler"
    try:
        # The disk fills after step 3 (the step-2 save still finishing in the background)
        # and gets space again after step 7: steps 4-7 and the saves of steps 4 and 6 run
        # on the full disk.
        heartbeat, write_line = Trainer._heartbeat, JsonlSink._line
        full = {"now": False}

        def heartbeat_then_fill_or_free(self):
            heartbeat(self)
            if self.step == 3:
                full["now"] = True
                _fill(filler)
            elif self.step == 7:
                full["now"] = False
                filler.unlink()

        def fill_then_write(self, record):
            # topped up right before each record while the disk should be full: a failing
            # background save deletes its partial files, which gives space back at a moment
            # that depends on the machine's load
            if full["now"]:
                _fill(filler)
            write_line(self, record)

        monkeypatch.setattr(Trainer, "_heartbeat", heartbeat_then_fill_or_free)
        monkeypatch.setattr(JsonlSink, "_line", fill_then_write)
        res = train(_short(tmp_path, **{"train.steps": 8, "train.ckpt_every": 2,
                                        "train.async_checkpoint": True,
                                        "train.ckpt_fail_limit": 5}), run)
        assert res.step == 8 and not res.stopped
        out, err = capsys.readouterr()
        assert f"cannot write {run / 'metrics.jsonl'} (No space left on device)" in err, err
        assert f"{run / 'metrics.jsonl'} is writable again" in err, err
        # every line whole, every step and the failed save's event in it
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines if "event" not in r] == list(range(1, 9))
        failed = [r for r in lines if r.get("event") == "checkpoint_failed"]
        assert failed and "No space left on device" in failed[0]["error"], failed
        assert not list((run / "checkpoints").glob(".tmp_*"))  # no partial save left
        assert ckpt.list_checkpoints(run)[-1][0] == 8
        ckpt.validate(ckpt.step_dir(run, 8))
        # `monitor` on the full disk: one line naming the report's path, exit 2, no
        # partial report
        _fill(filler)
        assert cli_main(["monitor", str(run)]) == 2
        err = capsys.readouterr().err
        assert f"cannot write {run / 'report.html'} (No space left on device)" in err, err
        assert "Traceback" not in err
        assert not [p.name for p in run.iterdir() if p.name.startswith("report")]
        assert cli_main(["monitor", str(run), "--check"]) in (0, 1)  # reads only: works
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)  # lazy: never left mounted
