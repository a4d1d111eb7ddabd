"""One trainer per run directory (issue #30, finding 1): a second `epscale train` on a
live run's --run-dir exits 2 naming the holder, and the lock of a SIGKILLed trainer is
taken over with a line saying whose it was. Two real processes on one run directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epscale.cli import main as cli_main
from epscale.training.loop import train
from epscale.config import ConfigError
from epscale.training.run_lock import LOCK_FILE
from test_train import REPO, read_metrics, tiny_cfg, tiny_overrides


def _holder(run: Path) -> dict:
    try:
        return json.loads((run / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}


@pytest.mark.timeout(180)
def test_a_second_trainer_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, capsys):
    run = tmp_path / "run"
    over = tiny_overrides(tmp_path, **{"train.steps": 3000, "train.ckpt_every": 0,
                                       "train.eval_every": 0})
    first = subprocess.Popen([sys.executable, "-m", "epscale", "train", "--run-dir", str(run),
                              *over], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        for _poll in range(1200):  # a hang guard of ~2 minutes, not a timing
            if (run / "metrics.jsonl").is_file() and read_metrics(run)[0]:
                break
            assert first.poll() is None, first.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        else:
            pytest.fail("the first trainer never trained a step")
        assert _holder(run)["pid"] == first.pid
        # The second trainer, through the CLI (another train.lr, as in the report): exit 2
        # naming the holder, before anything is written.
        lines_before = (run / "metrics.jsonl").read_text().count('"event"')
        code = cli_main(["train", "--run-dir", str(run),
                         *tiny_overrides(tmp_path, **{"train.steps": 2, "train.lr": 1e-3})])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"pid {first.pid}" in err and "in use by another trainer" in err, err
        assert "--run-dir" in err
        # The trainer's own lock (a launcher that skipped the check, e.g. srun): refused too.
        with pytest.raises(ConfigError, match=f"pid {first.pid}"):
            train(tiny_cfg(tmp_path, **{"train.steps": 2}), run, checked=True)
        assert (run / "metrics.jsonl").read_text().count('"event"') == lines_before
        assert first.poll() is None  # the first run is untouched
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    capsys.readouterr()
    # The dead trainer's lock file is left behind; the next trainer takes it over.
    assert _holder(run)["pid"] == first.pid
    res = train(tiny_cfg(tmp_path, **{"train.steps": 2, "train.ckpt_every": 0,
                                      "train.eval_every": 0}), run)
    assert res.step == 2
    out = capsys.readouterr().out
    assert f"took over the run directory lock of pid {first.pid}" in " ".join(out.split()), out
    assert _holder(run) == {}  # released at the end
