"""``epscale monitor RUN_DIR``: a self-contained HTML report of a run (opens offline).

The page holds the run's numbers as JSON and draws them with the inline script of
``report_assets`` (SVG line charts, canvas heatmaps; no external resources): loss and
grad norm, learning rate, throughput, MFU, communication share and worst-rank idle, the
step-time breakdown, an expert-load heatmap per layer over steps, MaxVio, drop rate,
router entropy and expert-bias range per layer, per-rank load, idle and step time,
memory, and tables of alerts, events and run facts.

Long runs are bucketed to at most ``max_points`` columns (means, with the bucket maximum
of loss and grad norm beside them; MaxVio and drop rate take the bucket's maximum,
heatmaps the bucket's summed counts), so a months-long run still makes a page of a few MB
at most; ``report_stream`` builds the same series while streaming metrics.jsonl.
"""

from __future__ import annotations

import html
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..plan.layout import record_label
from ..plan.overlap import COMM_KINDS
from .alerts import Alert, AlertRules
from .report_assets import CSS, JS
from .runlog import RunLog, fmt_value as _fmt, layers_of, num

SECTION_ORDER = ("data", "forward", "attention", "router", "dispatch", "experts", "combine",
                 "backward", "optimizer", "sync")


# ---------------------------------------------------------------------- bucketing


def _buckets(n: int, max_points: int) -> list[tuple[int, int]]:
    if n <= max_points:
        return [(i, i + 1) for i in range(n)]
    edges = np.linspace(0, n, max_points + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _reduce(values: Sequence[float | None], buckets: list[tuple[int, int]],
            how: Callable[[list[float]], float] = lambda v: sum(v) / len(v)) -> list[float | None]:
    out: list[float | None] = []
    for a, b in buckets:
        vals = [v for v in values[a:b] if v is not None and math.isfinite(v)]
        out.append(float(how(vals)) if vals else None)
    return out


def _clean(v: Any) -> Any:
    """JSON for a browser: NaN/inf -> null, recursively."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


# ---------------------------------------------------------------------- data


def _ep_size(run: RunLog) -> int | None:
    par = (run.config or {}).get("parallel") or {}
    ep = par.get("ep")
    return ep if isinstance(ep, int) and ep > 0 else None


def build_data(run: RunLog, alerts: list[Alert], rules: AlertRules,
               max_points: int = 1000, series: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the page draws, JSON-ready (see the module docstring for bucketing).
    ``series``: the plotted series already built while streaming (``report_stream``),
    else they are built from ``run.steps``."""
    data = dict(series) if series is not None else build_series(run, max_points)
    data["layout_changes"] = [
        {"step": ev["step"], "label": f"{(ev.get('old') or {}).get('world_size')} "
                                      f"-> {(ev.get('new') or {}).get('world_size')} proc"}
        for ev in run.events if ev.get("event") == "layout_change" and isinstance(ev.get("step"), int)]
    data["rules"], data["alerts"] = asdict(rules), [a.as_dict() for a in alerts]
    return _clean(data)


def exposed_columns(recs: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    """The exposed communication share of each record ('comm_exposed_share') and of each
    kind that sent anything ('comm_exposed_share.KIND'); {} for records without them."""
    out: dict[str, list[float | None]] = {}
    if not any(num(r.get("comm_s")) for r in recs):
        return out
    out["comm_exposed_share"] = [num(r.get("comm_exposed_share")) for r in recs]
    for k in COMM_KINDS:
        kinds = [(r.get("comm_by_kind") or {}).get(k) or {} for r in recs]
        if any(num(v.get("s")) for v in kinds):
            out[f"comm_exposed_share.{k}"] = [num(v.get("exposed_share")) for v in kinds]
    return out


def build_series(run: RunLog, max_points: int = 1000) -> dict[str, Any]:
    """The plotted series of ``run.steps`` in at most ``max_points`` columns; when they
    are bucketed, ``loss_max`` and ``grad_norm_max`` hold each bucket's maximum (a spike
    stays visible)."""
    recs = run.steps
    steps = [r["step"] for r in recs]
    bk = _buckets(len(recs), max_points)
    x = [steps[b - 1] for _a, b in bk]

    def col(key: str) -> list[float | None]:
        return [num(r.get(key)) for r in recs]

    scalars: dict[str, list[float | None]] = {}
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_proc", "mfu",
                "comm_share", "worst_rank_idle", "dropped_frac", "step_time_s", "mem_mb"):
        vals = col(key)
        if any(v is not None for v in vals):
            scalars[key] = _reduce(vals, bk)
            if key in ("loss", "grad_norm") and len(bk) < len(recs):
                scalars[f"{key}_max"] = _reduce(vals, bk, max)
    for key, vals in exposed_columns(recs).items():
        scalars[key] = _reduce(vals, bk)
    breakdown: dict[str, list[float | None]] = {}
    names = [k for k in SECTION_ORDER]
    extra = sorted({k for r in recs for k in (r.get("time_breakdown") or {}) if k not in names})
    for sec in names + extra:
        vals = [num((r.get("time_breakdown") or {}).get(sec)) for r in recs]
        if any(v for v in vals if v is not None):
            breakdown[sec] = _reduce(vals, bk)
    bad_steps = [r["step"] for r in recs if r.get("skipped") is True or any(
        (num(r.get(k)) is not None and not math.isfinite(num(r.get(k)))) for k in ("loss", "grad_norm"))]
    val_loss = [[r["step"], num(r.get("val_loss"))] for r in recs
                if num(r.get("val_loss")) is not None and math.isfinite(num(r.get("val_loss")))]

    # ---- per layer, on the records that carry layers
    layer_recs = [r for r in recs if r.get("layers")]
    lbk = _buckets(len(layer_recs), max_points)
    layer_x = [layer_recs[b - 1]["step"] for _a, b in lbk]
    ids = run.layer_ids()
    ep = _ep_size(run)
    layers_out = []
    rank_load_sum: list[np.ndarray | None] = [None] * len(layer_recs)
    rank_idle_acc: list[list[np.ndarray]] = [[] for _ in layer_recs]
    for lid in ids:
        per = []
        for r in layer_recs:
            per.append(next((lay for lay in layers_of(r) if lay["layer"] == lid), {}))
        E = max((len(p.get("tokens_per_expert") or []) for p in per), default=0)
        counts = np.full((len(per), E), np.nan)
        for i, p in enumerate(per):
            c = p.get("tokens_per_expert")
            if isinstance(c, list) and len(c) == E:
                counts[i] = [num(v) if num(v) is not None else np.nan for v in c]
        load = []
        for a, b in lbk:
            block = counts[a:b]
            block = block[~np.isnan(block).any(axis=1)] if E else block
            tot = block.sum(axis=0) if len(block) else None
            if tot is None or not E or tot.sum() <= 0:
                load.append(None)
            else:
                load.append((tot / tot.mean()).round(4).tolist())

        def lcol(key: str) -> list[float | None]:
            return [num(p.get(key)) for p in per]

        mv = lcol("max_vio")
        for i, v in enumerate(mv):  # minimal writers: derive MaxVio from the counts
            if v is None and E and not np.isnan(counts[i]).any() and counts[i].mean() > 0:
                mv[i] = float(counts[i].max() / counts[i].mean() - 1)
        bias = [None if num(p.get("bias_min")) is None or num(p.get("bias_max")) is None
                else num(p["bias_max"]) - num(p["bias_min"]) for p in per]
        entry: dict[str, Any] = {"layer": lid, "num_experts": E, "load": load,
                                 "max_vio": _reduce(mv, lbk, max)}
        for key, how in (("dropped_frac", max), ("router_entropy", None)):
            vals = lcol(key)
            entry[key] = _reduce(vals, lbk, how) if how else _reduce(vals, lbk)
        entry["bias_range"] = _reduce(bias, lbk)
        layers_out.append(entry)
        # per-rank load: the record's rank_load, else contiguous placement from config ep
        for i, p in enumerate(per):
            rl = p.get("rank_load")
            if isinstance(rl, list) and rl and all(num(v) is not None for v in rl):
                arr = np.asarray(rl, dtype=float)
            elif ep and E and E % ep == 0 and not np.isnan(counts[i]).any():
                arr = counts[i].reshape(ep, E // ep).sum(axis=1)
            else:
                continue
            rank_load_sum[i] = arr if rank_load_sum[i] is None or len(rank_load_sum[i]) != len(arr) \
                else rank_load_sum[i] + arr
            if arr.max() > 0:
                rank_idle_acc[i].append(1 - arr / arr.max())
    ranks: dict[str, Any] = {}
    num_ep = max((len(v) for v in rank_load_sum if v is not None), default=0)
    if num_ep > 1:
        load = []
        for a, b in lbk:
            rows = [v for v in rank_load_sum[a:b] if v is not None and len(v) == num_ep]
            tot = np.sum(rows, axis=0) if rows else None
            load.append(None if tot is None or tot.sum() <= 0 else (tot / tot.mean()).round(4).tolist())
        idle = np.full((len(layer_recs), num_ep), np.nan)
        for i, acc in enumerate(rank_idle_acc):
            acc = [a for a in acc if len(a) == num_ep]
            if acc:
                idle[i] = np.mean(acc, axis=0)
        idle_series, idle_names = _rank_series(idle, lbk)
        ranks.update(num_ep=num_ep, load=load, idle=idle_series, idle_names=idle_names)
    times = [r.get("rank_step_time_s") for r in recs]
    world = max((len(t) for t in times if isinstance(t, list)), default=0)
    if world > 1:
        busy = np.full((len(recs), world), np.nan)
        for i, r in enumerate(recs):
            t, w = r.get("rank_step_time_s"), r.get("rank_wait_frac")
            if isinstance(t, list) and len(t) == world and all(num(v) is not None for v in t):
                busy[i] = t
                if isinstance(w, list) and len(w) == world and all(num(v) is not None for v in w):
                    busy[i] = np.asarray(t, float) * (1 - np.asarray(w, float))
        ranks["time"], ranks["time_names"] = _rank_series(busy, bk)
        ranks["time_is_busy"] = any(isinstance(r.get("rank_wait_frac"), list) for r in recs)
    return _clean({
        "x": x, "layer_x": layer_x, "scalars": scalars, "breakdown": breakdown,
        "val_loss": val_loss, "bad_steps": bad_steps, "layers": layers_out, "ranks": ranks,
    })


def _rank_series(mat: np.ndarray, bk: list[tuple[int, int]], limit: int = 16
                 ) -> tuple[list[list[float | None]], list[str]]:
    """Per-rank lines (at most ``limit`` ranks), else min / median / max over ranks."""
    if mat.shape[1] <= limit:
        cols = [mat[:, r] for r in range(mat.shape[1])]
        names = [f"rank {r}" for r in range(mat.shape[1])]
    else:
        with np.errstate(all="ignore"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                cols = [np.nanmin(mat, 1), np.nanmedian(mat, 1), np.nanmax(mat, 1)]
        names = ["min over ranks", "median rank", "max over ranks"]
    out = [_reduce([None if np.isnan(v) else float(v) for v in c], bk) for c in cols]
    return out, names


# ---------------------------------------------------------------------- HTML


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _panel(title: str, kind: str, note: str = "", layer: int | None = None) -> str:
    attr = f' data-layer="{layer}"' if layer is not None else ""
    note_html = f'<p class="note">{_e(note)}</p>' if note else ""
    return (f'<div class="panel"><h3>{_e(title)}</h3>{note_html}'
            f'<div class="plot" data-plot="{kind}"{attr}></div></div>')


def end_summary(run: RunLog) -> dict[str, Any] | None:
    """The numbers of the console's end-of-run summary (the last 'end' event), if any."""
    for ev in reversed(run.events):
        if ev.get("event") == "end" and "final_train_loss" in ev:
            return ev
    return None


def header_cards(run: RunLog, data: dict[str, Any], alerts: list[Alert]) -> list[tuple]:
    """The header tiles: a finished run's are the console summary's numbers, with its
    definitions (train loss: mean of the last steps; tokens/s, MFU, comm share: median of
    the steps after the first fifth; MaxVio, dropped: mean of the last steps), plus the
    final validation loss and the unigram baseline; a run still going shows its last step."""
    last = run.steps[-1] if run.steps else {}
    vals = data.get("val_loss") or []
    end = end_summary(run)
    if end is not None:
        src, how = end, "run summary"
        loss_key, val = "final_train_loss", end.get("final_val_loss")
    else:
        src, how = last, "last step"
        loss_key, val = "loss", (vals[-1][1] if vals else None)
    cards = [("step", last.get("step", "—"), False),
             (f"train loss ({'mean of last steps' if end else how})", _fmt(src.get(loss_key)),
              False),
             ("validation loss (final)" if end else "validation loss (latest)", _fmt(val), False)]
    if end is not None and end.get("unigram_nats") is not None:
        cards.append(("unigram baseline", _fmt(end["unigram_nats"]), False))
    med = " (median)" if end else f" ({how})"
    cards += [(f"tokens/s{med}", _fmt(src.get("tokens_per_s")), False),
              (f"MFU{med}", _fmt(src.get("mfu"), True), False),
              (f"comm share{med}", _fmt(src.get("comm_share"), True), False),
              (f"comm exposed{med}", _fmt(src.get("comm_exposed_share"), True), False),
              ("MaxVio", _fmt(src.get("max_vio")), False),
              ("dropped", _fmt(src.get("dropped_frac"), True), False),
              ("alerts", str(len(alerts)), bool(alerts))]
    return cards


def render_html(run: RunLog, data: dict[str, Any], alerts: list[Alert], now: float) -> str:
    recs = run.steps
    cfg = run.config or {}
    moe, par = cfg.get("moe") or {}, cfg.get("parallel") or {}
    state = "ended" if run.ended else "running or stopped (no end event)"
    facts = [("run directory", str(run.run_dir)), ("state", state),
             ("records", f"{len(recs)} step records, {len(run.events)} events"),
             ("steps", f"{recs[0]['step']} … {recs[-1]['step']}" if recs else "—")]
    if len(data["x"]) < len(recs):
        facts.append(("plotted", f"{len(recs)} step records in {len(data['x'])} columns: each "
                      "column is a bucket of consecutive steps (mean; loss and grad norm also "
                      "show the bucket maximum, dashed; MaxVio and drop rate: maximum; expert "
                      "load: summed counts)"))
    if moe:
        cf = moe.get("capacity_factor")
        facts.append(("MoE", f"{moe.get('num_experts', '?')} experts, top-{moe.get('top_k', '?')}, "
                             + ("dropless (no capacity limit)" if cf is None else
                                f"capacity factor {cf}")))
    if par:
        start = next((e for e in reversed(run.events) if e.get("event") == "start"), None)
        facts.append(("layout", f"{record_label(start, par)}, dispatcher "
                                f"{par.get('dispatcher', '?')}"))
    cards = header_cards(run, data, alerts)
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>epscale report: {_e(run.name)}</title><style>{CSS}</style></head><body>",
           f"<header><h1>epscale run report: {_e(run.name)}</h1>",
           f'<div class="sub">{_e(run.run_dir)} · generated {_e(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)))}'
           f" · {_e(state)}</div>", '<div class="cards">']
    for k, v, bad in cards:
        out.append(f'<div class="card{" bad" if bad else ""}"><div class="k">{_e(k)}</div>'
                   f'<div class="v">{_e(v)}</div></div>')
    out.append("</div></header><main>")
    if run.warnings:
        out.append('<p class="warnings"><b>Reading warnings:</b><br>' +
                   "<br>".join(_e(w) for w in run.warnings) + "</p>")

    out.append("<h2>Alerts</h2>")
    if alerts:
        out.append("<table><tr><th>rule</th><th>subject</th><th>since step</th><th>details</th></tr>")
        for a in alerts:
            since = "start" if a.since_step is None else a.since_step
            out.append(f'<tr class="alert"><td>{_e(a.rule)}</td><td>{_e(a.subject)}</td>'
                       f"<td>{_e(since)}</td><td>{_e(a.message)}</td></tr>")
        out.append("</table>")
    else:
        out.append('<div class="allclear">All clear: no alert rule fired.</div>')

    sc, panels = data["scalars"], []
    out.append("<h2>Training</h2><div class=\"grid\">")
    if "loss" in sc:
        panels.append(_panel("Loss", "loss", "train loss (line), validation loss (dots); red "
                                             "lines mark skipped / non-finite steps, blue "
                                             "dashed ones a change of layout (elastic restart)"))
    if "grad_norm" in sc:
        panels.append(_panel("Gradient norm", "grad_norm"))
    if "lr" in sc:
        panels.append(_panel("Learning rate", "lr"))
    if "mem_mb" in sc:
        panels.append(_panel("Memory", "memory", "peak CUDA allocation or resident set, max over ranks"))
    out += panels + ["</div>"]

    panels = []
    out.append("<h2>Throughput and communication</h2><div class=\"grid\">")
    if "tokens_per_s" in sc:
        panels.append(_panel("Throughput", "throughput"))
    if "mfu" in sc:
        panels.append(_panel("Model FLOPs utilisation", "mfu"))
    if "comm_share" in sc:
        panels.append(_panel("Communication share and worst-rank idle", "comm",
                             "(dispatch + combine + sync) / step time; exposed: time the "
                             "rank waited on communication / step time, in all and by kind; "
                             "idle: share of the expert compute the least-loaded EP rank "
                             "waits"))
    if data["breakdown"]:
        panels.append(_panel("Step-time breakdown", "breakdown",
                             "exclusive time per section, mean over ranks (stacked)"))
    out += panels + ["</div>"]

    if data["layers"]:
        out.append('<h2>Experts</h2><div class="grid">')
        for L in data["layers"]:
            if L["num_experts"]:
                out.append(_panel(f"Expert load, layer {L['layer']}", "expert_load",
                                  "assignments per expert over steps, relative to the mean "
                                  "(white = balanced, red = hot, blue = cold, black = none)",
                                  layer=L["layer"]))
        out.append(_panel("MaxVio per layer", "max_vio", "max expert load / mean - 1 "
                                                         "(bucket maximum)"))
        if any(v is not None for L in data["layers"] for v in L["dropped_frac"]):
            out.append(_panel("Drop rate per layer", "drop_rate",
                              "share of assignments dropped by the capacity limit"))
        if any(v is not None for L in data["layers"] for v in L["router_entropy"]):
            out.append(_panel("Router entropy per layer", "entropy",
                              "mean entropy of the routing distribution, nats"))
        if any(v is not None for L in data["layers"] for v in L["bias_range"]):
            out.append(_panel("Expert-bias range per layer", "bias_range",
                              "max - min of the loss-free balancing bias"))
        out.append("</div>")

    rk = data["ranks"]
    if rk:
        out.append('<h2>Ranks</h2><div class="grid">')
        if "load" in rk:
            out.append(_panel("Load per EP rank", "rank_load",
                              "assignments computed per rank (all MoE layers), relative to the mean"))
        if "idle" in rk:
            out.append(_panel("Idle per EP rank", "rank_idle",
                              "1 - load / busiest rank's load, mean over layers"))
        if "time" in rk:
            what = "busy time (step time minus waits)" if rk.get("time_is_busy") else "step time"
            out.append(_panel(f"Per-rank {what}", "rank_time"))
        out.append("</div>")

    out.append("<h2>Events</h2>")
    if run.events:
        out.append("<table><tr><th>event</th><th>step</th><th>time</th><th>details</th></tr>")
        shown = run.events[-200:]
        for ev in shown:
            t = num(ev.get("time"))
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "—"
            details = {k: v for k, v in ev.items() if k not in ("event", "step", "time")}
            out.append(f"<tr><td>{_e(ev.get('event'))}</td><td>{_e(ev.get('step', '—'))}</td>"
                       f"<td>{_e(when)}</td><td><code>{_e(json.dumps(details) if details else '')}"
                       "</code></td></tr>")
        out.append("</table>")
        if len(run.events) > len(shown):
            out.append(f'<p class="note">{len(run.events) - len(shown)} earlier events not shown.</p>')
    else:
        out.append("<p>No events.</p>")
    out.append("<h2>Run</h2><table>")
    out += [f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts]
    out.append("</table>")
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    out.append('<div id="epscale-status" data-done="0">plots not drawn (JavaScript off?)</div>')
    out.append('</main><div id="tip"></div>')
    out.append(f'<script type="application/json" id="epscale-data">{payload}</script>')
    out.append(f"<script>{JS}</script></body></html>")
    return "\n".join(out)


def write_report(run: RunLog, alerts: list[Alert], rules: AlertRules, out: str | Path,
                 now: float | None = None, max_points: int = 1000,
                 series: dict[str, Any] | None = None) -> Path:
    """Render the report of ``run`` to ``out`` (written atomically) and return its path
    (``series``: see :func:`build_data`)."""
    now = time.time() if now is None else now
    data = build_data(run, alerts, rules, max_points=max_points, series=series)
    text = render_html(run, data, alerts, now)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return out
