"""Elastic restart: time from a node's death to the first step at the smaller layout, and
from a node's return to the first step at the larger one, split into their parts.

    python benchmarks/elastic.py [--repeats 2] [--rejoin-timeout 4] [--node-timeout 3]
                                 [--nproc 2] [--json PATH]

Two 'nodes' on this machine, each ``epscale launch --nnodes 1:2 --nproc N`` at one c10d
rendezvous (the first node hosts it), train the tiny recipe (4 layers, 8 experts, ep=2)
with a checkpoint every 3 steps. Once both train, the second node is SIGKILLed (its
workers die with it); the survivors restart at N processes with grad_accum doubled. The
node is then started again and the run grows back. Per repeat:

Shrink, from the kill:
* detection: the kill -> the surviving agent's 'rank ... exited' line (its workers'
  collectives failing on the dead peers);
* rendezvous + start: that line -> the new worker processes' start (torchrun waits
  ``--rejoin-timeout`` for the lost node to come back, and ``--node-timeout`` for its
  rendezvous heartbeat to expire, then starts the workers);
* set-up: process start -> the checkpoint load begins (imports, process group, model);
* checkpoint load; first step (warm-up) at the new layout.
Grow, from the second start of the node: its launch until the first step at the larger
layout (the node's own start, the membership change, the old workers' SIGTERM checkpoint,
the rendezvous, the new workers' set-up and load).

The split comes from the 'layout_change' events the trainer writes (metrics.jsonl) and
the agent's time-stamped failure line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(run: Path) -> tuple[list[dict], list[dict]]:
    steps, events = [], []
    path = run / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            (events if "event" in rec else steps).append(rec)
    return steps, events


def _wait(run: Path, cond, timeout: float, procs) -> tuple[list[dict], list[dict]]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        steps, events = _events(run)
        if cond(steps, events):
            return steps, events
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"a node ended early (exit {p.returncode}); see {run.parent}")
        time.sleep(0.02)
    raise SystemExit(f"timed out; see {run.parent}")


def _changes(events):
    return [e for e in events if e["event"] == "layout_change"]


def one_round(work: Path, args) -> dict:
    run, port = work / "run", _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    over = ["train.steps=100000", "train.ckpt_every=3", "train.eval_every=0",
            "train.preflight=false", "train.log_every=1000", f"data.source={args.data}"]

    def node(name: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "epscale", "launch", "--nnodes", "1:2", "--nproc",
               str(args.nproc), "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-dir", str(run),
               "--rejoin-timeout", str(args.rejoin_timeout), "--node-timeout",
               str(args.node_timeout), "--max-restarts", "3", TINY, *over]
        log = open(work / f"{name}.log", "w")
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    a = node("a")
    while True:  # the first node hosts the rendezvous
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    b = node("b")
    procs = [a, b]
    try:
        world = 2 * args.nproc
        _wait(run, lambda s, e: sum(r["world_size"] == world for r in s) >= 5, 300, procs)
        killed = time.time()
        os.killpg(b.pid, signal.SIGKILL)
        b.wait()
        _, events = _wait(run, lambda s, e: len(_changes(e)) >= 1, 300, [a])
        shrink = _changes(events)[0]
        line = re.search(r"epscale launch: \[(\d\d:\d\d:\d\d\.\d{3})\] rank",
                         (work / "a.log").read_text())
        detected = None
        if line:
            day = datetime.fromtimestamp(killed).strftime("%Y-%m-%d ")
            detected = datetime.strptime(day + line.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
        started = time.time()
        b = node("b2")
        procs = [a, b]
        _, events = _wait(run, lambda s, e: len(_changes(e)) >= 2, 300, procs)
        grow = _changes(events)[1]
        (run / "STOP").touch()
        a.wait(timeout=120)
        b.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    steps_lost = shrink["steps_lost"]
    first_step_end = shrink["time"]
    process_start = first_step_end - shrink["first_step_s"] - shrink["load_s"] - shrink["setup_s"]
    out = {
        "detection_s": (detected - killed) if detected else None,
        "rendezvous_start_s": (process_start - detected) if detected else None,
        "setup_s": shrink["setup_s"], "load_s": shrink["load_s"],
        "first_step_s": shrink["first_step_s"], "death_to_step_s": first_step_end - killed,
        "steps_lost": steps_lost, "grow_s": grow["time"] - started,
        "grow_setup_s": grow["setup_s"], "grow_load_s": grow["load_s"],
        "accum": (shrink["old"]["grad_accum"], shrink["new"]["grad_accum"]),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2, help="processes per node")
    ap.add_argument("--rejoin-timeout", type=float, default=4.0)
    ap.add_argument("--node-timeout", type=float, default=3.0)
    ap.add_argument("--data", default=None, help="a text file (default: three stdlib modules)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory(prefix="epscale-elastic-") as tmp:
        if args.data is None:
            import argparse as m1
            import string as m2
            import textwrap as m3

            args.data = str(Path(tmp) / "corpus.txt")
            Path(args.data).write_text("".join(Path(m.__file__).read_text() for m in (m1, m2, m3)))
        for i in range(args.repeats):
            work = Path(tmp) / f"round{i}"
            work.mkdir()
            with console.status(f"round {i + 1} of {args.repeats}: train, kill a node, "
                                "bring it back"):
                rows.append(one_round(work, args))
    keys = [("detection_s", "detection (kill -> agent sees it)"),
            ("rendezvous_start_s", "rendezvous + worker start"),
            ("setup_s", "set-up (imports, group, model)"), ("load_s", "checkpoint load"),
            ("first_step_s", "first step at the new layout"),
            ("death_to_step_s", "total: death -> first step"),
            ("grow_s", "grow: node start -> first step at 4"),
            ("grow_setup_s", "  of which the workers' set-up"),
            ("grow_load_s", "  of which the checkpoint load")]
    table = Table(title=f"elastic restart, 2 nodes x {args.nproc} CPU processes, tiny recipe, "
                        f"rejoin timeout {args.rejoin_timeout:g} s, node timeout "
                        f"{args.node_timeout:g} s")
    table.add_column("phase")
    for i in range(len(rows)):
        table.add_column(f"round {i + 1} (s)", justify="right")
    table.add_column("median (s)", justify="right")
    for key, label in keys:
        vals = [r[key] for r in rows]
        ok = [v for v in vals if v is not None]
        table.add_row(label, *("?" if v is None else f"{v:.2f}" for v in vals),
                      f"{statistics.median(ok):.2f}" if ok else "?")
    console.print(table)
    console.print(f"steps trained again after the shrink: {[r['steps_lost'] for r in rows]}; "
                  f"grad_accum {rows[0]['accum'][0]} -> {rows[0]['accum'][1]}")
    console.print(f"machine: {platform.processor() or platform.machine()}, "
                  f"{os.cpu_count()} cores, python {platform.python_version()}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
