"""benchmarks/gpu_check.sh --dry-run: every stage of the GPU check runs on CPU in CI size,
so that the script cannot rot before a GPU is available (issue #31).

One run of the script (a few CPU seconds per stage); its JSON must hold every stage of the
driver's list with a result: 'ok', or 'skipped' with the reason (DeepEP and
benchmarks/overlap.py where they are missing), never 'failed' or 'timeout'; and the
figures each stage promises.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    # one thread per process, as in every test (conftest.py): two would contend for the
    # cores with the other pytest worker (the dry run took 1.5x as long under load)
    env = dict(os.environ, PY=sys.executable, OUT=str(out), WHEELS=str(out / "no-wheels"),
               OMP_NUM_THREADS=os.environ.get("EPSCALE_TEST_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)
    path = out / "gpu_check.json"
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(path.read_text())


@pytest.mark.cpu_only
def test_every_stage_has_a_result(dry_run):
    proc, report = dry_run
    mod = _driver()
    want = [s.name for s in mod.stages(mod.has_train_compile(), dry=True)]
    assert {"grouped_gemm", "layer:deepseek-like", "layer:mixtral-like", "train:ac=none",
            "train:ac=selective", "train:ac=full", "train:light-fp8-mtp", "dispatchers",
            "deepep", "overlap"} <= set(want)
    assert list(report["stages"]) == want
    assert report["dry_run"] is True and report["environment"]["device"] == "cpu"
    for name, r in report["stages"].items():
        assert r["status"] in ("ok", "skipped"), (name, r.get("error"), r.get("traceback"))
        if r["status"] == "skipped":
            assert name in ("deepep", "overlap") and r["reason"], (name, r)
        assert r["seconds"] >= 0 and r["headline"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    # the one table names every stage
    table = proc.stdout[proc.stdout.index("== gpu_check --dry-run"):]
    assert all(name in table for name in want)


@pytest.mark.cpu_only
def test_the_stages_report_their_figures(dry_run):
    _, report = dry_run
    st = report["stages"]
    g = st["grouped_gemm"]
    assert g["host_syncs"] == 0 and g["rel_diff_vs_fp32"] < 5e-2 and g["grouped_ms"] > 0
    for name in ("layer:deepseek-like", "layer:mixtral-like"):
        assert st[name]["epscale_tokens_per_s"] > 0
        assert "vs_torchtitan" in st[name] or st[name]["torchtitan"].startswith("unavailable")
    for name, r in st.items():
        if not name.startswith("train:"):
            continue
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1, (name, r)
        assert r["time_breakdown_s"]["forward"] >= 0 and "backward" in r["time_breakdown_s"]
        assert isinstance(r["host_syncs_per_step"], int)
        assert r["describe_memory"]["total"] > 0
        assert "parallel.fsdp=true" in r["overrides"] and "train.dtype=bfloat16" in r["overrides"]
    assert st["train:light-fp8-mtp"]["final_mtp_loss"] > 0
    assert st["train:ac=none"]["final_mtp_loss"] is None
    backends = st["dispatchers"]["backends"]
    assert {"allgather", "alltoall", "dedup", "hierarchical"} <= set(backends)
    for name, b in backends.items():
        assert b["max_rel_diff"] < b["limit"], (name, b)


def test_the_sync_counter_sees_each_kind_and_skips_host_only_reads_when_asked():
    """epscale.metrics.host_syncs (what the GPU check counts a step's syncs with): every
    kind of sync on CPU tensors standing in for device ones, in backward too; with
    count_cpu=False (on a GPU) a read of a CPU tensor is no sync."""
    import torch

    from epscale.metrics.host_syncs import HostSyncCounter, by_place

    x = torch.arange(6)
    cases = [(lambda: x.tolist(), "tolist"), (lambda: x.sum().item(), "item"),
             (lambda: bool(x[0]), "_local_scalar_dense"), (lambda: x.nonzero(), "nonzero"),
             (lambda: x[x > 2], "index with a bool mask"),
             (lambda: torch.repeat_interleave(x, x), "repeat_interleave without output_size"),
             (lambda: torch.tensor([1], device=x.device), "tensor(host data, device=...)")]
    for fn, what in cases:
        with HostSyncCounter() as c:
            fn()
        assert [e[0] for e in c.events] == [what], (what, c.events)
        with HostSyncCounter(count_cpu=False) as c:
            fn()
        assert c.events == [], (what, c.events)

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            g.sum().item()
            return g * 2

    t = torch.ones(3, requires_grad=True)
    with HostSyncCounter() as c:
        ReadsInBackward.apply(t).sum().backward()
    assert [e[0] for e in c.events] == ["item"]
    assert by_place(c.events + c.events) == {f"item at {c.events[0][1]}": 2}
    with HostSyncCounter() as c:   # sized on the host: none
        torch.repeat_interleave(x, 2)
        x.index_select(0, x[:2])
    assert c.events == [] and "wrapper" not in repr(torch.Tensor.tolist)
