"""Launch pieces: the local torchrun command, the sbatch script, preflight (2 gloo ranks)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from epscale.cli import main as cli_main
from epscale.config import ConfigError
from epscale.launch import slurm
from epscale.launch.local import launch_command
from epscale.launch.preflight import PreflightError, RankResult, find_slow

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


# ------------------------------------------------------------------ local launch


def test_launch_command_runs_torchrun_agent_with_restarts(capsys):
    rc = cli_main(["launch", "--nproc", "2", TINY, "--max-restarts", "5", "--run-dir", "/tmp/x",
                   "--dry-run", "train.steps=7"])
    assert rc == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[1:3] == ["-m", "epscale.launch.agent"]
    assert "--nproc-per-node=2" in cmd and "--max-restarts=5" in cmd and "--standalone" in cmd
    tail = cmd[cmd.index("epscale"):]  # "-m epscale train ..." after the torchrun options
    assert tail[:4] == ["epscale", "train", "--config", TINY]
    assert "--run-dir" in tail and "/tmp/x" in tail and tail[-1] == "train.steps=7"


def test_launch_rejects_bad_values(capsys):
    with pytest.raises(ConfigError, match="--nproc = 0 is invalid"):
        launch_command(TINY, nproc=0)
    with pytest.raises(ConfigError, match="--max-restarts = -1"):
        launch_command(TINY, nproc=1, max_restarts=-1)
    assert cli_main(["launch", "--nproc", "2", "nope.yaml", "--dry-run"]) == 2
    assert "config file 'nope.yaml' does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------ sbatch script


def _job(tmp_path, **kw):
    kw.setdefault("gpus_per_node", 8)
    return slurm.SlurmJob(config=TINY, chdir=str(tmp_path), **kw)


def test_render_gpu_script(tmp_path):
    job = _job(tmp_path, nodes=4, partition="gpu", time="1-00:00:00", exclude="node[03,17]",
               signal_before=600, max_restarts=2, overrides=["train.steps=50"])
    text = slurm.render(job)
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=1-00:00:00",
                 "#SBATCH --exclude=node[03,17]", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@600", "#SBATCH --exclusive"):
        assert line in text, line
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert "RDZV_PORT=$((20000 + SLURM_JOB_ID % 20000))" in text
    assert "srun --kill-on-bad-exit=1" in text
    assert '--rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT"' in text
    assert "--nnodes=4 --nproc-per-node=8" in text and "--max-restarts=2" in text
    assert "scontrol requeue" in text and "trap on_usr1 USR1" in text
    assert f"LOG_DIR={tmp_path}/runs/epscale-tiny/slurm/${{SLURM_JOB_ID}}" in text
    # every NCCL preset is exported with a comment that explains it
    for name in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_ENABLE_MONITORING"):
        assert re.search(rf"# {name}: \S.*\nexport {name}=", text), name
    assert "train.steps=50" in text and "-m epscale train --config" in text
    assert "-m epscale preflight" in text  # before training, on every rank
    assert text.index("-m epscale preflight") < text.index("-m epscale train")
    assert "-m epscale preflight" not in slurm.render(_job(tmp_path, preflight=False))
    if shutil.which("bash"):
        p = tmp_path / "job.sbatch"
        p.write_text(text)
        r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_render_cpu_mode_has_no_gpu_request(tmp_path):
    text = slurm.render(_job(tmp_path, gpus_per_node=0, procs_per_node=2))
    assert "--gpus" not in text and "--gres" not in text and "NCCL_IB_HCA" not in text
    assert "--exclusive" not in text
    assert "--nproc-per-node=2" in text and "GLOO_SOCKET_IFNAME" in text


def test_render_elastic_script(tmp_path, capsys):
    """--min-nodes: the job and its step survive a node (--no-kill), torchrun's rendezvous
    runs MIN:MAX with the rejoin window, the full allocation's global batch is pinned; the
    node counts it can shrink to are printed, and the script is valid bash."""
    job = _job(tmp_path, nodes=4, min_nodes=2, gpus_per_node=0, procs_per_node=2,
               rejoin_timeout=45, overrides=["train.micro_batch_size=2"])
    text = slurm.render(job)
    assert "#SBATCH --no-kill" in text and "srun --no-kill --kill-on-bad-exit=0" in text
    assert "--nnodes=2:4 --nproc-per-node=2" in text  # training; the preflight needs all 4
    assert "--nnodes=4 --nproc-per-node=2" in text
    assert "--rdzv-conf=last_call_timeout=45" in text
    assert "train.grad_accum=1 train.global_batch_size=16" in text  # 4 x 2 x 1 x 2
    plain = slurm.render(_job(tmp_path, nodes=4, gpus_per_node=0, procs_per_node=2))
    assert "#SBATCH --no-kill" not in plain and "srun --kill-on-bad-exit=1" in plain
    assert "--rdzv-conf" not in plain and "global_batch_size" not in plain
    out = tmp_path / "e.sbatch"
    assert cli_main(["slurm", "render", TINY, "--nodes", "4", "--min-nodes", "2",
                     "--gpus-per-node", "0", "--procs-per-node", "2", "-o", str(out),
                     "--run-dir", str(tmp_path / "run"), "parallel.ep=4"]) == 0
    err = capsys.readouterr().err
    assert "elastic over 2..4 nodes x 2 process(es)" in err and "trains at 4, 2 node(s)" in err
    assert "not at 3 node(s): config key 'parallel.ep' = 4 is invalid" in err
    r = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("kw, match", [
    (dict(nodes=2, min_nodes=3), "--min-nodes = 3 is invalid: must be an integer in [1, "
                                 "--nodes = 2]"),
    (dict(time="1:00:00", signal_before=3600), "--signal-before = 3600 is invalid: must be "
                                               "shorter than the time limit"),
    (dict(time="soon"), "--time = 'soon' is invalid"),
    (dict(procs_per_node=9), "--procs-per-node = 9 is invalid: at most --gpus-per-node"),
    (dict(nodes=0), "--nodes = 0 is invalid"),
    (dict(partition="a b"), "--partition = 'a b' is invalid"),
    (dict(overrides=["moe.top_k=99"]), "moe.top_k"),
])
def test_render_validates(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        _job(tmp_path, **kw)


def test_time_limit_parsing():
    assert slurm.time_limit_seconds("90") == 5400
    assert slurm.time_limit_seconds("10:30") == 630
    assert slurm.time_limit_seconds("2:00:00") == 7200
    assert slurm.time_limit_seconds("1-12") == 36 * 3600
    assert slurm.time_limit_seconds("1-00:00:10") == 86410


def test_slurm_render_cli_writes_script(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    rc = cli_main(["slurm", "render", TINY, "--nodes", "2", "--gpus-per-node", "0",
                   "--procs-per-node", "2", "-o", str(out), "--run-dir", str(tmp_path / "run"),
                   "train.steps=5"])
    assert rc == 0 and capsys.readouterr().out.strip() == str(out)
    assert os.access(out, os.X_OK) and "train.steps=5" in out.read_text()
    assert (tmp_path / "run" / "slurm").is_dir()  # sbatch --output needs the directory


# ------------------------------------------------------------------ preflight


def test_find_slow_names_rank_and_host():
    res = [RankResult(r, f"h{r}", 0.1, 1.0, 1.0, 1.0) for r in range(4)]
    assert find_slow(res) == []
    res[2] = RankResult(2, "h2", 0.1, 80.0, 1.0, 1.0)
    [(rank, host, why)] = find_slow(res)
    assert (rank, host) == (2, "h2") and "80.0 ms" in why


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _preflight_worker(rank, world, port, mode, out_q):
    import datetime

    import torch.distributed as dist

    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from epscale.launch.preflight import run_preflight

    try:
        if mode == "missing" and rank == 1:
            import time

            time.sleep(6)  # never joins the check; rank 0 reports it after 3 s
            out_q.put((rank, "absent", None))
            out_q.close()
            out_q.join_thread()  # os._exit would drop what the feeder thread has not sent
            os._exit(0)
        # 1 s of extra local work per round: far above the noise of a busy 2-core machine
        report = run_preflight(timeout_s=3 if mode == "missing" else 30, iters=2,
                               numel=1024, delay_s=1.0 if (mode == "slow" and rank == 1) else 0)
        out_q.put((rank, "ok", (report.slow, report.format())))
        dist.barrier()
        dist.destroy_process_group()
    except PreflightError as e:
        out_q.put((rank, "error", str(e)))
        out_q.close()
        out_q.join_thread()
        os._exit(0)


def _run_preflight(mode):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_preflight_worker, args=(r, 2, port, mode, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, status, payload = q.get(timeout=120)
        out[rank] = (status, payload)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    return out


def test_preflight_passes_and_flags_a_slow_rank():
    host = socket.gethostname()
    out = _run_preflight("slow")
    assert out[0][0] == out[1][0] == "ok"
    slow, text = out[0][1]
    assert [(r, h) for r, h, _ in slow] == [(1, host)], text
    assert f"SLOW rank 1 on host {host}" in text and "all_to_all ms" in text


def test_preflight_reports_a_missing_rank_by_rank_and_host():
    out = _run_preflight("missing")
    status, msg = out[0]
    assert status == "error"
    assert "did not join the check within 3 s" in msg and "rank 1 on host" in msg
    assert socket.gethostname() in msg  # rank 1's node is known from rank 0 (same node)


def test_preflight_command_under_torchrun():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", "-m", "epscale", "preflight", "--iters", "2",
                        "--numel", "512", "--timeout", "30"],
                       capture_output=True, text=True, timeout=240, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]  # slow ranks are reported, not fatal by default
    assert "preflight: 2 ranks (gloo)" in r.stdout, r.stdout + r.stderr[-2000:]


def test_elastic_launch_pins_the_batch_of_the_data_parallel_ranks():
    """An elastic launch pins the largest layout's global batch; under a pipeline the
    stages share their micro-batches, so the batch counts data-parallel ranks (world / pp),
    which is what the trainer's layout derives grad_accum from."""
    from epscale.config import load_config
    from epscale.launch.local import pin_global_batch
    from epscale.plan.layout import Layout

    cfg = load_config(TINY, ["parallel.pp=2", "parallel.ep=1", "model.tie_embeddings=false",
                                            "train.grad_accum=4", "train.micro_batch_size=2"])
    pinned, overrides = pin_global_batch(cfg, 8)
    assert overrides == ["train.grad_accum=1", "train.global_batch_size=32"]
    lay = Layout.from_config(pinned, 8)
    assert lay.global_batch == 32 and lay.micro_batches == 4
