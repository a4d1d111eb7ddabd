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
    env = dict(os.environ, PY=sys.executable, OUT=str(out), WHEELS=str(out / "no-wheels"),
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
            "train:ac=selective", "train:ac=full", "dispatchers", "deepep",
            "overlap"} <= set(want)
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
    backends = st["dispatchers"]["backends"]
    assert {"allgather", "alltoall", "dedup", "hierarchical"} <= set(backends)
    for name, b in backends.items():
        assert b["max_rel_diff"] < b["limit"], (name, b)
