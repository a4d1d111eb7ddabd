"""Real Slurm: a rendered sbatch script trains the tiny recipe with 2 processes on a one-node
cluster started by the ``slurm_cluster`` fixture; a pre-emption signal makes it checkpoint and
requeue, and the requeued job resumes and finishes. Before any of that, ``slurm render`` and
``submit`` refuse an allocation the recipe cannot start (a world its layout cannot use, a
rank that does not fit the GPU) without writing a script (no cluster needed for those)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epscale.cli import main as cli_main
from epscale.commands.describe import describe
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = ["model.dim=64", "model.num_layers=2", "model.num_heads=4", "model.seq_len=64",
         "model.dense_hidden_dim=128", "moe.hidden_dim=64", "train.micro_batch_size=2",
         "train.warmup_steps=2", "train.eval_every=0", "train.eval_batches=1", "name=slurm"]
STEPS = 80


def _corpus(tmp_path: Path) -> Path:
    import argparse
    import json as json_mod
    import textwrap

    p = tmp_path / "corpus.txt"
    p.write_text("".join(Path(m.__file__).read_text()
                         for m in (argparse, textwrap, json_mod.decoder)))
    return p


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _step(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "heartbeats" / "rank1.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return -1


def test_sbatch_trains_checkpoints_and_resumes_after_preemption(slurm_cluster, tmp_path):
    cluster = slurm_cluster
    run_dir = tmp_path / "run"
    script = tmp_path / "train.sbatch"
    cmd = [sys.executable, "-m", "epscale", "slurm", "submit", TINY, "--nodes", "1",
           "--gpus-per-node", "0", "--procs-per-node", "2",
           "--cpus-per-node", str(min(2, os.cpu_count() or 1)), "--job-name", "epscale-test",
           "--run-dir", str(run_dir), "--max-restarts", "1", "--signal-before", "60",
           "-o", str(script), f"train.steps={STEPS}", "train.ckpt_every=20",
           f"data.source={_corpus(tmp_path)}", *SMALL]
    r = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, cwd=tmp_path,
                       stdin=subprocess.DEVNULL, timeout=120)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    assert job_id.isdigit(), r.stdout
    out_file = run_dir / "slurm" / f"epscale-test-{job_id}.out"

    def diag() -> str:
        text = out_file.read_text(errors="replace")[-3000:] if out_file.exists() else "(none)"
        logs = ""
        for p in sorted((run_dir / "slurm" / job_id).glob("*.log")):
            logs += f"\n--- {p.name}\n" + p.read_text(errors="replace")[-2000:]
        return f"\n--- job output\n{text}{logs}\n{cluster.logs()}"

    # 1. training runs under srun torchrun; pre-empt it once it is past step 3
    deadline = time.monotonic() + 180
    while _step(run_dir) < 3:
        state = cluster.job_state(job_id)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {state}" + diag()
        assert time.monotonic() < deadline, "training did not reach step 3" + diag()
        time.sleep(0.1)
    # What Slurm does --signal-before seconds ahead of the time limit (B: the batch shell)
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)

    # 2. the script checkpoints, exits and requeues; Slurm holds a requeued job back ~2
    #    minutes before it is eligible again, so make it eligible now.
    deadline = time.monotonic() + 180
    while True:
        info = cluster.job_info(job_id)
        if info.get("JobState") == "PENDING" and int(info.get("Restarts", 0)) >= 1:
            break
        assert info.get("JobState") not in ("FAILED", "CANCELLED", "TIMEOUT", "COMPLETED"), \
            f"job ended {info.get('JobState')} instead of requeueing" + diag()
        assert time.monotonic() < deadline, f"job not requeued: {info.get('JobState')}" + diag()
        time.sleep(0.5)
    # ... once the first attempt's processes are gone from the node (slurmd refuses to start a
    # job it is still cleaning up: "Job N already killed, do not launch batch job").
    while cluster.run("sinfo", "-h", "-N", "-o", "%T", "-n", cluster.hostname).stdout.strip() \
            != "idle":
        assert time.monotonic() < deadline, "node did not become idle after the requeue" + diag()
        time.sleep(0.5)
    time.sleep(1)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    state = cluster.wait(job_id, timeout=240)
    info = cluster.job_info(job_id)
    assert state == "COMPLETED" and info["ExitCode"] == "0:0", f"{state} {info}" + diag()

    # 3. the run directory: losses fell, checkpoints were written, the second attempt resumed
    recs = _records(run_dir)
    steps = {m["step"]: m["loss"] for m in recs if "event" not in m and "loss" in m}
    assert sorted(steps) == list(range(1, STEPS + 1)), diag()
    assert steps[STEPS] < steps[1] - 0.3, (steps[1], steps[STEPS])
    ends = [m for m in recs if m.get("event") == "end"]
    resumes = [m for m in recs if m.get("event") == "resume"]
    assert len(ends) == 2 and ends[0]["stopped"] and not ends[1]["stopped"], ends
    stop_step = ends[0]["step"]
    assert 3 <= stop_step < STEPS, "the pre-emption came after the end of training"
    assert [m["step"] for m in resumes] == [stop_step], resumes
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert f"step_{STEPS:08d}" in ckpts, ckpts
    checkpoint_steps = [m["step"] for m in recs if m.get("event") == "checkpoint"]
    assert stop_step in checkpoint_steps, "no checkpoint at the pre-emption step"
    for r in (0, 1):
        beat = json.loads((run_dir / "heartbeats" / f"rank{r}.json").read_text())
        assert beat["rank"] == r and beat["step"] == STEPS

    # 4. logs: Slurm's output plus a directory per job with one log per attempt and node
    text = out_file.read_text()
    assert "SIGUSR1" in text and f"requeueing job {job_id}" in text, text[-2000:]
    # the preflight ran before each attempt and reported both ranks
    assert text.count("preflight: 2 ranks (gloo)") == 2, text[-3000:]
    job_logs = sorted(p.name for p in (run_dir / "slurm" / job_id).glob("attempt*.log"))
    assert job_logs == [f"attempt0-{cluster.hostname}.log",
                        f"attempt1-{cluster.hostname}.log"], job_logs
    assert int(info["Restarts"]) == 1


def test_slurm_submit_reports_sbatch_errors(slurm_cluster, tmp_path):
    """A request the cluster cannot satisfy fails with sbatch's reason, not a job id."""
    # 2 processes: tiny's ep=2 needs an even world (1 rank is refused before sbatch runs)
    r = subprocess.run([sys.executable, "-m", "epscale", "slurm", "submit", TINY,
                        "--partition", "nosuch", "--gpus-per-node", "0", "--procs-per-node", "2",
                        "--run-dir", str(tmp_path / "r"),
                        "-o", str(tmp_path / "x.sbatch")],
                       env=slurm_cluster.env, capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    if r.stdout.strip().isdigit():
        slurm_cluster.run("scancel", r.stdout.strip(), check=False)
    assert r.returncode == 1 and not r.stdout.strip(), r.stdout
    assert "sbatch failed" in r.stderr and "partition" in r.stderr.lower(), r.stderr


def slurm_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["slurm", *args])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("action", ["render", "submit"])
def test_a_world_the_layout_cannot_use_is_refused_before_queueing(tmp_path, action, monkeypatch):
    # an sbatch first on PATH that records being run: the refusal must come before it
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sbatch").write_text(f"#!/bin/sh\necho ran > {tmp_path}/sbatch-ran\n"
                                             "exit 1\n")
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    script = tmp_path / "job.sbatch"
    code, out, err = slurm_cli(action, "ref-1t-64e", "--nodes", "3", "--gpus-per-node", "8",
                               "--run-dir", str(tmp_path / "run"), "-o", str(script))
    assert code == 2 and not out, out
    assert ("--nodes 3 x --gpus-per-node 8 = 24 ranks cannot start ref-1t-64e: config key "
            "'parallel.ep' = 64 is invalid: must divide dp_shard = 12 (the 24 processes / "
            "dp_replicate 2)") in err, err
    # FSDP with 2 replicas of ep=64: the world must be a multiple of 128 ranks
    assert ("Use --nodes 16 or a multiple of it (16 x 8 = 128 ranks; the recipe's "
            "parallel.dp_replicate=2 x parallel.dp_shard=512 is 1024 ranks = --nodes 128)") in err
    assert not script.exists() and not (tmp_path / "sbatch-ran").exists()
    code, _, err = slurm_cli("render", TINY, "--nodes", "3", "--gpus-per-node", "0",
                             "--procs-per-node", "3", "-o", str(script))
    assert code == 2 and "--nodes 3 x --procs-per-node 3 = 9 ranks cannot start tiny" in err


def test_a_rank_that_does_not_fit_the_gpu_is_refused_unless_told(tmp_path):
    script = tmp_path / "job.sbatch"
    base = ["render", "ref-1t-64e", "--nodes", "16", "--gpus-per-node", "8",
            "--run-dir", str(tmp_path / "run"), "-o", str(script)]
    code, _, err = slurm_cli(*base)
    # what describe prints at this world
    total = describe("ref-1t-64e", world=128)["memory"]["total"]
    assert code == 2 and not script.exists(), err
    assert ("note: parallel.dp_replicate=2 x parallel.dp_shard=512 != 128 processes: using "
            "dp_shard=64") in err, err
    assert (f"ref-1t-64e needs about {total / 2 ** 30:,.1f} GiB per rank (HSDP dp_replicate=2 x "
            "dp_shard=64 (ep=64, efsdp=1)" in err and "more than --gpu-mem 80GiB" in err), err
    assert "describe ref-1t-64e --world 128 --ep 64, or --fit 80GiB" in err
    assert "run on more nodes" in err and "add --no-memory-check" in err
    code, out, err = slurm_cli(*base, "--no-memory-check")
    assert code == 0 and out.strip() == str(script) and script.is_file(), err
    assert slurm_cli(*base, "--gpu-mem", "600GiB")[0] == 0
    code, _, err = slurm_cli(*base, "--gpu-mem", "80")
    assert code == 2 and "--gpu-mem = '80' is invalid: give a positive size with a unit" in err
    # the recipe's own world fits
    code, _, err = slurm_cli("render", "ref-1t-64e", "--nodes", "128", "--gpus-per-node", "8",
                             "--run-dir", str(tmp_path / "big"), "-o", str(tmp_path / "b"))
    assert code == 0, err
    # a recipe that fits: switch-base-128 (a few GiB per rank) on 16 nodes of 8 GPUs
    code, _, err = slurm_cli("render", "switch-base-128", "--nodes", "16", "--gpus-per-node",
                             "8", "--run-dir", str(tmp_path / "sw"), "-o", str(tmp_path / "s"))
    assert code == 0, err


pytestmark = pytest.mark.timeout(900)
