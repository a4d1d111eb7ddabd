"""Elastic restarts with real processes: two 'nodes' (two ``epscale launch --nnodes 1:2``
agents of 2 CPU processes each, one rendezvous) train; one node is SIGKILLed and not
restarted, the other goes on at 2 processes with grad_accum doubled from the newest
checkpoint, with the losses of an uninterrupted 4-process run on the same global batches;
the node comes back and the run grows back to 4. A world no layout fits ends with the
missing ranks and the layouts the config allows."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_utils import train_in_ranks
from epscale.launch.local import free_port
from epscale.training.prelaunch import CHECKED_ENV
from test_train import assert_losses_close, read_metrics, tiny_overrides

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
STEPS = 3000  # far more than the test waits for: the run is stopped with the STOP file
ELASTIC = {"parallel.ep": 2, "train.micro_batch_size": 1, "train.steps": STEPS,
           "train.ckpt_every": 3, "train.eval_every": 0, "train.warmup_steps": 2,
           "train.preflight": False, "train.log_every": 1000,
           # the reference (one 'node' of 4) groups its ranks as two nodes of 2 do
           "parallel.ranks_per_node": 2}


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _node(tmp_path: Path, run_dir: Path, port: int, name: str, nnodes: str = "1:2",
          nproc: int = 2, rejoin: float = 4, **over) -> subprocess.Popen:
    """One 'node': an elastic launch of ``nproc`` processes at the shared rendezvous."""
    cmd = [sys.executable, "-m", "epscale", "launch", "--nnodes", nnodes, "--nproc", str(nproc),
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-dir", str(run_dir),
           "--rejoin-timeout", str(rejoin), "--node-timeout", "3", "--max-restarts", "3",
           TINY, *tiny_overrides(tmp_path, **{**ELASTIC, **over})]
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _read_live(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """read_metrics on a run that is writing: a step record is one write(2), but a record
    of several KB can be read while the kernel copies it in; read again then."""
    for _ in range(100):
        try:
            return read_metrics(run_dir)
        except json.JSONDecodeError:
            time.sleep(0.05)
    return read_metrics(run_dir)


def _wait_for(run_dir: Path, what, timeout: float, procs=()) -> list[dict]:
    """Poll metrics.jsonl until ``what(steps, events)`` holds; the records then."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (run_dir / "metrics.jsonl").is_file():
            steps, events = _read_live(run_dir)
            if what(steps, events):
                return events
        for p in procs:
            assert p.poll() is None, f"a node ended early with {p.returncode}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting on {run_dir}/metrics.jsonl")


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, f"the first node ended with {proc.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port}")


def _changes(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "layout_change"]


def _log(tmp_path: Path, name: str) -> str:
    return (tmp_path / f"{name}.log").read_text()


@pytest.mark.timeout(600)
def test_lose_a_node_train_on_and_grow_back(tmp_path):
    run = tmp_path / "run"
    port = free_port()
    # Node a hosts the rendezvous (the node whose loss ends a job). Its rendezvous rounds
    # wait 20 s for a second node once it is in: node b starts a few seconds after it, and
    # under CPU load (a full suite in two workers) b's start-up took longer than the
    # default 4 s, so a trained alone first and the changes below were off by one.
    a = _node(tmp_path, run, port, "a", rejoin=20)
    _wait_listening(port, a)
    b = _node(tmp_path, run, port, "b")
    nodes = [a, b]
    try:
        # Both nodes train together (4 processes) past the checkpoint of step 3.
        _wait_for(run, lambda s, e: any(r["step"] >= 4 and r["world_size"] == 4 for r in s),
                  180, nodes)
        os.killpg(b.pid, signal.SIGKILL)  # the node and its workers (parent-death signal)
        b.wait()
        events = _wait_for(run, lambda s, e: len(_changes(e)) >= 1, 180, [a])
        # The survivors train at 2 processes; now the node comes back.
        b = _node(tmp_path, run, port, "b2")
        nodes = [a, b]
        events = _wait_for(run, lambda s, e: len(_changes(e)) >= 2, 180, nodes)
        _wait_for(run, lambda s, e: sum(r["world_size"] == 4 for r in s
                                        if r["time"] > _changes(e)[1]["time"]) >= 3, 60, nodes)
        (run / "STOP").touch()  # a graceful stop: checkpoint, exit 0 on every node
        assert a.wait(timeout=120) == 0, _log(tmp_path, "a")[-3000:]
        assert b.wait(timeout=120) == 0, _log(tmp_path, "b2")[-3000:]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    steps, events = read_metrics(run)
    shrink, grow = _changes(events)
    host = socket.gethostname()
    assert shrink["old"]["world_size"] == 4 and shrink["new"]["world_size"] == 2
    assert (shrink["old"]["grad_accum"], shrink["new"]["grad_accum"]) == (1, 2)
    assert shrink["old"]["global_batch"] == shrink["new"]["global_batch"] == 4
    assert shrink["ranks_lost"] == 2 and shrink["hosts_lost"] == {host: 2}
    assert shrink["steps_lost"] >= 0 and shrink["resumed_from"].endswith(
        f"step_{shrink['step'] - 1:08d}")
    # the parts of the time to resume add up (no bound on a time: machines differ)
    assert shrink["outage_s"] > 0 and shrink["resume_s"] >= shrink["outage_s"] + shrink["load_s"]
    assert grow["ranks_lost"] == -2 and grow["hosts_gained"] == {host: 2}
    assert (grow["old"]["grad_accum"], grow["new"]["grad_accum"]) == (2, 1)
    # The timeline the run kept (a step trained again after a restart replaces the lost one).
    kept: dict[int, dict] = {}
    for r in steps:
        kept[r["step"]] = r
    last = max(kept)
    assert sorted(kept) == list(range(1, last + 1))
    assert {r["world_size"] for r in kept.values()} == {2, 4}
    # The reference: 4 processes, never interrupted, over the same steps and batches (ranks
    # of the test's own: the launches above are what this test is about).
    ref_dir = tmp_path / "ref"
    over = tiny_overrides(tmp_path, **ELASTIC, **{"train.global_batch_size": 4})
    horizon = range(shrink["step"], shrink["step"] + 6)  # compared to 5e-4 (below)
    train_in_ranks(TINY, over, ref_dir, 4, stop_at=min(last, horizon[-1]))
    ref_losses = {r["step"]: r["loss"] for r in read_metrics(ref_dir)[0]}
    before = [s for s in kept if s < shrink["step"]]
    assert before and all(kept[s]["world_size"] == 4 for s in before)
    assert all(kept[s]["loss"] == ref_losses[s] for s in before)  # the same layout: bitwise
    # At 2 processes x grad_accum 2 the same batches are summed in another order: the
    # first step (the checkpoint's weights) agrees to 1e-5, the next ones as the other
    # layout tests' do (later, the rounding differences compound as between any two
    # layouts, so the comparison stops there).
    assert_losses_close({s: kept[s]["loss"] for s in horizon if s in kept}, ref_losses,
                        same_weights=(shrink["step"],))
    assert grow["steps_lost"] == 0  # the growth restart stops the workers with SIGTERM: saved
    # monitor --check names both changes
    from epscale.monitor import evaluate, load_run

    said = [a.message for a in evaluate(load_run(run)) if a.rule == "layout_change"]
    assert len(said) == 2 and "layout 4 -> 2 processes" in said[0], said
    assert "2 rank(s) joined" in said[1], said


@pytest.mark.timeout(300)
def test_ranks_past_the_usable_world_stand_by(tmp_path):
    """Three 1-process nodes, a global batch of 4: 3 processes cannot split it, so the
    largest world of whole nodes that can (2) trains and the third rank stands by (no
    process group) until the attempt ends; every node exits 0."""
    run, port = tmp_path / "run", free_port()
    over = {"train.steps": 6, "train.global_batch_size": 4, "parallel.ranks_per_node": "null"}
    nodes = [_node(tmp_path, run, port, "n0", nnodes="1:3", nproc=1, rejoin=8, **over)]
    try:
        _wait_listening(port, nodes[0])
        nodes += [_node(tmp_path, run, port, f"n{i}", nnodes="1:3", nproc=1, rejoin=8, **over)
                  for i in (1, 2)]
        codes = [p.wait(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = "".join(_log(tmp_path, f"n{i}") for i in range(3))
    assert codes == [0, 0, 0], logs[-4000:]
    steps, events = read_metrics(run)
    starts = [e for e in events if e["event"] == "start"]
    assert starts[-1]["world_size"] == 2 and starts[-1]["standby"] == 1, starts
    assert "stands by: this config trains at 2 of the 3 processes" in logs
    assert "'parallel.ep' = 2 is invalid: must divide the 3 processes" in logs  # tiny's ep=2
    assert "1 more rank(s) of this elastic attempt stand by" in logs
    assert {r["step"] for r in steps} == set(range(1, 7)) and events[-1]["event"] == "end"
    assert steps[-1]["world_size"] == 2


@pytest.mark.timeout(300)
def test_a_world_no_layout_fits_names_the_missing_ranks(tmp_path):
    """The previous attempt ran 4 processes; 3 come back, and a global batch of 4 cannot
    be split over 3: the start fails (exit 2, no restart) naming the missing rank, its
    host and the worlds the config allows."""
    run = tmp_path / "run"
    run.mkdir()
    host = socket.gethostname()
    start = {"event": "start", "step": 0, "time": time.time() - 60, "world_size": 4, "dp": 2,
             "ep": 2, "fsdp": False, "dp_replicate": 1, "dp_shard": 1, "grad_accum": 1,
             "global_batch": 4, "hosts": [host] * 4}
    (run / "metrics.jsonl").write_text(json.dumps(start) + "\n")
    over = tiny_overrides(tmp_path, **{**ELASTIC, "train.steps": 4, "parallel.ep": 1,
                                       "parallel.ranks_per_node": "null"},
                          **{"train.global_batch_size": 4})
    r = subprocess.run([sys.executable, "-m", "epscale", "launch", "--nproc", "3",
                        "--run-dir", str(run), TINY, *over],
                       cwd=REPO, env=dict(_env(), **{CHECKED_ENV: "1"}), capture_output=True,
                       text=True, timeout=240, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "no valid layout for the 3 process(es)" in out
    assert "'train.global_batch_size' = 4 is invalid: cannot be kept at 3 processes" in out
    assert "missing: 1 of the 4 ranks of the previous layout" in out and f"{host} x1" in out
    assert "the smallest layout this config allows is 1 processes (allowed: 1, 2, 4" in out
    assert "the largest at or below 3: 2" in out
    assert "restart 1 of" not in out


# --------------------------------------------------------------------------------------
# the pieces, in process
# --------------------------------------------------------------------------------------


def test_global_batch_size_derives_grad_accum_or_names_the_key(tmp_path):
    from epscale.config import ConfigError, load_config
    from epscale.training.elastic import fit_batch, valid_worlds

    cfg = load_config(TINY, ["train.micro_batch_size=2", "train.global_batch_size=16"])
    assert fit_batch(cfg, 8)[0].train.grad_accum == 1
    fitted, note = fit_batch(cfg, 2)
    assert fitted.train.grad_accum == 4 and cfg.train.grad_accum == 1  # a copy
    assert "train.grad_accum = 4" in note
    ep1 = load_config(TINY, ["train.micro_batch_size=2", "train.global_batch_size=16",
                             "parallel.ep=1"])
    with pytest.raises(ConfigError, match=r"'train.global_batch_size' = 16 is invalid: cannot be "
                                          r"kept at 3 processes.*multiple of .* 3 x 2 = 6"):
        fit_batch(ep1, 3)
    with pytest.raises(ConfigError, match=r"'parallel.ep' = 2 is invalid: must divide the 3 "
                                          "processes"):
        fit_batch(cfg, 3)  # the layout's rules come first
    assert valid_worlds(cfg, 8) == [2, 4, 8]  # tiny's ep=2 needs an even world
    with pytest.raises(ConfigError, match="train.global_batch_size.*multiple of "
                                          "train.micro_batch_size = 3"):
        load_config(TINY, ["train.micro_batch_size=3", "train.global_batch_size=16"])
    with pytest.raises(ConfigError, match="'train.grad_accum'.*derived from "
                                          "train.global_batch_size"):
        load_config(TINY, ["train.grad_accum=2", "train.global_batch_size=16"])


def test_layout_change_and_the_previous_attempt(tmp_path):
    from epscale.training.elastic import layout_change, no_layout_message, previous_attempt
    from epscale.config import load_config

    old = {"event": "start", "step": 0, "world_size": 4, "dp": 2, "ep": 2, "fsdp": False,
           "dp_replicate": 1, "dp_shard": 1, "grad_accum": 1, "global_batch": 8,
           "hosts": ["n1", "n1", "n2", "n2"]}
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"event": "start", "world_size": 2}) + "\n" + json.dumps(old)
                    + "\n" + json.dumps({"step": 7, "time": 100.0}) + "\n{broken\n"
                    + json.dumps({"step": 9, "time": 110.0}) + "\n")
    prev = previous_attempt(path)
    assert prev["world_size"] == 4 and (prev["last_step"], prev["last_step_time"]) == (9, 110.0)
    assert previous_attempt(tmp_path / "none.jsonl") is None
    new = {**old, "world_size": 2, "dp": 1, "grad_accum": 2, "hosts": ["n1", "n1"]}
    ev = layout_change(prev, new, resumed_step=6)
    assert ev["ranks_lost"] == 2 and ev["hosts_lost"] == {"n2": 2} and ev["hosts_gained"] == {}
    assert ev["steps_lost"] == 3 and ev["old"]["grad_accum"] == 1 and ev["new"]["dp"] == 1
    assert layout_change(prev, {**old}, resumed_step=6) is None  # same layout: no event
    cfg = load_config(TINY, ["train.micro_batch_size=2", "train.global_batch_size=8"])
    text = no_layout_message(cfg, 3, "the reason", prev, ["n1", "n1", "n2"])
    assert "the reason" in text and "missing: 1 of the 4 ranks" in text and "n2 x1" in text
    assert "smallest layout this config allows is 2 processes (allowed: 2, 4; the largest at " \
           "or below 3: 2)" in text


def test_elastic_launch_command_and_its_checks(tmp_path, capsys):
    from epscale.cli import main as cli_main
    from epscale.launch.local import parse_nnodes, torchrun_args

    assert parse_nnodes("2:4") == (2, 4) and parse_nnodes(3) == (3, 3)
    for bad in ("0:2", "4:2", "a", "1:2:3"):
        with pytest.raises(Exception, match="--nnodes"):
            parse_nnodes(bad)
    args = torchrun_args(nproc_per_node=8, nnodes="2:4", rdzv_endpoint="h:29400",
                         rejoin_timeout_s=30, node_timeout_s=15)
    assert "--nnodes=2:4" in args and "--rdzv-endpoint=h:29400" in args
    assert ("--rdzv-conf=last_call_timeout=30,keep_alive_interval=5,keep_alive_max_attempt=3"
            in args)
    # an elastic launch needs the rendezvous and a shared run directory
    assert cli_main(["launch", "--nnodes", "1:2", "--nproc", "2", TINY, "--dry-run"]) == 2
    assert "needs --rdzv-endpoint HOST:PORT and --run-dir" in capsys.readouterr().err
    rc = cli_main(["launch", "--nnodes", "1:2", "--nproc", "2", "--rdzv-endpoint", "h:1",
                   "--run-dir", str(tmp_path / "r"), TINY, "--dry-run",
                   "train.micro_batch_size=2", "train.grad_accum=3"])
    assert rc == 0
    cmd = capsys.readouterr().out.split()
    # the largest layout's batch, 2 nodes x 2 x 3 x 2, is kept at every size
    assert cmd[-2:] == ["train.grad_accum=1", "train.global_batch_size=24"]
    assert "--nnodes=1:2" in cmd and "--rdzv-backend=c10d" in cmd


def test_monitor_check_reports_a_layout_change(tmp_path):
    from epscale.monitor import evaluate, load_run

    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "time": 100.0 + s, "loss": 3.0, "world_size": 4 if s < 5 else 2}
             for s in range(1, 9)]
    lines.insert(5, {"event": "layout_change", "step": 5, "time": 120.0,
                     "old": {"world_size": 4, "dp": 2, "ep": 2, "grad_accum": 1,
                             "global_batch": 8},
                     "new": {"world_size": 2, "dp": 1, "ep": 2, "grad_accum": 2,
                             "global_batch": 8},
                     "ranks_lost": 2, "hosts_lost": {"n2": 2}, "hosts_gained": {},
                     "steps_lost": 1, "outage_s": 9.5, "setup_s": 3.0, "load_s": 0.2,
                     "first_step_s": 0.5, "resume_s": 13.2})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    alerts = [a for a in evaluate(load_run(run)) if a.rule == "layout_change"]
    assert len(alerts) == 1 and alerts[0].since_step == 5
    msg = alerts[0].message
    assert "layout 4 -> 2 processes (dp=2 x ep=2 -> dp=1 x ep=2), 2 rank(s) lost (n2 x2)" in msg
    assert "grad_accum 1 -> 2 keeps the global batch of 8" in msg
    assert "1 step(s) since the checkpoint trained again" in msg and "back 13.2 s" in msg


def test_a_smaller_world_that_does_not_fit_memory_is_refused_with_the_numbers():
    """What the trainer checks on CUDA when an elastic restart shrank the world: the
    memory model's per-rank total against the GPU's memory."""
    from epscale.config import ConfigError, load_config, recipe_path
    from epscale.plan.memory import memory_per_rank
    from epscale.training.elastic import check_memory

    cfg = load_config(recipe_path("ref-1t-64e"))
    gib = 2.0 ** 30
    check_memory(cfg, 1024, 80 * gib, "one H100")  # the recipe's own layout fits
    need = memory_per_rank(cfg, world=384).total
    assert need > 80 * gib
    with pytest.raises(ConfigError, match=rf"at 384 processes each rank needs "
                                          rf"{need / gib:.1f} GiB.*epscale describe CONFIG "
                                          rf"--world 384.*more than the 80.0 GiB of one H100"):
        check_memory(cfg, 384, 80 * gib, "one H100")


def test_the_run_directory_keeps_the_config_as_given(tmp_path):
    """A run with train.global_batch_size derives grad_accum (here 2 at one process), but
    its config.yaml and its checkpoints keep the config as given, so both load again (at
    any world: the derived value would be refused next to global_batch_size)."""
    from epscale.config import RunConfig, from_dict, load_config
    from epscale.training.loop import train
    from test_train import tiny_cfg

    cfg = tiny_cfg(tmp_path, **{"train.global_batch_size": 8, "train.steps": 2,
                                "train.ckpt_every": 2})
    result = train(cfg, tmp_path / "run")
    assert result.step == 2 and result.records[-1]["world_size"] == 1
    steps, events = read_metrics(tmp_path / "run")
    start = [e for e in events if e["event"] == "start"][-1]
    assert (start["grad_accum"], start["global_batch"]) == (2, 8)
    again = load_config(tmp_path / "run" / "config.yaml")
    assert (again.train.global_batch_size, again.train.grad_accum) == (8, 1)
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000002" / "meta.json")
                      .read_text())
    assert from_dict(RunConfig, meta["config"]).train.grad_accum == 1


def test_the_validation_set_is_the_same_at_every_world_of_one_global_batch(tmp_path):
    """4 ranks x 1 micro-batch and 2 ranks x grad_accum 2 (the same global batch) see the
    same validation samples; so does one process accumulating 4."""
    from epscale.config import DataConfig
    from epscale.training.data import DataLoader, load_data
    from test_train import corpus

    splits = load_data(DataConfig(source=str(corpus(tmp_path))), 256)

    def val_set(world: int, accum: int) -> list[bytes]:
        rows = []
        for rank in range(world):
            loader = DataLoader(splits, 32, 2, accum, rank, world, seed=0)
            for x_BS, _y in loader.val_batches(3):
                rows += [row.numpy().tobytes() for row in x_BS]
        return sorted(rows)

    four = val_set(4, 1)
    assert len(four) == 3 * 4 * 2
    assert val_set(2, 2) == four and val_set(1, 4) == four


@pytest.mark.timeout(400)
def test_a_one_process_node_that_comes_back_joins_and_the_run_grows_back(tmp_path):
    """Issue #30, finding 2: two 1-process nodes with the preflight on (it used to key its
    store by the restart count, which differs between the survivor and the returning
    node: both waited for each other until the restarts ran out). Node b is SIGKILLed, a
    trains on alone, b is started again: the run grows back to 2 and finishes."""
    run, port = tmp_path / "run", free_port()
    over = {"parallel.ep": 1, "train.global_batch_size": 2, "train.preflight": True,
            "parallel.ranks_per_node": "null", "train.ckpt_every": 2}
    a = _node(tmp_path, run, port, "a", nproc=1, **over)
    nodes = [a]
    try:
        _wait_listening(port, a)
        nodes.append(_node(tmp_path, run, port, "b", nproc=1, **over))
        _wait_for(run, lambda s, e: any(r["step"] >= 3 and r["world_size"] == 2 for r in s),
                  120, nodes)
        seen = len(_changes(_read_live(run)[1]))  # a may have started alone, then grown
        os.killpg(nodes[1].pid, signal.SIGKILL)
        nodes[1].wait()
        _wait_for(run, lambda s, e: len(_changes(e)) > seen, 120, [a])
        nodes[1] = _node(tmp_path, run, port, "b2", nproc=1, **over)
        # grown back within one preflight timeout (60 s) plus a rendezvous: no waiting out
        _wait_for(run, lambda s, e: len(_changes(e)) > seen + 1 and any(
            r["world_size"] == 2 and r["time"] > _changes(e)[-1]["time"] for r in s), 150, nodes)
        (run / "STOP").touch()
        assert a.wait(timeout=120) == 0, _log(tmp_path, "a")[-3000:]
        assert nodes[1].wait(timeout=120) == 0, _log(tmp_path, "b2")[-3000:]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    steps, events = read_metrics(run)
    shrink, grow = _changes(events)[-2:]
    assert (shrink["old"]["world_size"], shrink["new"]["world_size"]) == (2, 1)
    assert (grow["old"]["world_size"], grow["new"]["world_size"]) == (1, 2)
    assert _log(tmp_path, "a").count("preflight ok") >= 2  # rank 0 reports; grown back: ok
    # the lost node is said at the restart, in the console and an event
    assert "node lost: 1 rank(s) of the previous attempt are gone" in " ".join(
        _log(tmp_path, "a").split())
    (lost,) = [e for e in events if e["event"] == "node_lost"]
    assert lost["ranks_lost"] == 1 and lost["hosts_lost"] == {socket.gethostname(): 1}
    assert events[-1]["event"] == "end"
