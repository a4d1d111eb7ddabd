"""`monitor` streams metrics.jsonl (issue #30, finding 8): the file is parsed a block at
a time, and `--check` keeps only what the alert rules read of a long run's older records.
The slimmed run must give the same alerts as the whole one on every scenario the rules
know; damaged lines inside a block are still skipped one by one, with their line numbers.
(Time and memory on a 100 MB file: benchmarks/monitor_large.py, benchmarks/RESULTS.md.)"""

from __future__ import annotations

import dataclasses
import json

import pytest

from epscale.monitor import evaluate, load_run
from epscale.monitor import runlog
from epscale.monitor.alerts import CHECK_FIELDS, AlertRules
from epscale.monitor.report import build_data
from epscale.monitor.report_stream import ReportSeries
from runfactory import make_run

SCENARIOS = {
    "healthy": {}, "collapse": {"collapse_layer": 1, "collapse_from": 20},
    "dead": {"dead": {0: [3, 5]}, "dead_from": 10},
    "straggler": {"straggler_rank": 1, "straggler_from": 15, "dp": 2},
    "nan_spike": {"nan_at": (40, 41), "spike_at": (50,)}, "slow": {"slow_from": 70},
    "drops_comm_bias": {"drop_frac": 0.2, "comm_share": 0.7, "bias_growth": 0.05},
    "layout": {"layout_change_at": (30, 45)}, "minimal": {"minimal": True, "collapse_layer": 0},
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_check_gives_the_same_alerts_on_the_slimmed_records(tmp_path, name):
    run = make_run(tmp_path / name, steps=80, **SCENARIOS[name])
    whole = load_run(run)
    slim = load_run(run, fields=dataclasses.replace(CHECK_FIELDS, full_tail=5))
    assert len(slim.steps) == len(whole.steps) and slim.events == whole.events
    assert "time_breakdown" not in slim.steps[0] and len(slim.steps[-1]) == len(whole.steps[-1])
    now = whole.steps[-1]["time"] + 10
    lines = [a.line() for a in evaluate(whole, now=now)]
    assert [a.line() for a in evaluate(slim, now=now)] == lines
    if name != "healthy":
        assert lines, "the scenario must fire a rule, or the comparison proves nothing"


def test_damaged_lines_in_a_streamed_block_are_skipped_by_number(tmp_path, monkeypatch):
    monkeypatch.setattr(runlog, "BLOCK_BYTES", 300)  # several blocks, lines cut across them
    run = make_run(tmp_path / "r", steps=30, truncate_last=True)
    path = run / "metrics.jsonl"
    lines = path.read_text().split("\n")
    lines[5], lines[12] = "{not json", "[1, 2]"
    path.write_text("\n".join(lines))
    for fields in (None, dataclasses.replace(CHECK_FIELDS, full_tail=3)):
        log = load_run(run, fields=fields)
        assert log.warnings == ["metrics.jsonl line 6 is not a JSON object; skipped",
                                "metrics.jsonl line 13 is not a JSON object; skipped",
                                f"metrics.jsonl line {len(lines)} is truncated (the run stopped "
                                "mid-write?); skipped"]
        kept = [json.loads(x)["step"] for i, x in enumerate(lines[:-1])
                if i not in (5, 12) and "event" not in x]
        assert [r["step"] for r in log.steps] == sorted(set(kept))


# ---------------------------------------------------------------------- the report


def _streamed(run, max_points, tail=2000):
    """The report's reading: one pass, slim records for the rules, series on the side."""
    series = ReportSeries(run, max_points, tail=tail)
    log = load_run(run, observe=series.add)
    return log, series, series.finish(log)


def test_streamed_report_equals_the_whole_file_report_when_nothing_is_downsampled(tmp_path):
    run = make_run(tmp_path / "r", steps=80, straggler_rank=1, straggler_from=15, dp=2,
                   layout_change_at=(30, 45), spike_at=(50,), drop_frac=0.1)
    whole = load_run(run)
    log, _series, plotted = _streamed(run, max_points=1000)
    now = whole.steps[-1]["time"] + 10
    alerts = evaluate(whole, now=now)
    assert [a.line() for a in evaluate(log, now=now)] == [a.line() for a in alerts]
    assert build_data(log, alerts, AlertRules(), series=plotted) == \
        build_data(whole, alerts, AlertRules())
    assert log.steps[-1] == whole.steps[-1] and log.events == whole.events
    assert "loss_max" not in plotted["scalars"]  # nothing bucketed


def test_streamed_downsampling_keeps_a_spike_visible(tmp_path):
    run = make_run(tmp_path / "s", steps=400, spike_at=(203,), dp=2)
    whole = load_run(run)
    log, series, plotted = _streamed(run, max_points=20, tail=30)
    assert series.k > 1 and len(series.parts) > 1  # reduced while streaming
    data = build_data(log, [], AlertRules(), series=plotted)
    assert 10 < len(data["x"]) <= 20 and data["x"][-1] == whole.steps[-1]["step"]
    assert len(data["scalars"]["loss"]) == len(data["x"]) == len(data["ranks"]["time"][0])
    assert all(len(L["load"]) == len(data["layer_x"]) for L in data["layers"])
    spike = next(r["loss"] for r in whole.steps if r["step"] == 203)
    i = next(i for i, x in enumerate(data["x"]) if x >= 203)  # the spike's bucket
    assert data["scalars"]["loss_max"][i] == spike
    assert data["scalars"]["loss"][i] < 0.6 * spike  # the bucket mean alone hides it
    assert log.steps[-1] == whole.steps[-1] and len(log.steps) == len(whole.steps)


def test_streamed_report_follows_a_rollback(tmp_path):
    run = make_run(tmp_path / "b", steps=400)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    again = [ln for ln in lines if '"event"' not in ln and json.loads(ln)["step"] >= 100]
    with open(run / "metrics.jsonl", "a") as f:  # resumed from step 99: steps 100.. again
        f.write("\n".join(again) + "\n")
    whole = load_run(run)
    for tail, dropped in ((400, False), (30, True)):  # within the whole tail / beyond it
        log, series, plotted = _streamed(run, max_points=20, tail=tail)
        assert [r["step"] for r in log.steps] == [r["step"] for r in whole.steps]
        assert plotted["x"] == sorted(set(plotted["x"])) and plotted["x"][-1] == 400
        assert (series.dropped_buckets > 0) == dropped
        assert any("rollback reached" in w for w in log.warnings) == dropped
