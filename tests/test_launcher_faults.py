"""Launcher faults, with real processes and real signals: a second SIGTERM/SIGINT to
``epscale train --nproc 2`` kills every worker; ``epscale launch`` checks the run before
torchrun starts, does not restart on an error a restart cannot fix (exit status 2), names
the rank and the signal of a restart, and its workers die with it when it is SIGKILLed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from epscale.launch.agent import is_config_error, kill_tree, split_failures
from epscale.training.prelaunch import CHECKED_ENV

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="walks the process tree through /proc (Linux)")

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = ["model.dim=64", "model.num_layers=2", "model.num_heads=4", "model.seq_len=64",
         "model.dense_hidden_dim=128", "moe.hidden_dim=64", "train.micro_batch_size=2",
         "train.warmup_steps=2", "train.eval_every=0", "train.eval_batches=1",
         "train.preflight=false", "name=launcher-faults"]
ENDLESS = ["train.steps=100000", "train.ckpt_every=0"]  # runs until the test ends it


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small text file (a few standard-library modules) so data loading is instant."""
    import argparse
    import json as json_mod
    import textwrap

    p = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    mods = (argparse, textwrap, json_mod.decoder)
    p.write_text("".join(Path(m.__file__).read_text() for m in mods))
    return p


# ------------------------------------------------------------------ processes, from /proc


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state letter, start time) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = text[text.rfind(")") + 2:].split()
    return int(f[1]), f[0], int(f[19])


def _tree(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time (to tell a reused pid)."""
    parents = {}
    for entry in Path("/proc").glob("[0-9]*"):
        st = _stat(int(entry.name))
        if st is not None:
            parents[int(entry.name)] = st
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        for child, (ppid, _state, start) in parents.items():
            if ppid == pid and child not in found:
                found[child] = start
                todo.append(child)
    return found


def _alive(tree: dict[int, int]) -> list[int]:
    """The processes of ``tree`` that still run (zombies have died; init reaps them)."""
    out = []
    for pid, start in tree.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] not in "ZXx":
            out.append(pid)
    return out


def _kill_all(run: Run, tree: dict[int, int]) -> None:
    """End ``run`` and every process found under it now or before (``tree``), so that a
    failed test leaves nothing running."""
    if run.proc.poll() is None:
        tree = {**tree, **_tree(run.proc.pid)}
        run.proc.kill()
    for pid in _alive(tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    run.proc.wait(timeout=30)


class Run:
    """``python -m epscale ARGS`` with its output collected by a thread."""

    def __init__(self, args: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epscale", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
            env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def text(self) -> str:
        return "".join(self.lines)

    def heartbeat(self, run_dir: Path, rank: int, min_step: int, timeout: float = 120,
                  not_pid: int | None = None) -> dict:
        """Rank ``rank``'s heartbeat once it reached ``min_step`` (from a process other than
        ``not_pid``); fails with the output when the run ends or the time is up."""
        path = run_dir / "heartbeats" / f"rank{rank}.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                beat = json.loads(path.read_text())
            except (OSError, ValueError):
                beat = None
            if beat and beat["step"] >= min_step and beat["pid"] != not_pid:
                return beat
            time.sleep(0.02)
        pytest.fail(f"rank {rank} never reached step {min_step}:\n{self.text()[-4000:]}")


def _wait_gone(tree: dict[int, int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(tree)


# ------------------------------------------------------------------ kill_tree


def test_kill_tree_reaches_children_in_sessions_of_their_own():
    """torchrun's shape in miniature: a parent whose children each start a session of their
    own (a process-group kill of the parent misses them); they get a child each."""
    grandchild = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"for _ in range(2): subprocess.Popen([sys.executable, '-c', {grandchild!r}], "
        "start_new_session=True)\n"
        "time.sleep(300)")], start_new_session=True)
    tree: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 30
        while len(tree) < 4 and time.monotonic() < deadline:
            tree = _tree(parent.pid)
            time.sleep(0.05)
        assert len(tree) == 4, tree
        assert kill_tree(parent.pid) == []
        assert not _alive(tree) and parent.wait(timeout=10) == -signal.SIGKILL
    finally:
        for pid in _alive(tree):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_failures_split_cause_from_ranks_torchrun_stopped():
    """torch books the ranks it SIGTERMs after a failure as failures too; the decision
    (restart or not) and the message go by the ranks that failed first."""
    def failures(*codes):
        return {r: ProcessFailure(r, 1000 + r, c, "<N/A>") for r, c in enumerate(codes)}

    assert is_config_error(failures(2, -signal.SIGTERM))  # rank 1 was stopped by torchrun
    assert is_config_error(failures(2, 2))
    assert not is_config_error(failures(2, 1)) and not is_config_error(failures(-9, 2))
    assert not is_config_error(failures(-signal.SIGTERM))  # killed from outside
    causes, stopped = split_failures(failures(-signal.SIGTERM, -signal.SIGKILL))
    assert list(causes) == [1] and stopped == [0]


# ------------------------------------------------------------------ epscale train --nproc 2


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_second_signal_kills_every_worker(tmp_path, corpus, sig):
    """Rank 1 is frozen (SIGSTOP), so rank 0 waits for it in a collective and the graceful
    stop asked for by the first signal cannot finish: the second one must kill torchrun and
    both workers (each in a session of its own), and the launcher exits 128 + signal."""
    run_dir = tmp_path / "run"
    run = Run(["train", "--nproc", "2", "--config", TINY, "--run-dir", str(run_dir),
               f"data.source={corpus}", *SMALL, *ENDLESS])
    tree: dict[int, int] = {}
    try:
        beat = run.heartbeat(run_dir, rank=1, min_step=2)
        tree = _tree(run.proc.pid)
        assert beat["pid"] in tree, (beat, tree)
        assert len(tree) >= 3, f"expected torchrun and 2 workers under the launcher: {tree}"
        os.kill(beat["pid"], signal.SIGSTOP)
        os.kill(run.proc.pid, sig)
        time.sleep(1.0)
        assert run.proc.poll() is None, "the first signal must stop gracefully, not kill"
        os.kill(run.proc.pid, sig)
        rc = run.proc.wait(timeout=60)
        left = _alive(tree)  # at once: the launcher returns only when the tree is dead
        assert not left, f"processes {left} of the worker tree outlived the launcher"
        assert rc == 128 + sig, f"exit status {rc}\n{run.text()[-3000:]}"
        assert "killing torchrun and every worker" in run.text()
    finally:
        _kill_all(run, tree)


# ------------------------------------------------------------------ epscale launch


@pytest.mark.parametrize("bad, error", [
    ("moe.top_kk=2", "unknown config key 'moe.top_kk'"),
    ("data.source={tmp}/missing.txt", "missing.txt' does not exist"),
], ids=["config-typo", "missing-data"])
def test_launch_checks_before_torchrun_starts(tmp_path, bad, error):
    """A mistake the pre-launch checks see is one message and exit status 2; torchrun (the
    agent) never starts and the run directory is not created."""
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "epscale", "launch", "--nproc", "2", TINY,
                        "--run-dir", str(run_dir), "--max-restarts", "3",
                        bad.format(tmp=tmp_path), *SMALL],
                       check=False, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL,
                       env={k: v for k, v in os.environ.items() if k != CHECKED_ENV})
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert out.count(error) == 1, out[-3000:]
    assert "epscale.launch.agent" not in out, "torchrun started:\n" + out[-3000:]
    assert not run_dir.exists()


def test_worker_error_exit_2_is_not_restarted(tmp_path, corpus):
    """An error only the workers meet (here: the launcher is told the checks ran, so the
    missing data file reaches them) ends the group after the first attempt with exit status
    2, although --max-restarts 3 allows three restarts."""
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "epscale", "launch", "--nproc", "2", TINY,
                        "--run-dir", str(run_dir), "--max-restarts", "3",
                        f"data.source={tmp_path}/missing.txt", *SMALL],
                       check=False, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL,
                       env=dict(os.environ, OMP_NUM_THREADS="1", **{CHECKED_ENV: "1"}))
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-4000:]
    assert "restart 1 of" not in out, out[-4000:]
    assert re.search(r"epscale launch: \[[0-9:.]+\] rank \d \(pid \d+\) exited with status 2.*a restart "
                     r"cannot fix: not restarting", out), out[-4000:]
    # one attempt: at most one message per rank
    assert 1 <= out.count("missing.txt' does not exist") <= 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]


def test_killed_rank_is_named_and_workers_die_with_the_agent(tmp_path, corpus):
    """SIGKILL rank 1: the agent says which rank died, how, and which restart follows.
    Then SIGKILL the agent itself: its workers must not train on unwatched."""
    run_dir = tmp_path / "run"
    run = Run(["launch", "--nproc", "2", TINY, "--run-dir", str(run_dir), "--max-restarts", "1",
               f"data.source={corpus}", *SMALL, *ENDLESS])
    tree: dict[int, int] = {}
    try:
        first = run.heartbeat(run_dir, rank=1, min_step=2)
        os.kill(first["pid"], signal.SIGKILL)
        second = run.heartbeat(run_dir, rank=1, min_step=1, not_pid=first["pid"])
        tree = _tree(run.proc.pid)  # `epscale launch` execs the agent: this pid is torchrun
        assert re.search(rf"epscale launch: [^;\n]*rank 1 \(pid {first['pid']}\) was killed by "
                         r"SIGKILL[^;\n]*; restart 1 of 1", run.text()), run.text()[-4000:]
        assert second["pid"] in tree, (second, tree)
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=30)
        left = _wait_gone(tree, timeout=20)
        assert not left, f"workers {left} outlived their SIGKILLed agent"
    finally:
        _kill_all(run, tree)
