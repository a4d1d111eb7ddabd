"""The step model's overlap assumption held against a measured run (epscale.plan.overlap):
reading a run's communication records, the calibration's arithmetic at the run's own
layout and elsewhere, what describe and simulate say about it, and simulate's Work
options. Plan-side only: synthetic run directories, no processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epscale.cli import main as cli_main
from epscale.config import ConfigError, load_config
from epscale.config.io import dump_yaml
from epscale.plan.cluster import ClusterSpec, dump_cluster
from epscale.plan.overlap import (assumption, calibrate_overlap, calibration_from, read_measured,
                                  simulate_pair)
from epscale.plan.routing import RoutingSpec

TINY = {"model.dim": 64, "model.num_layers": 2, "model.num_heads": 2, "model.seq_len": 64,
        "model.vocab_size": 256, "model.dense_hidden_dim": 128, "moe.hidden_dim": 64,
        "moe.num_experts": 4, "moe.top_k": 2, "train.micro_batch_size": 2,
        "parallel.ep": 2, "parallel.dispatcher": "dedup", "parallel.overlap_chunks": 2}
# a slow link beside fast compute: the model hides part of the dispatch, not all of it
CLUSTER = ClusterSpec(name="two-cpus", nodes=1, gpus_per_node=2, intra_bw_GBps=0.05,
                      intra_latency_us=50.0, inter_bw_GBps=0.05, inter_latency_us=50.0,
                      gemm_tflops=0.05, gemm_efficiency=1.0, gemm_half_rows=0.0,
                      layer_overhead_us=100.0)
# per step: (dispatch in flight, dispatch exposed, dp in flight, dp exposed)
STEPS = [(9.0, 9.0, 1.0, 1.0), (9.0, 9.0, 1.0, 1.0),            # the first third: dropped
         (0.4, 0.3, 0.1, 0.0), (0.6, 0.3, 0.1, 0.0), (0.5, 0.2, 0.1, 0.0),
         (0.5, 0.2, 0.1, 0.0), (0.4, 0.2, 0.1, 0.0), (0.6, 0.2, 0.1, 0.0)]


def _run_dir(tmp: Path, over: dict | None = None, steps=STEPS, world: int = 2) -> Path:
    """A run directory as epscale train writes it: config.yaml, metrics.jsonl with a start
    record, step records with comm_by_kind and the routing (layers[*].tokens_per_expert)."""
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"{k}={v}" for k, v in {**TINY, **(over or {})}.items()])
    dump_yaml(cfg, tmp / "config.yaml")
    lines = [{"event": "start", "step": 0, "world_size": world}]
    for i, (df, de, pf, pe) in enumerate(steps, 1):
        kinds = {k: {"s": 0.0, "exposed_s": 0.0, "exposed_share": 0.0, "collectives": 0.0}
                 for k in ("dispatch", "fsdp", "dp", "pp")}
        kinds["dispatch"].update(s=df, exposed_s=de)
        kinds["dp"].update(s=pf, exposed_s=pe)
        lines.append({"step": i, "step_time_s": 2.0, "comm_s": df + pf,
                      "comm_exposed_s": de + pe, "comm_exposed_share": (de + pe) / 2.0,
                      "comm_by_kind": kinds,
                      "layers": [{"layer": j, "tokens_per_expert": [300, 250, 260, 214]}
                                 for j in range(2)]})
    lines.append({"event": "end", "step": len(steps)})
    (tmp / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return tmp


def test_read_measured_takes_the_steady_steps(tmp_path):
    m = read_measured(_run_dir(tmp_path / "run"))
    assert (m.world, m.steps) == (2, 6)
    assert m.exposed_share == pytest.approx(0.1)   # median of (exposed dispatch + dp) / 2 s
    assert m.step_time_s == 2.0
    assert set(m.kinds) == {"dispatch", "dp"}     # fsdp and pp sent nothing
    d = m.kinds["dispatch"]
    assert d["in_flight_s"] == pytest.approx(0.5) and d["exposed_s"] == pytest.approx(0.2)
    assert d["hidden"] == pytest.approx(1 - 1.4 / 3.0)   # of the sums, not a median of ratios
    assert m.kinds["dp"]["hidden"] == pytest.approx(1.0)
    assert m.layout == "dp=1 x ep=2, dedup, overlap auto, 2 chunks, 2 ranks"


def test_read_measured_errors_name_the_option(tmp_path):
    with pytest.raises(ConfigError, match="--overlap-from .*not a run directory"):
        read_measured(tmp_path / "nowhere")
    run = _run_dir(tmp_path / "old")
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if k != "comm_by_kind"}) + "\n" for r in recs))
    with pytest.raises(ConfigError, match="comm_timing"):
        read_measured(run)
    with pytest.raises(ConfigError, match="needs --overlap-cluster"):
        calibration_from(run, None)


def _pair(cal, over=None, mode=None):
    cfg = load_config(None, [f"{k}={v}" for k, v in {**TINY, **(over or {})}.items()])
    spec = RoutingSpec("trace", trace=str(Path(cal.measured.source) / "metrics.jsonl"))
    return simulate_pair(cfg, CLUSTER, mode, routing=spec, strategies=("none",),
                         dispatchers=("dedup",), ep=2)[0]


def test_calibration_at_the_runs_layout_gives_the_measured_hidden_share(tmp_path):
    run = _run_dir(tmp_path / "run")
    cal = calibrate_overlap(read_measured(run), CLUSTER)
    hidden_meas = read_measured(run).kinds["dispatch"]["hidden"]
    model = cal.model["dispatch"]
    assert 0 < model["hidden"] < 1 and model["hidden"] != pytest.approx(hidden_meas)
    assert cal.efficiency["dispatch"] == pytest.approx(hidden_meas / model["hidden"])
    # the replicated layout reduced in DDP's buckets: not counted as exposed, no calibration
    assert set(cal.efficiency) == {"dispatch"} and "DDP" in cal.uncalibrated["dp"]
    result, none = _pair(cal)
    assert cal.model_step_time_s == result.step_time_s
    assert cal.model_wait_share == result.mean_idle_share > 0   # the trace's skew
    got = cal.apply(result, none)
    assert got.expert_comm_s == pytest.approx(none.expert_comm_s * (1 - hidden_meas), rel=1e-9)
    assert got.step_time_s - result.step_time_s == pytest.approx(
        got.expert_comm_s - result.expert_comm_s, rel=1e-9)
    assert got.tokens_per_s_per_gpu * got.step_time_s == pytest.approx(
        result.tokens_per_s_per_gpu * result.step_time_s, rel=1e-9)
    assert got.comm_share == pytest.approx(got.expert_comm_s / got.step_time_s)
    # another layout: the model's hidden share there, scaled by the same efficiency
    r4, n4 = _pair(cal, {"parallel.overlap_chunks": 4})
    want = 1 - cal.efficiency["dispatch"] * (1 - r4.expert_comm_s / n4.expert_comm_s)
    assert cal.apply(r4, n4).expert_comm_s == pytest.approx(n4.expert_comm_s * want, rel=1e-9)
    # overlap 'none' at the target: nothing of the model's hidden, nothing to scale
    r0, n0 = _pair(cal, mode="none")
    assert cal.apply(r0, n0).step_time_s == pytest.approx(r0.step_time_s, rel=1e-12)
    info = cal.as_dict()
    assert info["calibrated"] and info["cluster"] == "two-cpus"
    assert cal.lines()[0].startswith(f"overlap calibrated from {run}: measured exposed share 10.0% of a 2.000 s step")


def test_calibration_hides_at_most_everything(tmp_path):
    # the run hid all its dispatch: an efficiency above 1 caps the hidden share at 1
    steps = [(1.0, 0.0, 0.0, 0.0)] * 6
    cal = calibrate_overlap(read_measured(_run_dir(tmp_path / "run", steps=steps)), CLUSTER)
    assert cal.efficiency["dispatch"] > 1 and cal.uncalibrated == {"dp": "the run sent none"}
    result, none = _pair(cal)
    assert cal.apply(result, none).expert_comm_s == pytest.approx(0.0, abs=1e-12)
    r4, n4 = _pair(cal, {"parallel.overlap_chunks": 4})      # the model hides more there
    assert 1 - r4.expert_comm_s / n4.expert_comm_s > 1 - result.expert_comm_s / none.expert_comm_s
    assert cal.apply(r4, n4).expert_comm_s == 0.0


def test_what_cannot_be_calibrated_says_why(tmp_path):
    # with overlap none the model hides nothing at the run's layout: nothing to scale
    run = _run_dir(tmp_path / "none", {"parallel.overlap": "none"})
    cal = calibrate_overlap(read_measured(run), CLUSTER)
    assert cal.efficiency == {} and "hides none" in cal.uncalibrated["dispatch"]
    assert "NOT calibrated" in cal.lines()[0]
    result, none = _pair(cal)
    assert cal.apply(result, none) == result
    run = _run_dir(tmp_path / "ag", {"parallel.dispatcher": "allgather"})
    with pytest.raises(ConfigError, match="'allgather' has no step model"):
        calibrate_overlap(read_measured(run), CLUSTER)
    with pytest.raises(ConfigError, match="--overlap-cluster two-cpus is invalid"):
        calibrate_overlap(read_measured(_run_dir(tmp_path / "w3", world=3)), CLUSTER)


def test_assumption_names_its_source():
    cfg = load_config(None, [f"{k}={v}" for k, v in TINY.items()])
    a = assumption(cfg)
    assert a["mode"] == "chunks" and not a["calibrated"] and "over 2 chunks" in a["assumes"]
    assert "parallel.overlap_chunks > 1 (here 2)" in a["source"]
    assert assumption(cfg, "full")["source"].startswith("--overlap full")
    one = load_config(None, ["parallel.overlap_chunks=1", "parallel.overlap=none"])
    assert assumption(one)["mode"] == "none"


def test_describe_says_which_overlap_and_where_from(tmp_path, capsys):
    assert cli_main(["describe", "ref-1t-64e", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["overlap"]
    assert not info["calibrated"] and "step_model" in info["source"]
    run = _run_dir(tmp_path / "run")
    cluster = tmp_path / "two-cpus.yaml"
    dump_cluster(CLUSTER, cluster)
    assert cli_main(["describe", "ref-1t-64e", "--overlap-from", str(run)]) == 2
    assert "needs --overlap-cluster" in capsys.readouterr().err
    assert cli_main(["describe", "ref-1t-64e", "--overlap-cluster", str(cluster)]) == 2
    assert cli_main(["describe", "ref-1t-64e", "--overlap-from", str(run),
                     "--overlap-cluster", str(cluster)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert cli_main(["describe", "ref-1t-64e", "--fit", "80GiB", "--overlap-from", str(run),
                     "--overlap-cluster", str(cluster)]) == 2
    assert "--overlap-from is invalid with --fit" in capsys.readouterr().err
    assert f"overlap calibrated from {run}: measured exposed share 10.0% of a 2.000 s step at layout dp=1 x ep=2" in out
    assert "dispatch: hidden 53.3% of its time in flight measured" in out


def test_simulate_work_options_and_calibration(tmp_path, capsys):
    run = _run_dir(tmp_path / "run")
    cluster = tmp_path / "two-cpus.yaml"
    dump_cluster(CLUSTER, cluster)
    base = ["simulate", str(run / "config.yaml"), "--cluster", str(cluster), "--no-plot",
            "--routing", "uniform", "--strategies", "none", "--dispatchers", "dedup"]

    def step(*extra) -> dict:
        js = tmp_path / "out.json"
        assert cli_main(base + ["--json", str(js), *extra]) == 0
        return json.loads(js.read_text())

    plain = step()
    assert not plain["overlap"]["calibrated"]
    t_plain = plain["runs"][0]["results"][0]["step_time_s"]
    assert step("--recompute-modules", "moe")["runs"][0]["results"][0]["step_time_s"] > t_plain
    assert step("--tp", "2")["runs"][0]["results"][0]["step_time_s"] != t_plain
    cal = step("--overlap-from", str(run), "--overlap-cluster", str(cluster))
    assert cal["overlap"]["calibrated"] and cal["overlap"]["efficiency"]["dispatch"] > 1
    # the run hid more than the model: the calibrated step is shorter, by the expert time
    got, was = cal["runs"][0]["results"][0], plain["runs"][0]["results"][0]
    assert got["step_time_s"] < t_plain
    assert t_plain - got["step_time_s"] == pytest.approx(
        was["expert_comm_s"] - got["expert_comm_s"], rel=1e-9)
    capsys.readouterr()
    assert cli_main(base + ["--precision", "fp8"]) == 2
    assert "fp8_tflops" in capsys.readouterr().err
    assert cli_main(base + ["--recompute-modules", "attn"]) == 2
    assert "recompute module 'attn' is invalid" in capsys.readouterr().err


def test_paired_micro_batches_are_modelled_as_pairs_with_the_first_and_last_alone():
    """parallel.overlap_micro_batches: the step model's default is DualPipe's pairing, with
    one micro-batch's transfers of m unhidden (the step's first forward, its last
    backward), so more micro-batches hide more; describe says so. The memory estimate
    holds two micro-batches' activations and row buffers where the trainer pairs them."""
    from epscale.plan.layout import Layout
    from dataclasses import replace as dc_replace

    from epscale.plan.memory import estimate, pairs_micro_batches
    from epscale.plan.routing import RoutingSpec
    from epscale.plan.step_model import simulate

    def cfg(m: int, pairs: bool, **extra):
        over = {**TINY, "parallel.overlap_chunks": 1, "train.grad_accum": m,
                "parallel.overlap_micro_batches": pairs, **extra}
        return load_config(None, [f"{k}={v}" for k, v in over.items()])

    def exposed(c, overlap=None):
        r = simulate(c, CLUSTER, RoutingSpec.parse("uniform"), strategies=("none",),
                     dispatchers=("dedup",), overlap=overlap, step_samples=2)[0]
        return r.expert_comm_s / c.train.grad_accum   # per micro-batch

    a = assumption(cfg(4, True))
    assert a["mode"] == "full" and "the step's first forward runs alone" in a["assumes"]
    assert assumption(cfg(4, False))["mode"] == "none"
    none, m2, m8 = exposed(cfg(2, False)), exposed(cfg(2, True)), exposed(cfg(8, True))
    assert none > m2 > m8 > 0
    assert exposed(cfg(8, True)) == exposed(cfg(8, False), "full")   # the default is 'full'
    # per micro-batch: ((m - 1) x paired + 1 x alone) / m, so m = 2 and m = 8 give paired
    paired = (8 * m8 - none) / 7
    assert m2 == pytest.approx((paired + none) / 2, rel=1e-9)
    base = estimate(cfg(4, False), Layout.from_config(cfg(4, False), 2))
    lay = Layout.from_config(cfg(4, True), 2)
    got = estimate(cfg(4, True), lay)
    assert got.activations == 2 * base.activations > 0 and got.comm == 2 * base.comm > 0
    assert got.recompute == base.recompute == 0
    # under recomputation the forward's block caught mid-way at a hand-off holds up to what
    # the backward's rebuilt block holds: two working sets (measured at ep=2 with full
    # recomputation, the pairs' increment exceeded two micro-batches' kept inputs alone)
    for ac in ("selective", "full"):
        plain, paired = (estimate(c, Layout.from_config(c, 2)) for c in (
            cfg(4, False, **{"train.activation_checkpointing": ac}),
            cfg(4, True, **{"train.activation_checkpointing": ac})))
        assert paired.recompute == 2 * plain.recompute > 0, ac
        assert paired.activations == 2 * plain.activations > 0, ac
    assert pairs_micro_batches(cfg(4, True), lay)
    # a layout the trainer would not pair (as --fit's FSDP candidates of such a recipe)
    assert not pairs_micro_batches(cfg(4, True), dc_replace(lay, fsdp=True))
    assert not pairs_micro_batches(cfg(4, True), dc_replace(lay, micro_batches=1))
