"""``epscale monitor RUN_DIR --follow``: a live terminal dashboard (rich) of a running job.

It tails metrics.jsonl (complete lines only; a line being written is picked up on the
next refresh), re-reads the heartbeats, re-evaluates the alert rules and redraws: the
latest numbers with sparklines, the step-time breakdown, one row per MoE layer (MaxVio,
entropy, drops, bias range, dead experts, expert load as a bar per expert), one row per
rank (load, idle, busy time, heartbeat age) and the alerts.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .alerts import Alert, AlertRules, evaluate, run_over
from .runlog import JsonlTail, RunLog, fmt_value as _f, layers_of, num, read_config, refresh_heartbeats

BARS = "▁▂▃▄▅▆▇█"
KEEP_RECORDS = 2000  # records kept in memory while following (the rules look back less)


def sparkline(values: Sequence[float | None], width: int = 40) -> str:
    """Unicode sparkline of the last ``width`` finite values ('' when there are none)."""
    vals = [v for v in values if v is not None and math.isfinite(v)][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi == lo:
        return BARS[3] * len(vals)
    return "".join(BARS[min(7, int((v - lo) / (hi - lo) * 8))] for v in vals)


def load_bar(counts: Sequence[float]) -> Text:
    """One block character per expert, height = load relative to the busiest; red for an
    expert over twice the mean, dim '·' for an expert with no tokens."""
    t = Text()
    if not counts:
        return t
    peak = max(counts) or 1
    mean = sum(counts) / len(counts) or 1
    for c in counts[:128]:
        if c <= 0:
            t.append("·", style="dim")
        else:
            style = "red" if c > 2 * mean else ("yellow" if c > 1.5 * mean else "green")
            t.append(BARS[min(7, int(c / peak * 7.999))], style=style)
    if len(counts) > 128:
        t.append(f" +{len(counts) - 128}", style="dim")
    return t


def _layer_vio(L: dict[str, Any]) -> float:
    v = num(L.get("max_vio"))
    if v is None:
        counts = [num(c) or 0.0 for c in (L.get("tokens_per_expert") or [])]
        v = max(counts) / (sum(counts) / len(counts)) - 1 if counts and sum(counts) > 0 else 0.0
    return v


def render(run: RunLog, alerts: list[Alert], now: float | None = None,
           max_rows: int = 12) -> Group:
    """The dashboard for the current state of ``run``; at most ``max_rows`` layer and rank
    rows (the worst ones) so it fits a terminal."""
    now = time.time() if now is None else now
    recs = run.steps
    last = recs[-1] if recs else {}
    age = now - num(last["time"]) if num(last.get("time")) is not None else None
    crashed = any(a.rule == "crashed" for a in alerts)
    state = "ended" if run.ended else ("crashed (no end event)" if crashed else "running")
    head = Text(f"epscale · {run.name} · step {last.get('step', '—')} · {state}", style="bold")
    if age is not None:
        head.append(f" · last record {age:,.0f}s ago", style="dim")

    scal = Table(box=None, padding=(0, 1), show_header=True, header_style="bold")
    for c in ("metric", "last", "trend"):
        scal.add_column(c)
    rows = [("loss", "loss", {}), ("grad norm", "grad_norm", {}), ("lr", "lr", {}),
            ("tokens/s", "tokens_per_s", {}), ("MFU", "mfu", {"pct": True}),
            ("step time", "step_time_s", {"ms": True}), ("comm share", "comm_share", {"pct": True}),
            ("MaxVio", "max_vio", {}), ("worst-rank idle", "worst_rank_idle", {"pct": True}),
            ("dropped", "dropped_frac", {"pct": True}), ("memory MB", "mem_mb", {})]
    for label, key, kw in rows:
        if key in last:
            scal.add_row(label, _f(last.get(key), **kw),
                         sparkline([num(r.get(key)) for r in recs[-200:]]))
    val = [r for r in recs if num(r.get("val_loss")) is not None]
    if val:
        scal.add_row("val loss", _f(val[-1]["val_loss"]), f"at step {val[-1]['step']}")

    parts: list[Any] = [head, Panel(scal, title="latest", title_align="left")]
    bd = last.get("time_breakdown") or {}
    total = sum(v for v in bd.values() if num(v) is not None and v > 0)
    if total > 0:
        t = Text()
        for k, v in bd.items():
            if num(v) is not None and v > 0:
                t.append(f"{k} {100 * v / total:.0f}%  ",
                         style="magenta" if k in ("dispatch", "combine", "sync") else "")
        parts.append(Panel(t, title="step-time breakdown", title_align="left"))

    lay = Table(show_header=True, header_style="bold", box=None, padding=(0, 1))
    for c in ("layer", "MaxVio", "entropy", "dropped", "bias range", "dead", "tokens per expert"):
        lay.add_column(c)
    all_layers = list(layers_of(last))
    shown_layers = all_layers
    if len(all_layers) > max_rows:  # keep the dashboard on one screen: worst layers first
        shown_layers = sorted(all_layers, key=_layer_vio, reverse=True)[:max_rows]
    for L in shown_layers:
        counts = [num(c) or 0.0 for c in (L.get("tokens_per_expert") or [])]
        mv = _layer_vio(L)
        bias = (num(L.get("bias_max")) - num(L.get("bias_min"))
                if num(L.get("bias_max")) is not None and num(L.get("bias_min")) is not None else None)
        dead = L.get("dead_experts")
        dead_txt = (str(len(dead)) if isinstance(dead, list) else
                    str(sum(1 for c in counts if c <= 0)) + "*")
        lay.add_row(str(L["layer"]), _f(mv), _f(L.get("router_entropy")),
                    _f(L.get("dropped_frac"), pct=True), _f(bias), dead_txt, load_bar(counts))
    if lay.row_count:
        more = (f", the {len(shown_layers)} of {len(all_layers)} with the highest MaxVio"
                if len(shown_layers) < len(all_layers) else "")
        parts.append(Panel(lay, title=f"MoE layers (dead*: no tokens this step{more})",
                           title_align="left"))

    ranks = Table(show_header=True, header_style="bold", box=None, padding=(0, 1))
    busy = isinstance(last.get("rank_wait_frac"), list)
    for c in ("rank", "host", "load", "idle", "busy" if busy else "step time", "heartbeat"):
        ranks.add_column(c)
    loads: list[float] = []
    for L in layers_of(last):
        rl = L.get("rank_load")
        if isinstance(rl, list) and rl:
            loads = [a + b for a, b in zip(loads, rl)] if len(loads) == len(rl) else list(rl)
    times = last.get("rank_step_time_s") if isinstance(last.get("rank_step_time_s"), list) else []
    waits = last.get("rank_wait_frac")
    if isinstance(waits, list) and len(waits) == len(times):  # busy = step time minus waits
        times = [t * (1 - w) if num(t) is not None and num(w) is not None else t
                 for t, w in zip(times, waits)]
    idle = last.get("rank_idle") if isinstance(last.get("rank_idle"), list) else []
    world = max(len(times), len(loads), len(run.heartbeats), run.world_size or 0)
    mean_load = sum(loads) / len(loads) if loads else 0
    rank_ids = list(range(world))
    if world > max_rows:  # the slowest ranks, then the most loaded
        rank_ids = sorted(rank_ids, key=lambda r: (-(times[r] if r < len(times) else 0),
                                                   -(loads[r] if r < len(loads) else 0)))[:max_rows]
    for r in rank_ids:
        hb = run.heartbeats.get(r, {})
        hb_age = now - num(hb.get("time")) if num(hb.get("time")) is not None else None
        ranks.add_row(str(r), str(hb.get("host", "—")),
                      f"{loads[r] / mean_load:.2f}x" if r < len(loads) and mean_load else "—",
                      _f(idle[r], pct=True) if r < len(idle) else "—",
                      _f(times[r], ms=True) if r < len(times) else "—",
                      (f"{hb_age:,.0f}s ago (step {hb.get('step', '?')})" if hb_age is not None
                       else "none"))
    if ranks.row_count:
        title = ("ranks" if len(rank_ids) == world
                 else f"ranks (the {len(rank_ids)} slowest of {world})")
        parts.append(Panel(ranks, title=title, title_align="left"))

    if alerts:
        body = Text("\n".join(a.line() for a in alerts), style="bold red")
        parts.append(Panel(body, title=f"{len(alerts)} alerts", title_align="left",
                           border_style="red"))
    else:
        parts.append(Panel(Text("all clear", style="green"), title="alerts", title_align="left",
                           border_style="green"))
    if run.warnings:
        parts.append(Text("\n".join(run.warnings[-3:]), style="yellow"))
    return Group(*parts)


class Follower:
    """Keeps a RunLog in step with a growing run directory."""

    def __init__(self, run_dir: Path):
        self.run = RunLog(Path(run_dir))
        self.tail = JsonlTail(self.run.run_dir / "metrics.jsonl")

    def poll(self) -> int:
        """Read what was appended; returns the number of new lines."""
        if self.run.config is None:
            self.run.config, warns = read_config(self.run.run_dir)
            self.run.warnings += warns
        objs, warns = self.tail.read()
        self.run.warnings += warns
        for obj in objs:
            self.run.add(obj, where=f"{self.tail.path.name}: a line ")
        if len(self.run.steps) > KEEP_RECORDS:
            del self.run.steps[:-KEEP_RECORDS]
        del self.run.events[:-KEEP_RECORDS]
        del self.run.warnings[:-50]
        refresh_heartbeats(self.run)
        return len(objs)


def follow(run_dir: Path, rules: AlertRules, interval: float = 2.0, exit_on_end: bool = False,
           console: Console | None = None, max_seconds: float | None = None) -> int:
    """Run the dashboard until Ctrl-C (exit 0), the run's end event when ``exit_on_end``
    (or, since a crashed run writes none, its processes all gone: see ``run_over``), or
    ``max_seconds``. Waits for metrics.jsonl to appear."""
    console = console or Console()
    fol = Follower(run_dir)
    start = time.monotonic()
    try:
        with Live(Text(f"waiting for {fol.tail.path} ..."), console=console,
                  refresh_per_second=4, transient=False) as live:
            while True:
                fol.poll()
                if fol.run.steps or fol.run.events:
                    live.update(render(fol.run, evaluate(fol.run, rules)))
                if exit_on_end and (fol.run.ended or run_over(fol.run) is not None):
                    break
                if max_seconds is not None and time.monotonic() - start > max_seconds:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0
