"""epscale.metrics: step timers, the one-collective step statistics, and the sinks."""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import pytest
import torch
from torch import nn

import epscale
from epscale.metrics import (STANDARD_SECTIONS, JsonlSink, MetricsWriter, PrometheusSink, Sink,
                             StepStatsCollector, StepTimers, comm_share,
                             flops_per_token, max_vio, mfu, peak_flops, rank_loads)
from epscale.metrics import timers as timers_mod
from epscale.moe.layer import named_moe_layers

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- timers


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(timers_mod.time, "perf_counter", c)
    return c


def test_timers_nested_exclusive_and_inclusive(clock):
    t = StepTimers()
    with t.section("forward"):
        clock.advance(1.0)
        with t.section("router"):
            clock.advance(0.25)
        with t.section("experts"):
            clock.advance(2.0)
            with t.section("experts"):  # re-entered: counted once
                clock.advance(0.5)
        clock.advance(0.75)
    with t.section("backward"):
        clock.advance(3.0)
    inc = t.totals(inclusive=True)
    exc = t.totals()
    assert inc["forward"] == pytest.approx(4.5)
    assert inc["experts"] == pytest.approx(2.5)
    assert exc["forward"] == pytest.approx(1.75)  # 4.5 - 0.25 - 2.5
    assert exc["router"] == pytest.approx(0.25)
    assert exc["experts"] == pytest.approx(2.5)
    assert exc["backward"] == pytest.approx(3.0)
    assert sum(exc.values()) == pytest.approx(7.5)  # exclusive times add up to the wall time
    bd = t.breakdown()
    assert list(bd)[: len(STANDARD_SECTIONS)] == list(STANDARD_SECTIONS)
    assert bd["sync"] == 0.0 and bd["forward"] == pytest.approx(1.75)
    t.reset()
    assert t.totals() == {}


def test_timers_exception_unwinds_and_disabled_is_noop(clock):
    t = StepTimers()
    with pytest.raises(RuntimeError):
        with t.section("forward"):
            clock.advance(1.0)
            with t.section("dispatch"):
                clock.advance(2.0)
                raise RuntimeError("boom")
    with t.section("optimizer"):
        clock.advance(1.0)
    exc = t.totals()
    assert exc == pytest.approx({"forward": 1.0, "dispatch": 2.0, "optimizer": 1.0})
    off = StepTimers(enabled=False)
    with off.section("forward"):
        clock.advance(1.0)
    assert off.totals() == {} and off.section("a") is off.section("b")


def test_comm_share():
    bd = {"dispatch": 0.1, "combine": 0.2, "sync": 0.1, "experts": 1.0}
    assert comm_share(bd, 2.0) == pytest.approx(0.2)
    assert comm_share(bd, 0.0) == 0.0
    assert comm_share(bd, 0.1) == 1.0  # clamped


def test_timer_hooks_into_moe_layer():
    cfg = epscale.MoEConfig(dim=16, hidden_dim=32, num_experts=4, top_k=2)
    moe = epscale.MoE(cfg)
    t = StepTimers()
    moe.timer = t.section
    with t.section("forward"):
        moe(torch.randn(32, 16))
    tot = t.totals(inclusive=True)
    for name in ("router", "experts", "combine"):
        assert tot[name] > 0, name
    assert tot["forward"] >= tot["router"] + tot["experts"]


# ---------------------------------------------------------------------- step statistics


class TwoMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"proj": nn.Linear(cfg.dim, cfg.dim),
                                                    "moe": epscale.MoE(cfg)}) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b["moe"](b["proj"](x))
        return x


def _cfg(**kw):
    base = dict(dim=16, hidden_dim=32, num_experts=8, top_k=2)
    base.update(kw)
    return epscale.MoEConfig(**base)


def test_moe_layer_ids_from_names():
    m = TwoMoE(_cfg())
    assert [(i, n) for i, n, _ in named_moe_layers(m)] == [(0, "blocks.0.moe"), (1, "blocks.1.moe")]
    solo = epscale.MoE(_cfg())
    assert [(i, n) for i, n, _ in named_moe_layers(solo)] == [(0, "")]


def test_record_counts_every_training_forward_and_skips_eval():
    torch.manual_seed(0)
    m = TwoMoE(_cfg(capacity_factor=1.0))
    col = StepStatsCollector(m, ep=2, dead_after_steps=3)
    expected = [torch.zeros(8, dtype=torch.long) for _ in range(2)]
    dropped = [0, 0]
    for _ in range(3):  # three micro-batches of one step
        m(torch.randn(2, 24, 16))
        for i, (_lid, _n, moe) in enumerate(col.layers):
            expected[i] += moe.last_stats["tokens_per_expert"]
            dropped[i] += moe.last_stats["num_dropped"]
    m.eval()
    m(torch.randn(2, 24, 16))  # validation: not counted
    m.train()
    rec = col.record(7, step_time_s=0.5, num_tokens=144, loss=torch.tensor(2.5), lr=1e-3,
                     grad_norm=0.7, breakdown={"forward": 0.2, "dispatch": 0.05, "sync": 0.05},
                     mem_mb=123.0, extra={"val_loss": 2.7})
    assert rec["step"] == 7 and rec["loss"] == pytest.approx(2.5) and rec["val_loss"] == 2.7
    assert rec["tokens_per_s"] == pytest.approx(288.0) and rec["tokens_per_s_per_proc"] == pytest.approx(288.0)
    assert rec["comm_share"] == pytest.approx(0.2)
    assert rec["rank_step_time_s"] == [0.5] and rec["mem_mb"] == 123.0
    assert json.loads(json.dumps(rec)) == rec  # plain JSON types only
    total_assign = total_drop = 0
    for i, lay in enumerate(rec["layers"]):
        counts = expected[i].tolist()
        assert lay["layer"] == i and lay["tokens_per_expert"] == counts
        assert sum(counts) == 3 * 48 * 2
        assert lay["rank_load"] == [sum(counts[:4]), sum(counts[4:])]
        assert lay["max_vio"] == pytest.approx(max(counts) / (sum(counts) / 8) - 1)
        assert lay["dropped_frac"] == pytest.approx(dropped[i] / (3 * 48 * 2))
        assert 0 < lay["router_entropy"] <= math.log(8) + 1e-6
        peak = max(lay["rank_load"])
        assert lay["rank_idle"] == pytest.approx([1 - x / peak for x in lay["rank_load"]])
        total_assign += 3 * 48 * 2
        total_drop += dropped[i]
    assert rec["dropped_frac"] == pytest.approx(total_drop / total_assign)
    assert rec["max_vio"] == max(lay["max_vio"] for lay in rec["layers"])
    # the counters restart after each record
    m(torch.randn(2, 24, 16))
    rec2 = col.record(8, step_time_s=0.5, num_tokens=48)
    assert sum(rec2["layers"][0]["tokens_per_expert"]) == 48 * 2
    assert "loss" not in rec2 and "grad_norm" not in rec2


def test_collapsed_router_shows_dead_experts_and_bias_range():
    m = TwoMoE(_cfg(top_k=1))
    col = StepStatsCollector(m, ep=4, dead_after_steps=3)
    with torch.no_grad():
        moe = col.layers[1][2]
        moe.router.gate.weight.zero_()
        moe.router.expert_bias.copy_(torch.tensor([0.0, 0, 0, 5.0, 0, 0, 0, -1.0]))
    recs = []
    for step in range(1, 5):
        m(torch.randn(40, 16))
        recs.append(col.record(step, step_time_s=0.1, num_tokens=40))
    lay = recs[-1]["layers"][1]
    assert lay["tokens_per_expert"] == [0, 0, 0, 40, 0, 0, 0, 0]
    assert lay["max_vio"] == pytest.approx(7.0)
    assert lay["rank_load"] == [0, 40, 0, 0]
    assert lay["rank_idle"] == [1.0, 0.0, 1.0, 1.0]
    assert lay["bias_min"] == -1.0 and lay["bias_max"] == 5.0
    assert recs[1]["layers"][1]["dead_experts"] == []  # 2 records < dead_after_steps
    assert recs[2]["layers"][1]["dead_experts"] == [0, 1, 2, 4, 5, 6, 7]
    assert recs[-1]["worst_rank_idle"] >= 0.5
    col.close()
    m(torch.randn(4, 16))
    assert sum(col.record(5, step_time_s=0.1, num_tokens=4)["layers"][0]["tokens_per_expert"]) == 0


def test_collector_validates_arguments():
    m = TwoMoE(_cfg())
    with pytest.raises(ValueError, match=r"parallel.ep. = 3 is invalid: must divide moe.num_experts \(8\)"):
        StepStatsCollector(m, ep=3)
    with pytest.raises(ValueError, match="expert_to_rank"):
        StepStatsCollector(m, ep=2, expert_to_rank=[0, 1, 2, 0, 1, 0, 1, 0])
    col = StepStatsCollector(m, ep=2, expert_to_rank=[1, 1, 0, 0, 1, 0, 1, 0])
    assert col.expert_to_rank[0].tolist() == [1, 1, 0, 0, 1, 0, 1, 0]


def test_helpers():
    assert max_vio([2, 2, 2, 2]) == 0.0
    assert max_vio([8, 0, 0, 0]) == pytest.approx(3.0)
    assert max_vio([0, 0]) == 0.0
    assert rank_loads([1, 2, 3, 4], [0, 0, 1, 1], 2) == [3, 7]
    assert mfu(1000.0, 6e6, 1e12) == pytest.approx(0.006)
    assert mfu(1000.0, 0.0, 1e12) == 0.0


def test_flops_and_peak(monkeypatch):
    from epscale.config import RunConfig
    from epscale.plan.sizing import model_size

    cfg = RunConfig()
    assert flops_per_token(cfg) == model_size(cfg).flops_per_token > 0
    monkeypatch.setenv("EPSCALE_PEAK_FLOPS", "2e12")
    assert peak_flops("cpu") == 2e12
    monkeypatch.setenv("EPSCALE_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="EPSCALE_PEAK_FLOPS"):
        peak_flops()
    monkeypatch.delenv("EPSCALE_PEAK_FLOPS")
    from epscale.metrics.flops import CPU_FLOPS_PER_CORE

    assert peak_flops("cpu") == torch.get_num_threads() * CPU_FLOPS_PER_CORE


# ---------------------------------------------------------------------- distributed


def _dist_worker(rank, world_size):
    import torch.distributed as dist

    from epscale.metrics import moe_stats

    calls = {"n": 0}
    real = dist.all_reduce

    def counting(*a, **kw):  # the real collective, counted
        calls["n"] += 1
        return real(*a, **kw)

    moe_stats.dist.all_reduce = counting
    torch.manual_seed(0)  # same weights on every rank
    m = TwoMoE(_cfg(num_experts=4, top_k=1))
    col = StepStatsCollector(m, ep=world_size)
    torch.manual_seed(100 + rank)  # different tokens per rank
    x = torch.randn(10 * (rank + 1), 16)
    m(x)
    local = [moe.last_stats["tokens_per_expert"].tolist() for _i, _n, moe in col.layers]
    with torch.no_grad():
        col.layers[0][2].router.expert_bias.fill_(0.5)
    rec = col.record(3, step_time_s=1.0 + rank, num_tokens=x.shape[0], loss=float(rank + 1),
                     lr=0.1, grad_norm=2.0, mem_mb=100.0 * (rank + 1),
                     breakdown={"sync": 0.1 * (rank + 1), "experts": 0.5})
    return rec, local, calls["n"]


def test_record_reduces_across_ranks_in_one_collective():
    from dist_utils import run_distributed

    out = run_distributed(_dist_worker, 2, timeout_s=120)
    (rec0, local0, n0), (rec1, local1, n1) = out
    assert n0 == n1 == 1  # exactly one all_reduce per record
    assert rec0 == {**rec1, "time": rec0["time"]}  # every rank gets the same record
    assert rec0["loss"] == pytest.approx(1.5)
    assert rec0["rank_step_time_s"] == [1.0, 2.0] and rec0["step_time_s"] == 2.0
    assert rec0["tokens_per_s"] == pytest.approx(30 / 2.0)
    assert rec0["tokens_per_s_per_proc"] == pytest.approx(7.5)
    assert rec0["rank_mem_mb"] == [100.0, 200.0] and rec0["mem_mb"] == 200.0
    assert rec0["rank_wait_frac"] == pytest.approx([0.1, 0.1])
    assert rec0["time_breakdown"]["sync"] == pytest.approx(0.15)
    assert rec0["time_breakdown"]["experts"] == pytest.approx(0.5)
    assert rec0["world_size"] == 2
    for i, lay in enumerate(rec0["layers"]):
        summed = [a + b for a, b in zip(local0[i], local1[i])]
        assert lay["tokens_per_expert"] == summed and sum(summed) == 30
        assert lay["rank_load"] == [summed[0] + summed[1], summed[2] + summed[3]]
    assert rec0["layers"][0]["bias_min"] == rec0["layers"][0]["bias_max"] == 0.5


def test_fields_pack_and_read_back_by_name():
    """The step's one flat vector, by name: host numbers and device tensors in table
    order, nested tables, matrices; a value of the wrong size is an error, not a shift."""
    import numpy as np

    from epscale.metrics.fields import Fields

    pair = Fields([("x", ()), ("y", ())])
    f = Fields([("n", ()), ("t", (3,)), ("sub", pair), ("m", (2, 2))])
    assert f.size == 10 and f.slices["sub"] == slice(4, 6)
    values = {"n": 1, "t": torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64),
              "sub": {"x": 5, "y": 6.5}, "m": np.array([[7.0, 8.0], [9.0, 10.0]])}
    flat = f.pack(values, torch.device("cpu"))
    assert flat.dtype == torch.float64 and flat.tolist() == [1, 2, 3, 4, 5, 6.5, 7, 8, 9, 10]
    out = f.unpack(flat.tolist())
    assert out["n"] == 1.0 and out["t"] == [2.0, 3.0, 4.0] and out["sub"] == {"x": 5.0, "y": 6.5}
    assert out["m"].tolist() == [[7.0, 8.0], [9.0, 10.0]]
    with pytest.raises(ValueError, match="'t' is a tensor of 2 values"):
        f.pack({**values, "t": torch.zeros(2)}, torch.device("cpu"))
    with pytest.raises(ValueError, match="'m' has 3 values"):
        f.pack({**values, "m": [1.0, 2.0, 3.0]}, torch.device("cpu"))
    with pytest.raises(ValueError, match="twice"):
        Fields([("a", ()), ("a", ())])


# ---------------------------------------------------------------------- sinks


def test_jsonl_sink_appends_flushed_lines(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.write({"step": 1, "loss": float("nan")})
    assert path.read_text().count("\n") == 1  # flushed before close
    sink.event({"event": "end", "step": 1, "time": 5.0})
    sink.close()
    JsonlSink(path).write({"step": 2, "loss": 1.0})  # resume appends
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert math.isnan(lines[0]["loss"]) and lines[1]["event"] == "end" and lines[2]["step"] == 2


def test_metrics_writer_fans_out_and_drops_a_failing_sink(tmp_path):
    class Broken(Sink):
        def write(self, record):
            raise OSError("disk full")

    class Keep(Sink):
        def __init__(self):
            self.got = []

        def write(self, record):
            self.got.append(record)

        def event(self, record):
            self.got.append(record)

    keep = Keep()
    w = MetricsWriter([JsonlSink(tmp_path / "m.jsonl"), Broken(), keep])
    with pytest.warns(UserWarning, match="Broken failed"):
        w.write({"step": 1})
    w.write({"step": 2})
    ev = w.event("checkpoint", step=2, path="x")
    assert ev["event"] == "checkpoint" and "time" in ev
    assert [r.get("step") for r in keep.got] == [1, 2, 2] and len(w.sinks) == 2
    w.close()
    assert MetricsWriter.open(tmp_path / "other", rank=1).sinks == []
    assert not (tmp_path / "other").exists()


def test_writer_open_reads_env(tmp_path, monkeypatch):
    monkeypatch.setenv("EPSCALE_PROMETHEUS_PORT", "nope")
    with pytest.raises(ValueError, match="EPSCALE_PROMETHEUS_PORT"):
        MetricsWriter.open(tmp_path)


def _record(step: int) -> dict:
    return {"step": step, "time": 1000.0 + step, "loss": 3.0 - 0.1 * step, "val_loss": 3.1, "lr": 1e-3,
            "grad_norm": 0.5, "tokens_per_s": 1000.0 * step, "tokens_per_s_per_proc": 500.0,
            "step_time_s": 0.25, "time_breakdown": {"forward": 0.1, "sync": 0.05},
            "comm_share": 0.2, "mfu": 0.01, "max_vio": 0.5, "worst_rank_idle": 0.1,
            "dropped_frac": 0.0, "skipped": step == 2, "mem_mb": 10.0,
            "layers": [{"layer": 3, "tokens_per_expert": [5, 0, 3, 8], "rank_load": [5, 11],
                        "max_vio": 1.0, "dropped_frac": 0.0, "router_entropy": 1.2,
                        "bias_min": -0.1, "bias_max": 0.2, "dead_experts": [1]}],
            "rank_step_time_s": [0.25, 0.2]}


def test_tensorboard_sink_writes_scalars_and_histograms(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is in the monitor extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from epscale.metrics import TensorBoardSink

    sink = TensorBoardSink(tmp_path / "tb")
    for s in (1, 2, 3):
        sink.write(_record(s))
    sink.event({"event": "checkpoint", "step": 3})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"loss", "tokens_per_s", "time/forward", "layer3/max_vio", "layer3/dead_experts"} <= set(tags["scalars"])
    assert [e.value for e in acc.Scalars("tokens_per_s")] == [1000.0, 2000.0, 3000.0]
    assert "layer3/tokens_per_expert" in tags["histograms"]
    hist = acc.Histograms("layer3/tokens_per_expert")[-1].histogram_value
    assert hist.num == 16


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_prometheus_sink_serves_metrics(tmp_path):
    pytest.importorskip("prometheus_client", reason="prometheus_client is in the monitor extra")
    with pytest.raises(ValueError, match="port"):
        PrometheusSink(70000)
    w = MetricsWriter.open(tmp_path, prometheus_port=0, prometheus_addr="127.0.0.1", run_name="r1")
    prom = [s for s in w.sinks if isinstance(s, PrometheusSink)][0]
    w.write(_record(1))
    w.write(_record(2))
    w.event("checkpoint", step=2)
    text = _scrape(prom.port)
    assert 'epscale_loss{run="r1"} 2.8' in text
    assert 'epscale_tokens_per_second{run="r1"} 2000.0' in text
    assert 'epscale_step{run="r1"} 2.0' in text
    assert 'epscale_expert_tokens{expert="3",layer="3",run="r1"} 8.0' in text
    assert 'epscale_rank_load{layer="3",rank="1",run="r1"} 11.0' in text
    assert 'epscale_layer_dead_experts{layer="3",run="r1"} 1.0' in text
    assert 'epscale_time_breakdown_seconds{run="r1",section="sync"} 0.05' in text
    assert 'epscale_skipped_steps_total{run="r1"} 1.0' in text
    assert 'epscale_events_total{event="checkpoint",run="r1"} 1.0' in text
    port = prom.port
    w.close()
    with pytest.raises(OSError):
        _scrape(port)


def test_grafana_dashboard_queries_exported_metrics(tmp_path):
    pytest.importorskip("prometheus_client", reason="prometheus_client is in the monitor extra")
    import re

    dash = json.loads((REPO / "dashboards" / "grafana-epscale.json").read_text())
    sink = PrometheusSink(0, "127.0.0.1", run="r")
    sink.write(_record(1))
    sink.event({"event": "end", "step": 1})
    exported = set(re.findall(r"^(epscale_\w+?)(?:\{| )", _scrape(sink.port), re.M))
    sink.close()
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    used = {name for e in exprs for name in re.findall(r"\bepscale_\w+", e)}
    assert used and used <= exported, f"dashboard queries unknown metrics: {used - exported}"
    titles = {p["title"] for p in dash["panels"]}
    for must in ("Loss", "Throughput (tokens/s)", "MaxVio per layer", "Tokens per expert"):
        assert must in titles
