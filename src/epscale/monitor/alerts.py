"""Alert rules over a run's metrics: what an operator wants to hear about.

``evaluate(run, rules)`` returns a list of :class:`Alert`; each names what it is about
(a layer, expert or rank) and the step since when the condition has held. "State" rules
(imbalance, dead experts, drops, throughput, stragglers, communication share, bias
saturation, silent ranks) look at the condition's current streak: it must hold in the
latest records, for at least the configured number of records. "Event" rules (loss
spikes, non-finite values, elastic layout changes) report occurrences within the last
``recent_records`` records.
"Run" rules look at the run as a whole: it never trained a step (no_steps), it is over
without an 'end' event (crashed: known from ``evaluate(..., job_over=True)``, what
``--check --ended`` passes in a Slurm epilog, or from heartbeats whose processes have all
exited on this host), its latest checkpoint save failed (checkpoint_failed), or the
trainer stopped it because the loss diverged (diverged: too many rollbacks to one
checkpoint, or too many non-finite steps in a row).

Thresholds are fields of :class:`AlertRules` (defaults documented there); set them with
``epscale monitor RUN --check --rule imbalance_max_vio=2.0`` or a YAML file of the same
keys (``--rules FILE``; RUN_DIR/alerts.yaml is read when present).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError, apply_overrides, from_dict, load_yaml
from ..plan.layout import record_label
from .runlog import Fields, RunLog, finite, layers_of, num, processes_gone


@dataclass
class AlertRules:
    """Alert thresholds. Counts of "records" are metrics.jsonl step lines (one per
    logged step).

    imbalance_max_vio (2.0): a layer whose MaxVio (max expert load / mean - 1) stays above
        this for ``imbalance_steps`` (20) records is imbalanced: its hottest expert does
        over 3x its fair share. A router that is merely uneven early in training does not
        fire (the tiny byte-level recipe starts near 1); a collapsed one does (all tokens
        on the same K of E experts gives E/K - 1, e.g. 3 for top-2 of 8, 7 for top-1).
    dead_expert_steps (20): an expert with no tokens for this many consecutive records is
        dead.
    max_drop_frac (0.05): capacity drops above 5% of a layer's assignments for
        ``drop_steps`` (10) records.
    loss_spike_factor (1.5): a loss above 1.5x the median of the previous ``loss_window``
        (50) records is a spike (needs ``min_history`` (10) records before it).
    throughput_drop (0.7): tokens/s below 0.7x the median of the previous
        ``throughput_window`` (50) records, for ``throughput_steps`` (5) records.
    straggler_factor (1.3): a rank whose busy time (step time minus waits, else step
        time) exceeds 1.3x the median over ranks, for ``straggler_steps`` (10) records.
    max_comm_share (0.5): communication above half of the step time for ``comm_steps``
        (10) records.
    bias_saturation (1.0): an expert-bias range (max - min) at or above 1.0, the scale of
        the router scores, so the bias rather than the token decides the routing.
    heartbeat_timeout_s (300): a rank of a run that has not ended whose heartbeat is older
        than this (or missing) is silent. A run known to be over (``--ended``, or every
        rank's process gone on this host) is judged at once instead: without an 'end'
        event it crashed.
    recent_records (200): how far back the event rules (spikes, non-finite) look.
    """

    imbalance_max_vio: float = 2.0
    imbalance_steps: int = 20
    dead_expert_steps: int = 20
    max_drop_frac: float = 0.05
    drop_steps: int = 10
    loss_spike_factor: float = 1.5
    loss_window: int = 50
    min_history: int = 10
    throughput_drop: float = 0.7
    throughput_window: int = 50
    throughput_steps: int = 5
    straggler_factor: float = 1.3
    straggler_steps: int = 10
    max_comm_share: float = 0.5
    comm_steps: int = 10
    bias_saturation: float = 1.0
    heartbeat_timeout_s: float = 300.0
    recent_records: int = 200

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ConfigError(f"alert rule '{f.name}' = {v!r} is invalid: must be a "
                                      "positive integer")
            elif not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ConfigError(f"alert rule '{f.name}' = {v!r} is invalid: must be a "
                                  "number > 0")
        if self.throughput_drop >= 1:
            raise ConfigError(f"alert rule 'throughput_drop' = {self.throughput_drop!r} is "
                              "invalid: must be in (0, 1) (a fraction of the rolling median)")
        for name in ("max_comm_share", "max_drop_frac"):
            if getattr(self, name) > 1:
                raise ConfigError(f"alert rule '{name}' = {getattr(self, name)!r} is invalid: "
                                  "must be in (0, 1]")

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> "AlertRules":
        """Rules from an optional YAML file of these keys, then ``key=value`` overrides."""
        data = load_yaml(path) if path is not None else {}
        data = apply_overrides(data, overrides or [])
        try:
            return from_dict(cls, data, prefix="alerts")
        except ConfigError as e:
            where = f" (in {path})" if path is not None else ""
            raise ConfigError(f"{e}{where}") from None


@dataclass
class Alert:
    """One finding. ``rule``: the rule's name; ``subject``: 'layer 2', 'rank 5 (node01)',
    'layer 0 experts 1,2' or 'run'; ``since_step``: first step of the condition."""

    rule: str
    subject: str
    since_step: int | None
    message: str
    layer: int | None = None
    expert: list[int] | None = None
    rank: int | None = None

    def line(self) -> str:
        since = f"since step {self.since_step}" if self.since_step is not None else "since start"
        return f"ALERT {self.rule}: {self.subject} {since}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "subject": self.subject, "since_step": self.since_step,
                "message": self.message, "layer": self.layer, "expert": self.expert,
                "rank": self.rank}


# ---------------------------------------------------------------------- helpers


def _streak(steps: list[int], flags: list[bool | None]) -> tuple[int, int | None]:
    """Length and first step of the run of True at the end of ``flags`` (None entries,
    records without the field, neither break nor extend it)."""
    n, since = 0, None
    for step, flag in zip(reversed(steps), reversed(flags)):
        if flag is None:
            continue
        if not flag:
            break
        n, since = n + 1, step
    return n, since


def _layer_series(run: RunLog, key: str) -> dict[int, tuple[list[int], list[Any]]]:
    out: dict[int, tuple[list[int], list[Any]]] = {}
    for rec in run.steps:
        for lay in layers_of(rec):
            s, v = out.setdefault(lay["layer"], ([], []))
            s.append(rec["step"])
            v.append(lay.get(key))
    return out


def _fmt_ids(ids: list[int], limit: int = 12) -> str:
    text = ",".join(str(i) for i in ids[:limit])
    return text + (f",... ({len(ids)} in all)" if len(ids) > limit else "")


# ---------------------------------------------------------------------- rules


def rule_imbalance(run: RunLog, r: AlertRules) -> list[Alert]:
    out = []
    all_counts = _layer_series(run, "tokens_per_expert")
    for lid, (steps, vals) in _layer_series(run, "max_vio").items():
        counts_series = all_counts[lid][1]
        mv = []
        for v, counts in zip(vals, counts_series):
            if num(v) is None and isinstance(counts, list) and counts:
                mean = sum(counts) / len(counts)
                v = max(counts) / mean - 1 if mean > 0 else None
            mv.append(num(v))
        n, since = _streak(steps, [None if v is None else v > r.imbalance_max_vio for v in mv])
        if n >= r.imbalance_steps:
            last = next(v for v in reversed(mv) if v is not None)
            counts = next((c for c in reversed(counts_series) if isinstance(c, list) and c), None)
            hot = ""
            if counts and sum(counts) > 0:
                e = max(range(len(counts)), key=lambda i: counts[i])
                hot = f"; hottest expert {e} takes {100 * counts[e] / sum(counts):.0f}% of assignments"
            out.append(Alert("imbalance", f"layer {lid}", since,
                             f"MaxVio {last:.2f} > {r.imbalance_max_vio:g} for {n} records{hot}",
                             layer=lid))
    return out


def rule_dead_experts(run: RunLog, r: AlertRules) -> list[Alert]:
    out = []
    for lid, (steps, vals) in _layer_series(run, "tokens_per_expert").items():
        rows = [(s, v) for s, v in zip(steps, vals) if isinstance(v, list) and v]
        if len(rows) < r.dead_expert_steps:
            continue
        E = len(rows[-1][1])
        dead, since = [], None
        for e in range(E):
            n, first = 0, None
            for s, counts in reversed(rows):
                if e >= len(counts) or counts[e] > 0:
                    break
                n, first = n + 1, s
            if n >= r.dead_expert_steps:
                dead.append(e)
                since = first if since is None else min(since, first)
        if dead:
            out.append(Alert("dead_experts", f"layer {lid} expert{'s' if len(dead) > 1 else ''} "
                             f"{_fmt_ids(dead)}", since,
                             f"{len(dead)} of {E} experts got no tokens for >= "
                             f"{r.dead_expert_steps} records", layer=lid, expert=dead))
    return out


def rule_drops(run: RunLog, r: AlertRules) -> list[Alert]:
    out = []
    series = _layer_series(run, "dropped_frac")
    if not series:  # no per-layer numbers: the step-level one
        series = {-1: ([rec["step"] for rec in run.steps], [rec.get("dropped_frac") for rec in run.steps])}
    for lid, (steps, vals) in series.items():
        flags = [None if num(v) is None else num(v) > r.max_drop_frac for v in vals]
        n, since = _streak(steps, flags)
        if n >= r.drop_steps:
            last = next(num(v) for v in reversed(vals) if num(v) is not None)
            subject = f"layer {lid}" if lid >= 0 else "run"
            out.append(Alert("drop_rate", subject, since,
                             f"{100 * last:.1f}% of assignments dropped (> "
                             f"{100 * r.max_drop_frac:g}%) for {n} records",
                             layer=lid if lid >= 0 else None))
    return out


def _rolling_median_rule(run: RunLog, key: str, r: AlertRules, window: int,
                         test: Callable[[float, float], bool]) -> list[tuple[int, float, float]]:
    """(step, value, median of the previous ``window`` finite values) where ``test`` holds,
    from record ``min_history`` on."""
    hits, hist = [], []
    for rec in run.steps:
        v = num(rec.get(key))
        if v is None or not math.isfinite(v):
            continue
        if len(hist) >= r.min_history:
            med = statistics.median(hist[-window:])
            if test(v, med):
                hits.append((rec["step"], v, med))
        hist.append(v)
    return hits


def rule_loss_spike(run: RunLog, r: AlertRules) -> list[Alert]:
    recent = {rec["step"] for rec in run.steps[-r.recent_records:]}
    hits = [h for h in _rolling_median_rule(run, "loss", r, r.loss_window,
                                            lambda v, m: m > 0 and v > r.loss_spike_factor * m)
            if h[0] in recent]
    if not hits:
        return []
    worst = max(hits, key=lambda h: h[1] / h[2])
    return [Alert("loss_spike", "run", hits[0][0],
                  f"{len(hits)} loss spike{'s' if len(hits) > 1 else ''} > "
                  f"{r.loss_spike_factor:g}x the rolling median; worst at step {worst[0]}: "
                  f"{worst[1]:.3f} vs median {worst[2]:.3f}")]


def rule_nonfinite(run: RunLog, r: AlertRules) -> list[Alert]:
    recent = run.steps[-r.recent_records:]
    first_recent = recent[0]["step"] if recent else None
    bad: list[tuple[int, str]] = []
    for rec in recent:
        keys = [k for k in ("loss", "grad_norm", "val_loss") if num(rec.get(k)) is not None
                and not finite(rec.get(k))]
        keys += [k for k in ("loss", "grad_norm") if k in rec and rec[k] is None]
        if rec.get("skipped") is True and not keys:
            keys = ["skipped"]
        for lay in layers_of(rec):
            if (num(lay.get("nonfinite_inputs")) or 0) > 0:
                keys.append(f"layer {lay['layer']} inputs")
        if keys:
            bad.append((rec["step"], "/".join(sorted(set(keys)))))
    for ev in run.events:
        if ev.get("event") in ("skip_nonfinite", "rollback") and isinstance(ev.get("step"), int):
            if first_recent is None or ev["step"] >= first_recent:
                bad.append((ev["step"], f"{ev['event']} event"))
    if not bad:
        return []
    bad.sort()
    steps = sorted({s for s, _ in bad})
    what = sorted({w for _, w in bad})
    return [Alert("nonfinite", "run", steps[0],
                  f"non-finite values at {len(steps)} step{'s' if len(steps) > 1 else ''} "
                  f"({_fmt_ids(steps, 6)}): {', '.join(what)}")]


def rule_throughput(run: RunLog, r: AlertRules) -> list[Alert]:
    hits = _rolling_median_rule(run, "tokens_per_s", r, r.throughput_window,
                                lambda v, m: v < r.throughput_drop * m)
    hit_steps = {h[0]: h for h in hits}
    steps = [rec["step"] for rec in run.steps if finite(rec.get("tokens_per_s"))]
    if len(steps) <= r.min_history:
        return []
    n, since = _streak(steps, [s in hit_steps for s in steps])
    if n < r.throughput_steps:
        return []
    _s, v, med = hit_steps[steps[-1]]
    return [Alert("throughput", "run", since,
                  f"{v:,.0f} tokens/s is {100 * v / med:.0f}% of the rolling median "
                  f"{med:,.0f} (< {100 * r.throughput_drop:g}%) for {n} records")]


def _busy_times(rec: dict[str, Any]) -> list[float] | None:
    times = rec.get("rank_step_time_s")
    if not isinstance(times, list) or len(times) < 2 or not all(finite(t) for t in times):
        return None
    waits = rec.get("rank_wait_frac")
    if isinstance(waits, list) and len(waits) == len(times) and all(finite(w) for w in waits):
        return [t * (1 - w) for t, w in zip(times, waits)]
    return [float(t) for t in times]


def rule_straggler(run: RunLog, r: AlertRules, hosts: dict[int, str] | None = None) -> list[Alert]:
    per_rank: dict[int, tuple[list[int], list[bool | None]]] = {}
    ratios: dict[int, float] = {}
    for rec in run.steps:
        busy = _busy_times(rec)
        for rank in per_rank:
            if busy is None or rank >= len(busy):
                per_rank[rank][0].append(rec["step"])
                per_rank[rank][1].append(None)
        if busy is None:
            continue
        med = statistics.median(busy)
        for rank, b in enumerate(busy):
            s, f = per_rank.setdefault(rank, ([], []))
            s.append(rec["step"])
            f.append(med > 0 and b > r.straggler_factor * med)
            ratios[rank] = b / med if med > 0 else 0.0
    out = []
    for rank, (steps, flags) in sorted(per_rank.items()):
        n, since = _streak(steps, flags)
        if n >= r.straggler_steps:
            host = f" ({hosts[rank]})" if hosts and rank in hosts else ""
            out.append(Alert("straggler", f"rank {rank}{host}", since,
                             f"busy {ratios[rank]:.2f}x the median rank (> "
                             f"{r.straggler_factor:g}x) for {n} records", rank=rank))
    return out


def rule_comm_share(run: RunLog, r: AlertRules) -> list[Alert]:
    steps = [rec["step"] for rec in run.steps]
    vals = [num(rec.get("comm_share")) for rec in run.steps]
    n, since = _streak(steps, [None if v is None else v > r.max_comm_share for v in vals])
    if n < r.comm_steps:
        return []
    last = next(v for v in reversed(vals) if v is not None)
    return [Alert("comm_share", "run", since,
                  f"communication is {100 * last:.0f}% of the step (> "
                  f"{100 * r.max_comm_share:g}%) for {n} records")]


def rule_bias_saturation(run: RunLog, r: AlertRules) -> list[Alert]:
    lo, hi = _layer_series(run, "bias_min"), _layer_series(run, "bias_max")
    out = []
    for lid, (steps, mins) in lo.items():
        maxs = hi.get(lid, ([], []))[1]
        rng = [None if num(a) is None or num(b) is None else num(b) - num(a)
               for a, b in zip(mins, maxs)]
        n, since = _streak(steps, [None if x is None else x >= r.bias_saturation for x in rng])
        if n >= 1:
            last = next(x for x in reversed(rng) if x is not None)
            out.append(Alert("bias_saturation", f"layer {lid}", since,
                             f"expert-bias range {last:.3g} >= {r.bias_saturation:g}: the bias, "
                             "not the token, decides the routing", layer=lid))
    return out


def rule_silent_rank(run: RunLog, r: AlertRules, now: float,
                     over: str | None = None) -> list[Alert]:
    """Ranks of a run still believed to be running whose heartbeat went stale (``over``:
    the run is known to be over, so rule_crashed speaks for it instead)."""
    if run.ended or over is not None or not run.has_heartbeat_dir:
        return []
    world = run.world_size or (max(run.heartbeats) + 1 if run.heartbeats else 0)
    out = []
    for rank in range(world):
        hb = run.heartbeats.get(rank)
        if hb is None:
            out.append(Alert("silent_rank", f"rank {rank}", None,
                             "no heartbeat file (heartbeats/rank%d.json)" % rank, rank=rank))
            continue
        t = num(hb.get("time"))
        age = now - t if t is not None else float("inf")
        if age > r.heartbeat_timeout_s:
            host = f" ({hb['host']})" if hb.get("host") else ""
            step = hb.get("step") if isinstance(hb.get("step"), int) else None
            out.append(Alert("silent_rank", f"rank {rank}{host}", step,
                             f"no heartbeat for {age:,.0f}s (> {r.heartbeat_timeout_s:g}s); "
                             f"last at step {step}", rank=rank))
    return out


def rule_no_steps(run: RunLog, over: str | None) -> list[Alert]:
    """A run with no step record at all: it never trained a step (it failed while setting
    up: data, layout, memory, a rank that never joined), or it is still starting up."""
    if run.steps:
        return []
    if over is not None or run.ended:
        when = "the run is over without training a step"
    else:
        when = "the run has not trained a step (it failed while starting, or is still starting)"
    return [Alert("no_steps", "run", None,
                  f"metrics.jsonl holds no step records: {when}; see {run.run_dir}/logs/ "
                  "and the job's output for why")]


def rule_crashed(run: RunLog, over: str | None) -> list[Alert]:
    """A run known to be over (``over`` says how we know) whose metrics.jsonl has no 'end'
    event after its last start: the trainer did not get to write it, so it crashed or was
    killed. Flagged at once: no heartbeat timeout to wait for."""
    if over is None or run.ended:
        return []
    last = run.last_step
    ckpt = run.last_checkpoint_step
    resume = (f"run again with the same --run-dir to resume from the checkpoint of step {ckpt}"
              if ckpt is not None else "no checkpoint was saved, so a rerun starts over")
    at = f"after step {last}" if last is not None else "before the first step"
    return [Alert("crashed", "run", last,
                  f"no 'end' event {at} and {over}: the run crashed or was killed; see "
                  f"{run.run_dir}/logs/ and the job's output for why, then {resume}")]


def rule_checkpoint_failed(run: RunLog) -> list[Alert]:
    """The latest checkpoint attempt failed (a 'checkpoint_failed' event after the last
    'checkpoint'): training goes on, but a crash now loses every step since the last save."""
    failures: list[dict[str, Any]] = []
    for ev in run.events:
        if ev.get("event") == "checkpoint":
            failures = []
        elif ev.get("event") == "checkpoint_failed":
            failures.append(ev)
    if not failures:
        return []
    last, first = failures[-1], failures[0]
    step = last.get("step") if isinstance(last.get("step"), int) else None
    in_row = last.get("failures_in_a_row", len(failures))
    limit = (f" of at most {last['limit']}, then the run stops"
             if isinstance(last.get("limit"), int) else "")
    saved = run.last_checkpoint_step
    saved_txt = (f"the newest saved checkpoint is step {saved}" if saved is not None
                 else "no checkpoint has been saved")
    return [Alert("checkpoint_failed", "run",
                  first.get("step") if isinstance(first.get("step"), int) else step,
                  f"checkpoint at step {step} failed: {last.get('error', '(no error given)')} "
                  f"({in_row} failure{'s' if in_row != 1 else ''} in a row{limit}); "
                  f"{saved_txt}, so a crash now loses every step since: fix the cause (free "
                  f"disk space, the permissions of {run.run_dir}/checkpoints)")]


def rule_diverged(run: RunLog) -> list[Alert]:
    """The trainer stopped the run because it diverged (a 'diverged' event after the last
    'start'): the loss spiked again after ``train.max_rollbacks`` rollbacks to the same
    checkpoint (reason ``rollback_limit``), or ``train.max_skipped_steps`` steps in a row
    were non-finite (``skipped_steps``). The event's message says what to change."""
    last = None
    for ev in run.events:
        if ev.get("event") == "start":
            last = None
        elif ev.get("event") == "diverged":
            last = ev
    if last is None:
        return []
    step = last.get("step") if isinstance(last.get("step"), int) else None
    return [Alert("diverged", "run", step,
                  f"the run stopped at step {step} ({last.get('reason', '?')}): "
                  f"{last.get('message', '(no message)')}")]


def rule_layout_change(run: RunLog, r: AlertRules) -> list[Alert]:
    """An elastic restart changed the layout (a 'layout_change' event within the last
    ``recent_records`` records): ranks lost or joined, the grad_accum that keeps the
    global batch, the steps trained again and how long the resume took."""
    recent = run.steps[-r.recent_records:]
    first_recent = recent[0]["step"] if recent else None
    out = []
    for ev in run.events:
        if ev.get("event") != "layout_change" or not isinstance(ev.get("step"), int):
            continue
        if first_recent is not None and ev["step"] < first_recent:
            continue
        old, new = ev.get("old") or {}, ev.get("new") or {}
        lost = num(ev.get("ranks_lost")) or 0
        hosts = ev.get("hosts_lost" if lost > 0 else "hosts_gained") or {}
        where = f" ({', '.join(f'{h} x{n}' for h, n in hosts.items())})" if hosts else ""
        who = (f"{int(lost)} rank(s) lost{where}" if lost > 0 else
               f"{int(-lost)} rank(s) joined{where}" if lost < 0 else "same size")
        timing = ""
        if num(ev.get("resume_s")) is not None:
            parts = ", ".join(f"{k[:-2].replace('_', ' ')} {ev[k]:.1f}" for k in
                              ("outage_s", "setup_s", "load_s", "first_step_s")
                              if num(ev.get(k)) is not None)
            timing = f"; back {ev['resume_s']:.1f} s after the last step ({parts} s)"
        again = ev.get("steps_lost")
        batch = ""
        if old.get("grad_accum") is not None and new.get("grad_accum") is not None:
            batch = (f"; grad_accum {old['grad_accum']} -> {new['grad_accum']} keeps the "
                     f"global batch of {new.get('global_batch', '?')}")
        lost_steps = (f"; {again} step(s) since the checkpoint trained again"
                      if again is not None else "")
        out.append(Alert(
            "layout_change", "run", ev["step"],
            f"step {ev['step']}: layout {old.get('world_size')} -> {new.get('world_size')} "
            f"processes ({record_label(old)} -> {record_label(new)}), {who}{batch}"
            f"{lost_steps}{timing}"))
    return out


# What the rules read of a step record and of its layers: `monitor --check` loads only
# these of a long run's older records (load_run(..., fields=CHECK_FIELDS)). A rule that
# reads another key must add it here (tests/test_monitor_stream.py compares the alerts of
# a slimmed and a whole run).
CHECK_FIELDS = Fields(
    top=frozenset({"step", "time", "loss", "grad_norm", "val_loss", "skipped", "tokens_per_s",
                   "dropped_frac", "comm_share", "rank_step_time_s", "rank_wait_frac",
                   "world_size", "layers", "comm_s", "comm_exposed_s", "comm_exposed_share",
                   "comm_by_kind"}),
    layer=frozenset({"layer", "max_vio", "tokens_per_expert", "dropped_frac", "bias_min",
                     "bias_max", "nonfinite_inputs"}))


RULES = ("imbalance", "dead_experts", "drop_rate", "loss_spike", "nonfinite", "throughput",
         "straggler", "comm_share", "bias_saturation", "silent_rank", "no_steps", "crashed",
         "checkpoint_failed", "layout_change", "diverged")


def run_over(run: RunLog, job_over: bool = False) -> str | None:
    """How we know the run's processes are over, or None when they may still be running:
    the caller says the job is over (``--ended``, e.g. in a Slurm epilog), or every
    heartbeat names a process of this host that has exited."""
    if job_over:
        return "the job is over (--ended)"
    return processes_gone(run)


def evaluate(run: RunLog, rules: AlertRules | None = None, now: float | None = None,
             job_over: bool = False) -> list[Alert]:
    """All alerts of ``run`` under ``rules`` (defaults when None). ``now``: the time the
    heartbeats are judged against (default: the current time). ``job_over``: the caller
    knows the job has finished (a Slurm epilog, ``--check --ended``), so a missing 'end'
    event means it crashed, without waiting for the heartbeat timeout."""
    r = rules or AlertRules()
    now = time.time() if now is None else now
    over = run_over(run, job_over)
    hosts = {k: str(v["host"]) for k, v in run.heartbeats.items() if v.get("host")}
    alerts: list[Alert] = []
    alerts += rule_crashed(run, over)
    alerts += rule_no_steps(run, over)
    alerts += rule_checkpoint_failed(run)
    alerts += rule_diverged(run)
    alerts += rule_layout_change(run, r)
    alerts += rule_nonfinite(run, r)
    alerts += rule_loss_spike(run, r)
    alerts += rule_imbalance(run, r)
    alerts += rule_dead_experts(run, r)
    alerts += rule_drops(run, r)
    alerts += rule_bias_saturation(run, r)
    alerts += rule_throughput(run, r)
    alerts += rule_straggler(run, r, hosts)
    alerts += rule_comm_share(run, r)
    alerts += rule_silent_rank(run, r, now, over)
    return alerts
