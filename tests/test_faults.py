"""Faults: a hung collective ends with a named message and flight dumps; a rank killed with
SIGKILL is restarted by torchrun and training resumes to the same final loss; heartbeats."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dist_utils import train_in_ranks
from epscale.launch.watchdog import (HANG_EXIT_CODE, FlightRecorder, hang_report,
                                     read_flight_dumps)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")

# ------------------------------------------------------------------ flight recorder (unit)


def test_flight_recorder_ring_and_report(tmp_path):
    rec0 = FlightRecorder(0, 2, capacity=3, host="h0")
    for step in range(5):
        rec0.set_step(step)
        rec0.mark(rec0.begin("all_reduce"), "completed")
    assert [o["seq"] for o in rec0.snapshot()["ops"]] == [3, 4, 5]  # ring keeps the last 3
    rec0.set_step(5)
    hung = rec0.begin("all_to_all_single", shape=[8])
    rec1 = FlightRecorder(1, 2, host="h1")
    rec1.set_step(4)
    rec1.mark(rec1.begin("all_reduce"), "completed")
    rec0.dump(tmp_path / "flight_rank0.json")
    rec1.dump(tmp_path / "flight_rank1.json")
    dumps = read_flight_dumps(tmp_path, 3)  # rank 2 never wrote one
    msg = hang_report(0, "h0", hung, 10.0, dumps, tmp_path)
    assert msg.startswith("epscale watchdog: rank 0 (host h0) timed out in collective "
                          "'all_to_all_single' (#6) at step 5")
    assert "rank 1 (host h1" in msg and "behind the others" in msg
    assert "rank 2: no flight record" in msg and "Ranks behind or missing: [1, 2]" in msg


# ------------------------------------------------------------------ hung collective (2 gloo ranks)

HANG_WORKER = textwrap.dedent("""
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    from epscale.launch.watchdog import Watchdog, CollectiveTimeout

    rank, run_dir, mode = int(os.environ["RANK"]), sys.argv[1], sys.argv[2]
    pg_timeout = 2 if mode == "pg" else 120
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout))
    wd = Watchdog(run_dir, timeout_s=60 if mode == "pg" else 3, flush_s=0.5).start().install()
    x = torch.ones(4)
    try:
        for step in range(1, 10):
            wd.set_step(step)
            if step == 4 and rank == 1:
                print("rank 1 stalls outside any collective", flush=True)
                time.sleep(90)
            dist.all_reduce(x)
            work = dist.all_to_all_single(torch.empty(4), x, async_op=True)
            work.wait()
    except CollectiveTimeout as e:
        print("CAUGHT CollectiveTimeout", flush=True)
        os._exit(7)
    print("no hang?", flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_hang(tmp_path, mode):
    script = tmp_path / "hang_worker.py"
    script.write_text(HANG_WORKER)
    run_dir = tmp_path / "run"
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), str(run_dir), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out0, err0 = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    return procs[0].returncode, out0, err0, run_dir


def test_hung_collective_watchdog_names_rank_op_step_and_dumps(tmp_path):
    rc, out, err, run_dir = _run_hang(tmp_path, "watchdog")
    assert rc == HANG_EXIT_CODE, err[-3000:]
    assert ("epscale watchdog: rank 0 (host " in err and "timed out in collective 'all_reduce'"
            in err and "at step 4" in err), err[-3000:]
    # rank 1 finished step 3 and never entered step 4's all_reduce: it is named as behind
    line1 = next(ln for ln in err.splitlines() if ln.startswith("  rank 1 "))
    assert "step 3" in line1 and "behind the others" in line1, err[-3000:]
    for r in (0, 1):
        dump = json.loads((run_dir / "logs" / f"flight_rank{r}.json").read_text())
        assert dump["rank"] == r and dump["ops"], dump
        assert {o["op"] for o in dump["ops"]} == {"all_reduce", "all_to_all_single"}
    last0 = json.loads((run_dir / "logs" / "flight_rank0.json").read_text())["ops"][-1]
    assert (last0["op"], last0["step"], last0["state"]) == ("all_reduce", 4, "running")
    assert (run_dir / "logs" / "hang_rank0.txt").read_text().startswith("epscale watchdog")


def test_process_group_timeout_gives_the_same_message(tmp_path):
    rc, out, err, run_dir = _run_hang(tmp_path, "pg")
    assert rc == 7 and "CAUGHT CollectiveTimeout" in out, err[-3000:]
    assert "rank 0" in err and "'all_reduce'" in err and "at step 4" in err, err[-3000:]
    assert "the process group raised" in err


def test_watchdog_rejects_bad_timeout(tmp_path):
    from epscale.launch.watchdog import Watchdog

    with pytest.raises(ValueError, match="timeout_s = 0 is invalid"):
        Watchdog(tmp_path, timeout_s=0, rank=0, world_size=1)


# ------------------------------------------------------------------ SIGKILL a rank mid-training

SMALL = ["model.dim=64", "model.num_layers=2", "model.num_heads=4", "model.seq_len=64",
         "model.dense_hidden_dim=128", "moe.hidden_dim=64", "train.micro_batch_size=2",
         "train.warmup_steps=2", "train.eval_every=0", "train.eval_batches=1", "name=faults"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small text file (a few standard-library modules) so data loading is instant."""
    import argparse
    import json as json_mod
    import textwrap as tw

    p = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    p.write_text("".join(Path(m.__file__).read_text() for m in (argparse, tw, json_mod.decoder)))
    return p


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]


def _final_loss(run_dir: Path, step: int) -> float:
    recs = [m for m in _metrics(run_dir) if m.get("step") == step and "loss" in m
            and "event" not in m]
    assert recs, f"no step-{step} record in {run_dir}/metrics.jsonl"
    return recs[-1]["loss"]


def _launch(run_dir: Path, corpus: Path, steps: int, max_restarts: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "epscale", "launch", "--nproc", "2", TINY,
           "--run-dir", str(run_dir), "--max-restarts", str(max_restarts),
           f"train.steps={steps}", "train.ckpt_every=5", f"data.source={corpus}", *SMALL]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _parent(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rfind(")") + 2:].split()[1])


def test_sigkill_rank_restarts_and_resumes_to_the_same_loss(tmp_path, corpus):
    steps = 24
    # The uninterrupted reference (in ranks of the test's own: the launch is the killed run's)
    train_in_ranks(TINY, [f"train.steps={steps}", "train.ckpt_every=5", f"data.source={corpus}",
                          *SMALL], tmp_path / "ref", 2)

    run = tmp_path / "killed"
    proc = _launch(run, corpus, steps, max_restarts=2)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    killed = None
    deadline = time.monotonic() + 240
    hb = run / "heartbeats" / "rank1.json"
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        try:
            beat = json.loads(hb.read_text())
        except (OSError, ValueError):
            beat = None
        if beat and beat["step"] >= 7:  # past the step-5 checkpoint
            pid = beat["pid"]
            assert _parent(pid) == proc.pid, "the heartbeat's pid is not one of our workers"
            os.kill(pid, signal.SIGKILL)
            killed = beat["step"]
        time.sleep(0.01)
    assert killed is not None, "training ended before rank 1 could be killed:\n" + "".join(output)
    assert proc.wait(timeout=300) == 0, "".join(output)[-4000:]
    reader.join(5)
    assert killed < steps, f"rank 1 was killed at step {killed}, after the end"

    events = [m for m in _metrics(run) if m.get("event") in ("start", "resume")]
    resumes = [m for m in events if m["event"] == "resume"]
    assert resumes and resumes[-1]["step"] <= killed, (events, killed)
    assert _final_loss(run, steps) == pytest.approx(_final_loss(tmp_path / "ref", steps),
                                                    rel=1e-6, abs=1e-6)
    # heartbeats: every rank's file names its rank, host, the last step and a recent time
    for r in (0, 1):
        beat = json.loads((run / "heartbeats" / f"rank{r}.json").read_text())
        assert beat["rank"] == r and beat["step"] == steps and beat["host"] == socket.gethostname()
        assert time.time() - beat["time"] < 300


# ------------------------------------------------------------------ a frozen rank in the trainer


def _trainer_has_watchdog() -> bool:
    from dataclasses import fields

    from epscale.config import TrainConfig

    return "collective_timeout_s" in {f.name for f in fields(TrainConfig)}


@pytest.mark.skipif(not _trainer_has_watchdog(),
                    reason="the trainer does not start epscale.launch.watchdog yet (it needs "
                           "the config key train.collective_timeout_s and the Watchdog calls in "
                           "training/loop.py; see docs/slurm.md)")
def test_frozen_rank_in_training_ends_with_named_timeout(tmp_path, corpus):
    """SIGSTOP freezes rank 1 mid-training: rank 0 blocks in a collective, the watchdog
    names rank 0, the operation and the step, and the job ends (no restarts left)."""
    import re

    run = tmp_path / "frozen"
    cmd = [sys.executable, "-m", "epscale", "launch", "--nproc", "2", TINY, "--run-dir", str(run),
           "--max-restarts", "0", "train.steps=100000", "train.ckpt_every=0",
           "train.collective_timeout_s=5", f"data.source={corpus}", *SMALL]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    pid = None
    try:
        deadline = time.monotonic() + 240
        while pid is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                beat = json.loads((run / "heartbeats" / "rank1.json").read_text())
            except (OSError, ValueError):
                beat = None
            if beat and beat["step"] >= 3:
                pid, frozen_at = beat["pid"], beat["step"]
                assert _parent(pid) == proc.pid
                os.kill(pid, signal.SIGSTOP)
            time.sleep(0.01)
        assert pid is not None, "training never reached step 3:\n" + "".join(output)[-3000:]
        while proc.poll() is None and time.monotonic() < deadline:
            if "Full dumps:" in "".join(output):  # the report is out: spare torchrun the 30 s
                os.kill(pid, signal.SIGKILL)      # it waits before it SIGKILLs a frozen rank
                break
            time.sleep(0.1)
        assert proc.wait(timeout=180) != 0
    finally:
        if pid is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    text = "".join(output)
    m = re.search(r"epscale watchdog: rank 0 \(host \S+\) timed out in collective '(\w+)' "
                  r"\(#\d+\) at step (\d+)", text)
    assert m, text[-4000:]
    assert int(m.group(2)) >= frozen_at
    assert re.search(r"rank 1 .*(behind the others|stopped updating)", text), text[-4000:]
    assert (run / "logs" / "flight_rank0.json").exists()
