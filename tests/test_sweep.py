"""epscale sweep: grid expansion, Pareto front and recommendation, and real end-to-end
sweeps (layer benchmarks and short training runs as separate processes) that resume."""

from __future__ import annotations

import json

import pytest

from epscale.cli import main as cli_main
from epscale.config import load_recipe
from epscale.tune.sweep import expand_grid, load_results, pareto_front, recommend


def test_expand_grid_skips_invalid_points_with_reasons():
    base = load_recipe("deepseek-v3", ["scale=tiny"])       # 64 experts, 8 groups, top-8
    pts, skipped = expand_grid(base, [4, 8, 64], [None, 1.25], [2, 8], ["dedup"], nproc=2)
    ids = {p.id for p in pts}
    assert "E64-cfnone-k8-dedup" in ids and "E8-cf1.25-k2-dedup" in ids
    reasons = {p.id: why for p, why in skipped}
    assert "top_k" in reasons["E4-cfnone-k8-dedup"]          # 8 > 4 experts
    _, skipped1 = expand_grid(base, [3], [None], [1], ["hierarchical"], nproc=1)
    assert "needs more than one process" in skipped1[0][1]
    _, skipped2 = expand_grid(base, [6], [None], [2], ["dedup"], nproc=4)
    assert "do not divide over 4" in skipped2[0][1]


def _r(id_, tps, loss, cf=None, dropped=0.0):
    return {"id": id_, "status": "ok", "tokens_per_s": tps, "loss": loss, "capacity_factor": cf,
            "dropped_frac": dropped, "max_vio": 0.1, "peak_mem_mb": 100.0}


def test_pareto_and_recommendation():
    res = [_r("a", 100, 2.00), _r("b", 200, 2.01), _r("c", 300, 2.30, cf=1.0, dropped=0.05),
           _r("d", 150, 2.05), {"id": "e", "status": "failed", "error": "x"}]
    assert [r["id"] for r in pareto_front(res)] == ["a", "b", "c"]      # d is dominated by b
    pick, reasons = recommend(res, loss_tolerance=0.02)
    assert pick["id"] == "b"                                             # c is faster but worse
    assert any("fastest point overall, c" in r for r in reasons)
    pick2, _ = recommend(res, loss_tolerance=0.2)
    assert pick2["id"] == "c"
    assert recommend([{"id": "e", "status": "failed"}])[0] is None


def test_layer_sweep_runs_points_in_processes_and_resumes(tmp_path, capsys):
    d = tmp_path / "sw"
    common = ["sweep", "mixtral-8x7b", "--dir", str(d), "--mode", "layer", "--steps", "3",
              "--capacity", "none", "scale=tiny", "train.micro_batch_size=1"]
    assert cli_main(common + ["--experts", "4"]) == 0
    out = capsys.readouterr().out
    assert "0 already measured" in out and "recommendation" in out
    res = load_results(d)
    assert [r["id"] for r in res] == ["E4-cfnone-k2-dedup"]
    for r in res:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["peak_mem_mb"] > 10
        assert r["dropped_frac"] == 0.0 and r["max_vio"] >= 0 and r["loss"] > 0
        assert (d / "points" / r["id"] / "result.json").is_file()
    assert (d / "pareto.png").stat().st_size > 5000
    rec = json.loads((d / "recommendation.json").read_text())
    assert rec["recommended"]["id"] in {r["id"] for r in res}
    # resume: the measured point is kept, only the new one runs
    assert cli_main(common + ["--experts", "4,8"]) == 0
    assert "1 already measured" in capsys.readouterr().out
    assert [r["id"] for r in load_results(d)] == ["E4-cfnone-k2-dedup", "E8-cfnone-k2-dedup"]
    assert cli_main(common[:7] + ["4"] + common[8:] + ["--experts", "4"]) == 2
    assert "holds a different sweep (steps: was 3, now 4)" in capsys.readouterr().err


def test_capacity_drops_are_reported(tmp_path, capsys):
    d = tmp_path / "cap"
    assert cli_main(["sweep", "switch-base-128", "--dir", str(d), "--mode", "layer", "--steps", "2",
                     "--experts", "8", "--capacity", "0.5", "scale=tiny",
                     "train.micro_batch_size=1"]) == 0
    (r,) = load_results(d)
    # capacity 0.5 keeps at most half of the assignments
    assert r["status"] == "ok" and r["dropped_frac"] >= 0.5 - 1e-9


def test_train_sweep_point_reads_the_run(tmp_path, capsys):
    d = tmp_path / "tr"
    assert cli_main(["sweep", "qwen3-30b-a3b", "--dir", str(d), "--mode", "train", "--steps", "3",
                     "--experts", "8", "--top-k", "2", "scale=tiny",
                     "train.micro_batch_size=1"]) == 0
    (r,) = load_results(d)
    assert r["status"] == "ok", r
    assert r["steps"] == 3 and r["loss"] > 0 and r["tokens_per_s"] > 0 and r["peak_mem_mb"] > 10
    metrics = (d / "points" / r["id"] / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in metrics if '"loss"' in line and '"event"' not in line]
    assert r["loss"] == pytest.approx(sum(losses[-3:]) / 3)
    cfg = (d / "points" / r["id"] / "run" / "config.yaml").read_text()
    assert "num_experts: 8" in cfg and "top_k: 2" in cfg
