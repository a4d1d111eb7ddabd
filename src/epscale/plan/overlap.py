"""What the step records say about communication overlap, torch-free (the monitor and the
simulator read it): the kinds of communication ``epscale.metrics.commclock.CommClock``
times and the median exposed share of a run's records; the step model's overlap
assumption (:func:`assumption`) and its calibration against a measured run
(:func:`read_measured`, :func:`calibrate_overlap`: ``describe`` and ``simulate`` with
``--overlap-from RUN_DIR --overlap-cluster CLUSTER``).

Calibration, per kind the model both times in flight and hides (dispatch, dp, pp): the
run's hidden share (1 - exposed / in flight, its steady steps) over the model's at the
run's layout on the cluster it ran on (the model's in flight: its exposed time with
overlap 'none') is the implementation's efficiency at hiding what the model deems
hideable; at another layout the model's hidden share is scaled by it (at most 1). FSDP
is not calibrated: the model hides its prefetched gathers whatever the overlap.

A step record carries ``comm_s`` (in flight), ``comm_exposed_s`` (waited on),
``comm_exposed_share`` (exposed / mean step time) and ``comm_by_kind`` (kind -> ``s``,
``exposed_s``, ``exposed_share``, ``collectives``), each the mean over ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace as dc_replace
from pathlib import Path
from statistics import median
from typing import Any, Sequence

from ..config import ConfigError, RunConfig, load_config
from .cluster import ClusterSpec, load_cluster
from .layout import Layout
from .routing import RoutingSpec
from .shapes import Work
from .step_model import DISPATCHERS, SimResult, default_mode, simulate

# What each kind includes (a collective is timed from its issue; a blocking one is exposed
# whole, an asynchronous one while the rank sits in its wait()):
# dispatch: every exchange of the MoE layers' dispatchers (epscale.dispatch.comm): the token
#   and count all-to-alls of dispatch and combine, forward and backward; the allgather
#   backend's gathers and reduce-scatters; spill-over's count gather and row shipping.
# fsdp: FSDP2's parameter all-gathers (forward, and again for backward) and gradient
#   reduce-scatters.
# dp: HSDP's replica all-reduce (FSDP2's, in the step's last backward; blocking on gloo),
#   and the replicated layout's gradient all-reduces after backward (epscale.parallel.grads,
#   with the redundant-expert replica sums): all of them under a pipeline or with
#   parallel.overlap: none. With overlap (pp = 1) the gradients are reduced during backward
#   in DDP's buckets: their all-reduces are timed in flight, but DDP's reducer waits for
#   them inside torch, so that wait is not counted as exposed.
# pp: the pipeline schedule's point-to-point sends and receives (torch's _batch_p2p).
# In no kind: the step record's and the gradient norm's all-reduces, the balance and
# aux-loss all-reduces (a few numbers each), checkpoint, validation and re-placement traffic.
COMM_KINDS: tuple[str, ...] = ("dispatch", "fsdp", "dp", "pp")


def exposed_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Medians over step records of the exposed share (``comm_exposed_share``), of each
    kind's exposed share (kinds that sent anything), and of the share of the in-flight
    time hidden behind compute (1 - exposed / in flight); None when no record carries
    them (a run from before these fields)."""
    recs = [r for r in records if "comm_exposed_share" in r]
    if not recs:
        return None

    by_kind = {}
    for k in COMM_KINDS:
        ks = [r["comm_by_kind"][k] for r in recs if k in r.get("comm_by_kind", {})]
        if any(v["s"] > 0 for v in ks):
            by_kind[k] = median([float(v.get("exposed_share", 0.0)) for v in ks])
    hidden = [1.0 - r["comm_exposed_s"] / r["comm_s"] for r in recs if r.get("comm_s", 0) > 0]
    return {"exposed_share": median([float(r["comm_exposed_share"]) for r in recs]),
            "by_kind": by_kind, "hidden_frac": median(hidden) if hidden else 0.0}


def format_by_kind(by_kind: dict[str, float]) -> str:
    """'dispatch 40.1%, dp 6.7%' (or 'none')."""
    return ", ".join(f"{k} {100 * v:.1f}%" for k, v in by_kind.items()) or "none"


# --------------------------------------------------------------------------------------
# The step model's overlap assumption, and its calibration from a measured run
# --------------------------------------------------------------------------------------
# The kinds the step model both times in flight and hides (its SimResult field of each
# kind's exposed seconds); FSDP's gathers are hidden by the model whatever the overlap
# (prefetch), so it has no in-flight figure to calibrate against.
MODEL_KINDS: dict[str, str] = {"dispatch": "expert_comm_s", "dp": "dp_comm_s", "pp": "p2p_s"}
MIN_HIDDEN = 1e-6     # a modelled hidden share below this: nothing to scale (uncalibrated)


def model_overlap_mode(run_cfg: RunConfig) -> str:
    """The overlap the step model simulates for ``run_cfg`` (what ``simulate`` picks by
    default): 'chunks' when ``parallel.overlap_chunks`` > 1, else 'none'; 'none' also for
    ``parallel.overlap: none`` (the plain blocking path: the model has nothing hidden)."""
    par = run_cfg.parallel
    if par.overlap == "none":
        return "none"
    return "chunks" if par.overlap_chunks > 1 else "none"


def assumption(run_cfg: RunConfig, overlap: str | None = None) -> dict[str, Any]:
    """What the step model assumes about overlap for ``run_cfg`` (``overlap``: the mode
    asked for, else the model's default, :func:`default_mode`), and where that comes
    from: not calibrated."""
    par = run_cfg.parallel
    mode = overlap or default_mode(run_cfg)
    if mode == "chunks":
        what = (f"dispatch, experts and combine pipelined over {par.overlap_chunks} chunks "
                "(each chunk's transfers behind another's expert compute); the DP gradient "
                "all-reduce hidden behind 2/3 of the last micro-batch where it fits")
    elif mode == "full":
        what = ("DualPipe's pairing: each transfer of a forward chunk behind one compute "
                "segment of another micro-batch's backward chunk and the other way round "
                "(Megatron-Core's combined 1F1B order; without a pipeline the step's first "
                "forward runs alone, under one each rank's warm-up and one more forward); "
                "the DP gradient all-reduce hidden behind 2/3 of the last micro-batch where "
                "it fits")
    else:
        what = ("dispatch and combine in sequence with the experts (none hidden); the DP "
                "gradient all-reduce after the backward (none hidden)")
    what += ("; FSDP gathers prefetched behind each micro-batch's compute (the first "
             "block's exposed) whatever the overlap; pipeline p2p hidden under looped and "
             "V schedules with overlap")
    if overlap:
        source = f"--overlap {overlap}"
    else:
        source = ("epscale.plan.step_model's default: 'none' under parallel.overlap: none "
                  f"(here {par.overlap}); 'full' with parallel.overlap_micro_batches "
                  "(paired micro-batches without a pipeline; DualPipeV's pairs only with "
                  "--overlap full); "
                  f"'chunks' when parallel.overlap_chunks > 1 (here {par.overlap_chunks}); "
                  "else 'none'")
    return {"mode": mode, "calibrated": False, "assumes": what,
            "source": source + "; not calibrated against a measured run (--overlap-from "
                               "RUN_DIR --overlap-cluster CLUSTER)"}


@dataclass(frozen=True)
class MeasuredOverlap:
    """What a run's step records say about overlap (medians over the steady steps: after
    the first third). ``kinds``: kind -> ``in_flight_s``, ``exposed_s`` (per step) and
    ``hidden`` (1 - exposed / in flight, of the summed steps) for each kind that sent
    anything."""

    source: str
    run_cfg: RunConfig
    world: int
    steps: int
    exposed_share: float
    step_time_s: float
    kinds: dict[str, dict[str, float]]

    @property
    def layout(self) -> str:
        """'dp=1 x ep=2, dedup, overlap auto, 2 chunks' (the run's)."""
        par = self.run_cfg.parallel
        lay = Layout.from_config(self.run_cfg, self.world)
        return (f"{lay.label(pipeline=True)}, {par.dispatcher}, overlap {par.overlap}, "
                f"{par.overlap_chunks} chunk{'s' * (par.overlap_chunks > 1)}, {self.world} ranks")


def read_measured(run_dir: str | Path, option: str = "--overlap-from") -> MeasuredOverlap:
    """The overlap a run measured: its ``metrics.jsonl`` step records (``comm_by_kind``)
    and its ``config.yaml``; ``option`` names the flag in errors."""
    d = Path(run_dir)
    metrics, config = d / "metrics.jsonl", d / "config.yaml"
    if not metrics.is_file() or not config.is_file():
        raise ConfigError(f"{option} {run_dir} is invalid: not a run directory (it needs "
                          "metrics.jsonl and config.yaml, as epscale train writes them)")
    records, world = [], None
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue        # a line cut short by a crash
        if rec.get("event") == "start":
            world = int(rec["world_size"])
        elif "event" not in rec and "comm_by_kind" in rec:
            records.append(rec)
    if not records or world is None:
        raise ConfigError(f"{option} {run_dir} is invalid: its metrics.jsonl has no start "
                          "record or no step records with comm_by_kind (run it with "
                          "metrics.comm_timing: true)")
    steady = records[len(records) // 3:]
    kinds = {}
    for k in COMM_KINDS:
        flight = [float(r["comm_by_kind"][k]["s"]) for r in steady]
        exposed = [float(r["comm_by_kind"][k]["exposed_s"]) for r in steady]
        if sum(flight) > 0:
            kinds[k] = {"in_flight_s": median(flight), "exposed_s": median(exposed),
                        "hidden": 1.0 - sum(exposed) / sum(flight)}
    return MeasuredOverlap(
        source=str(run_dir), run_cfg=load_config(config), world=world, steps=len(steady),
        exposed_share=median([float(r["comm_exposed_share"]) for r in steady]),
        step_time_s=median([float(r["step_time_s"]) for r in steady]), kinds=kinds)


def modelled(result: SimResult, none: SimResult) -> dict[str, dict[str, float]]:
    """Per kind of :data:`MODEL_KINDS`: the step model's ``in_flight_s`` (its exposed time
    with overlap 'none', where nothing hides), ``exposed_s`` (in ``result``'s overlap) and
    ``hidden`` share, for the kinds with time in flight; and 'fsdp' exposed only."""
    out = {}
    for kind, field_name in MODEL_KINDS.items():
        flight, exposed = getattr(none, field_name), getattr(result, field_name)
        if flight > 0:
            out[kind] = {"in_flight_s": flight, "exposed_s": exposed,
                         "hidden": 1.0 - exposed / flight}
    if result.fsdp_comm_s > 0:
        out["fsdp"] = {"exposed_s": result.fsdp_comm_s}
    return out


def simulate_pair(run_cfg: RunConfig, cluster: ClusterSpec, mode: str, **kw) -> tuple:
    """Every (strategy, dispatcher) result of the step model at ``mode`` and at 'none'
    (the same draws: one loads cache), pairwise."""
    cache: dict = {}
    got = simulate(run_cfg, cluster, overlap=mode, loads_cache=cache, **kw)
    work = dc_replace(kw.pop("work", Work()), p2p_overlap=False)   # nothing hidden at all
    none = simulate(run_cfg, cluster, overlap="none", loads_cache=cache, work=work, **kw)
    return list(zip(got, none))


@dataclass(frozen=True)
class OverlapCalibration:
    """The step model's overlap held against a measured run. ``model_wait_share``: the
    model's mean idle share of a rank waiting for the slowest rank's experts, which a
    run's clock sees as exposed communication (the rank waits inside the exchange that
    follows), so the measured exposed share compares with model exposed + wait.
    ``efficiency``: per kind,
    the measured hidden share over the one the model gives at the run's layout on
    ``cluster`` (the machine the run ran on); :meth:`apply` scales the model's hidden
    share of that kind by it at any other layout. ``uncalibrated``: kind -> why not."""

    measured: MeasuredOverlap
    cluster: str
    model: dict[str, dict[str, float]]
    model_exposed_share: float
    model_step_time_s: float
    model_wait_share: float
    efficiency: dict[str, float]
    uncalibrated: dict[str, str]

    def apply(self, result: SimResult, none: SimResult) -> SimResult:
        """``result`` with each calibrated kind's exposed time set to the model's time in
        flight (``none``'s exposed: the same layout with overlap 'none') times one minus
        ``efficiency`` x the model's hidden share (at most all of it hidden); the step
        time, tokens/s and shares follow. Under a pipeline the change is added to the
        step as it is (the bubble's stretch of the rank time is not re-applied)."""
        fields, delta = {}, 0.0
        for kind, eff in self.efficiency.items():
            name = MODEL_KINDS[kind]
            flight, exposed = getattr(none, name), getattr(result, name)
            if flight <= 0:
                continue
            hidden = min(1.0, eff * (1.0 - exposed / flight))
            fields[name] = flight * (1.0 - hidden)
            delta += fields[name] - exposed
        step = result.step_time_s + delta
        keep = result.step_time_s / step
        expert = fields.get("expert_comm_s", result.expert_comm_s)
        dp = fields.get("dp_comm_s", result.dp_comm_s)
        return dc_replace(result, **fields, step_time_s=step,
                       tokens_per_s_per_gpu=result.tokens_per_s_per_gpu * keep,
                       comm_share=expert / step, dp_share=dp / step,
                       worst_idle_share=result.worst_idle_share * keep,
                       mean_idle_share=result.mean_idle_share * keep)

    def as_dict(self) -> dict[str, Any]:
        m = self.measured
        return {"mode": model_overlap_mode(m.run_cfg), "calibrated": bool(self.efficiency),
                "source": m.source, "layout": m.layout, "cluster": self.cluster,
                "steps": m.steps, "measured_exposed_share": m.exposed_share,
                "model_exposed_share": self.model_exposed_share,
                "model_wait_share": self.model_wait_share,
                "measured_step_time_s": m.step_time_s, "model_step_time_s": self.model_step_time_s,
                "measured": m.kinds,
                "model": self.model, "efficiency": self.efficiency,
                "uncalibrated": self.uncalibrated}

    def lines(self) -> list[str]:
        """What ``describe`` and ``simulate`` print about it."""
        m = self.measured
        head = ("overlap calibrated from" if self.efficiency else
                "overlap NOT calibrated (no kind could be; the default assumption stands) by")
        out = [f"{head} {m.source}: measured exposed share "
               f"{m.exposed_share:.1%} of a {m.step_time_s:.3f} s step at layout {m.layout} (median of "
               f"{m.steps} steps); the step model gives {self.model_exposed_share:.1%} of "
               f"{self.model_step_time_s:.3f} s there (overlap "
               f"'{model_overlap_mode(m.run_cfg)}', cluster {self.cluster}), and "
               f"{self.model_wait_share:.1%} more waiting for the slowest rank's experts, "
               "which the run's clock counts as exposed (it waits inside the exchange)"]
        for kind, eff in self.efficiency.items():
            out.append(f"  {kind}: hidden {m.kinds[kind]['hidden']:.1%} of its time in flight "
                       f"measured, {self.model[kind]['hidden']:.1%} modelled: the model's "
                       f"hiding x {eff:.2f} at every layout")
        for kind, why in self.uncalibrated.items():
            out.append(f"  {kind}: not calibrated ({why})")
        return out


def _why_not(kind: str, meas: dict | None, mod: dict | None, run_cfg: RunConfig) -> str | None:
    """Why ``kind`` cannot be calibrated (None: it can)."""
    par = run_cfg.parallel
    if kind == "dp" and meas is not None and not par.fsdp and par.overlap != "none" and par.pp == 1:
        return (f"the run reduced its gradients in DDP's buckets, whose waits happen inside "
                f"torch and are not counted as exposed: its measured hidden "
                f"{meas['hidden']:.1%} is an upper bound")
    if kind == "fsdp":
        return ("the step model hides FSDP's prefetched gathers whatever the overlap: it has "
                "no in-flight FSDP time to hold the measured share against")
    if meas is None:
        return "the run sent none"
    if mod is None:
        return "the step model has none at the run's layout"
    if mod["hidden"] < MIN_HIDDEN:
        return (f"the step model hides none of it at the run's layout (measured hidden "
                f"{meas['hidden']:.1%}): nothing of the model's to scale")
    return None


def calibrate_overlap(measured: MeasuredOverlap, cluster: ClusterSpec, *, work: Work = Work(),
                      seed: int = 0, option: str = "--overlap-cluster") -> OverlapCalibration:
    """The step model at ``measured``'s layout (its recipe, ranks, dispatcher and routing:
    the run's own trace, no balancing strategy on top) on ``cluster`` (the machine it ran
    on: a preset, or the file ``epscale calibrate`` wrote there; its node count is set to
    hold the run's ranks), against what the run measured."""
    cfg, world = measured.run_cfg, measured.world
    disp = cfg.parallel.dispatcher
    if disp not in DISPATCHERS:
        raise ConfigError(f"the run's parallel.dispatcher '{disp}' has no step model (it has "
                          f"{', '.join(DISPATCHERS)}): calibrate from a run of one of those")
    gpn = cluster.gpus_per_node
    if world % gpn:
        raise ConfigError(f"{option} {cluster.name} is invalid for this run: its "
                          f"{gpn} ranks per node do not divide the run's {world} ranks")
    spec = dc_replace(cluster, nodes=world // gpn)
    routing = RoutingSpec("trace", trace=str(Path(measured.source) / "metrics.jsonl"))
    mode = model_overlap_mode(cfg)
    result, none = simulate_pair(cfg, spec, mode, routing=routing, strategies=("none",),
                                 dispatchers=(disp,), ep=cfg.parallel.ep, work=work, seed=seed)[0]
    model = modelled(result, none)
    shown = result.expert_comm_s + result.dp_comm_s + result.fsdp_comm_s + result.p2p_s
    efficiency, uncalibrated = {}, {}
    for kind in COMM_KINDS:
        meas, mod = measured.kinds.get(kind), model.get(kind)
        if meas is None and mod is None:
            continue
        why = _why_not(kind, meas, mod, cfg)
        if why is None:
            efficiency[kind] = meas["hidden"] / mod["hidden"]
        else:
            uncalibrated[kind] = why
    return OverlapCalibration(measured, cluster.name, model, shown / result.step_time_s,
                              result.step_time_s, result.mean_idle_share, efficiency,
                              uncalibrated)


def calibration_from(run_dir: str | Path, cluster: str | None, *, work: Work = Work(),
                     seed: int = 0) -> OverlapCalibration:
    """``--overlap-from RUN_DIR --overlap-cluster CLUSTER`` of ``describe`` and ``simulate``."""
    if cluster is None:
        raise ConfigError(f"--overlap-from {run_dir} needs --overlap-cluster: the cluster the "
                          "run ran on (a preset, or the YAML epscale calibrate wrote on that "
                          "machine), to model the run's own layout there")
    return calibrate_overlap(read_measured(run_dir), load_cluster(cluster), work=work, seed=seed)
