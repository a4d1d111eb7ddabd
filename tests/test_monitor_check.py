"""``epscale monitor --check`` catches a run that is over without saying so (issue #24,
finding 9) and a failing checkpoint: a run that never trained a step, a run without an 'end'
event once the job is known to be over (``--ended`` in a Slurm epilog, or heartbeats whose
processes have all exited on this host), and a latest checkpoint save that failed. Real
files, real (exited, zombie and live) processes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from epscale.cli import main as cli_main
from epscale.monitor import AlertRules, evaluate, load_run
from epscale.monitor.live import follow, render
from epscale.monitor.runlog import pid_alive
from runfactory import make_run


def check(run_dir: Path, *args: str) -> tuple[int, list[str], str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["monitor", str(run_dir), "--check", *args])
    return code, out.getvalue().splitlines(), err.getvalue()


def rules_in(lines: list[str]) -> list[str]:
    return [ln.split(":")[0].removeprefix("ALERT ") for ln in lines if ln.startswith("ALERT ")]


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def beat(run_dir: Path, rank: int, pid: int, t: float, host: str | None = None) -> None:
    (run_dir / "heartbeats").mkdir(parents=True, exist_ok=True)
    (run_dir / "heartbeats" / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "host": host or socket.gethostname(), "step": 60, "time": t, "pid": pid}))


def append(run_dir: Path, *events: dict) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        for ev in events:
            f.write(json.dumps(ev) + "\n")


# ---------------------------------------------------------------------- no step records


def test_a_run_without_step_records_is_an_alert(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text("")
    code, lines, _ = check(bare)
    assert code == 1 and rules_in(lines) == ["no_steps"], lines
    assert lines[0].startswith("ALERT no_steps: run since start: metrics.jsonl holds no step "
                               "records: the run has not trained a step"), lines
    assert f"see {bare}/logs/" in lines[0]
    # what the trainer leaves when it dies in set-up: a start event, empty heartbeats/
    run = tmp_path / "setup"
    (run / "heartbeats").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"event": "start", "step": 0,
                                                   "time": time.time()}) + "\n")
    code, lines, _ = check(run, "--ended")
    assert code == 1 and rules_in(lines) == ["crashed", "no_steps"], lines
    assert "no 'end' event before the first step and the job is over (--ended)" in lines[0]
    assert "the run is over without training a step" in lines[1]


def test_a_directory_without_metrics_points_at_the_logs(tmp_path):
    (tmp_path / "r" / "logs").mkdir(parents=True)
    code, lines, err = check(tmp_path / "r")
    assert code == 2 and "has no metrics.jsonl" in err and f"see {tmp_path / 'r'}/logs/" in err, err


# ---------------------------------------------------------------------- over without 'end'


def test_ended_flags_a_run_without_end_event_at_once(tmp_path):
    # heartbeats 5 s old: well inside the 300 s timeout, as in an epilog right after a crash
    run = make_run(tmp_path / "c", ended=False, now=time.time())
    code, lines, _ = check(run)
    assert code == 0 and lines[0].startswith("OK synthetic: no alerts"), lines
    code, lines, _ = check(run, "--ended")
    assert code == 1 and rules_in(lines) == ["crashed"], lines
    assert lines[0].startswith("ALERT crashed: run since step 60: no 'end' event after step 60 "
                               "and the job is over (--ended): the run crashed or was killed; "
                               f"see {run}/logs/"), lines
    assert "resume from the checkpoint of step 50" in lines[0]
    # a run that wrote its end event passed, --ended or not
    code, lines, _ = check(make_run(tmp_path / "ok", now=time.time()), "--ended")
    assert code == 0, lines


def test_exited_processes_on_this_host_flag_a_crash_without_the_flag(tmp_path):
    now = time.time()
    run = make_run(tmp_path / "c", ended=False, now=now)
    gone = [dead_pid(), dead_pid()]
    for rank, pid in enumerate(gone):
        beat(run, rank, pid, now - 5)
    code, lines, _ = check(run)
    assert code == 1 and rules_in(lines) == ["crashed"], lines
    assert (f"every rank's process has exited (host {socket.gethostname()}, pids "
            f"{','.join(map(str, sorted(gone)))} from heartbeats/)") in lines[0], lines

    # one rank still alive (this test's own process): the run may be running -> no verdict
    beat(run, 1, os.getpid(), now - 5)
    assert check(run)[0] == 0
    # a rank on another node: this host cannot tell -> the heartbeat timeout decides
    beat(run, 1, gone[1], now - 5, host="elsewhere-node")
    assert check(run)[0] == 0
    # heartbeats older than the last start/resume are the previous attempt's, not this one's
    beat(run, 1, gone[1], now - 5)
    append(run, {"event": "resume", "step": 50, "time": now - 1})
    assert check(run)[0] == 0


def test_a_zombie_counts_as_exited(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while pid_alive(p.pid) and time.monotonic() < deadline:  # exited, not reaped yet
            time.sleep(0.02)
        assert not pid_alive(p.pid) and Path(f"/proc/{p.pid}").exists()
    finally:
        p.wait()
    assert pid_alive(os.getpid())


def test_live_view_shows_the_crash_and_follow_stops(tmp_path):
    now = time.time()
    run = make_run(tmp_path / "c", ended=False, now=now, steps=12)
    beat(run, 0, dead_pid(), now - 5)
    beat(run, 1, dead_pid(), now - 5)
    log = load_run(run)
    con = Console(record=True, width=200, file=io.StringIO())
    con.print(render(log, evaluate(log, now=now), now=now))
    text = con.export_text()
    assert "crashed (no end event)" in text and "ALERT crashed: run since step 12" in text
    con = Console(record=True, width=200, file=io.StringIO())
    t0 = time.monotonic()
    # --exit-on-end also ends at a crash, which writes no end event (max_seconds: a cap only)
    assert follow(run, AlertRules(), interval=0.05, exit_on_end=True, console=con,
                  max_seconds=120) == 0
    assert time.monotonic() - t0 < 120, "follow ran until max_seconds"
    assert "ALERT crashed" in con.export_text()


def test_ended_is_refused_with_follow(tmp_path):
    run = make_run(tmp_path / "r")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(["monitor", str(run), "--follow", "--ended"])
    assert code == 2 and "--ended is invalid with --follow" in err.getvalue()


# ---------------------------------------------------------------------- checkpoint_failed


def test_a_failed_latest_checkpoint_is_an_alert_until_one_succeeds(tmp_path):
    run = make_run(tmp_path / "c", ended=False, now=time.time())
    error = "checkpoint step 60: [Errno 28] No space left on device: 'checkpoints/.tmp'"
    append(run, {"event": "checkpoint_failed", "step": 55, "time": 1.0, "error": "disk full",
                 "failures_in_a_row": 1, "limit": 3},
           {"event": "checkpoint_failed", "step": 60, "time": 2.0, "error": error,
            "failures_in_a_row": 2, "limit": 3},
           {"event": "end", "step": 60, "time": 3.0})
    code, lines, _ = check(run)
    assert code == 1 and rules_in(lines) == ["checkpoint_failed"], lines
    assert lines[0].startswith(f"ALERT checkpoint_failed: run since step 55: checkpoint at "
                               f"step 60 failed: {error} (2 failures in a row of at most 3, "
                               "then the run stops); the newest saved checkpoint is step 50"), lines
    # the HTML report lists it with the other alerts
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["monitor", str(run)]) == 0
    assert '<tr class="alert"><td>checkpoint_failed</td>' in (run / "report.html").read_text()
    # a later successful save clears it
    append(run, {"event": "start", "step": 60, "time": 4.0},
           {"event": "checkpoint", "step": 65, "time": 5.0, "path": "checkpoints/step65"},
           {"event": "end", "step": 65, "time": 6.0})
    code, lines, _ = check(run)
    assert code == 0, lines
