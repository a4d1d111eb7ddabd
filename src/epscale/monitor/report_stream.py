"""The report's plotted series, built while metrics.jsonl streams past (a long run's
records are never all held in memory).

`epscale monitor RUN_DIR` reads metrics.jsonl once (``load_run(..., observe=...)``): the
run log keeps each step record slimmed to what the alert rules read
(``alerts.CHECK_FIELDS``; its newest records whole, for the header), and
:class:`ReportSeries` sees the whole record. A run of at most ``max_points`` step records
(the usual short run) is kept whole and its series are exactly those of
``report.build_series`` on the whole file. A longer one is downsampled while streaming:
consecutive step records are reduced in buckets of ``k = ceil(lines / max_points)``
records (so at most ``max_points`` columns) by ``report.build_series`` itself, one column
per bucket (means; the bucket maximum of loss and grad norm; MaxVio and drop rate: the
maximum; expert load: summed counts), so a spike stays visible. The newest ``tail``
records stay whole until a rollback can no longer plausibly drop them; a rollback further
back than that drops the reduced buckets it reaches (a reading warning says so).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .alerts import CHECK_FIELDS
from .report import build_series
from .runlog import Fields, RunLog, count_lines, read_config


class ReportSeries:
    """Pass :meth:`add` as ``load_run``'s ``observe``; then :meth:`finish` with the log."""

    def __init__(self, run_dir: str | Path, max_points: int = 1000,
                 fields: Fields = CHECK_FIELDS, tail: int = 2000):
        self.run_dir, self.max_points = Path(run_dir), max_points
        self.fields, self.tail = fields, tail
        try:
            lines = count_lines(self.run_dir / "metrics.jsonl")
        except OSError:
            lines = 0
        self.k = max(1, math.ceil(lines / max_points))  # records per bucket
        self.config = read_config(self.run_dir)[0]
        self.pending: list[dict[str, Any]] = []  # the newest records, whole
        self.parts: list[tuple[int, int, dict[str, Any]]] = []  # (first, last step, series)
        self.dropped_buckets = 0

    def add(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Take one whole step line; return what the run log keeps of it."""
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            return rec  # the log warns about it
        rec["step"] = step = int(step)
        pend = self.pending
        if pend and pend[-1]["step"] == step:
            pend[-1] = {**pend[-1], **rec}  # the same merge as RunLog.add
        else:
            while pend and pend[-1]["step"] >= step:
                pend.pop()  # abandoned timeline
            while not pend and self.parts and self.parts[-1][1] >= step:
                self.parts.pop()
                self.dropped_buckets += 1
            pend.append(rec)
        if self.k > 1 and len(pend) >= self.k + self.tail:
            self._seal(pend[:self.k])
            del pend[:self.k]
        return self.fields.slim(rec)

    def _seal(self, chunk: list[dict[str, Any]]) -> None:
        run = RunLog(self.run_dir, steps=chunk, config=self.config)
        self.parts.append((chunk[0]["step"], chunk[-1]["step"], build_series(run, max_points=1)))

    def finish(self, log: RunLog) -> dict[str, Any]:
        """The series of the whole run; ``log``'s newest records are made whole again."""
        whole = {r["step"]: r for r in self.pending}
        log.steps = [whole.get(r["step"], r) for r in log.steps]
        if self.dropped_buckets:
            log.warnings.append(f"a rollback reached {self.dropped_buckets} already "
                                "downsampled bucket(s) of the report's plots; the steps they "
                                "held before the rollback are not plotted")
        if not self.parts:  # nothing reduced yet: exactly the whole-file series
            run = RunLog(self.run_dir, steps=self.pending, config=self.config)
            return build_series(run, self.max_points)
        for i in range(0, len(self.pending), self.k):
            self._seal(self.pending[i:i + self.k])
        self.pending = []
        return merge_series([p for _a, _b, p in self.parts])


def _concat(parts: list[dict[str, Any]], get, width) -> list[Any]:
    """Concatenate ``get(part)`` over parts; a part without it gives ``width(part)`` Nones."""
    out: list[Any] = []
    for p in parts:
        v = get(p)
        out += v if v is not None else [None] * width(p)
    return out


def merge_series(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Join the one-column series of consecutive buckets into the run's series."""
    nx = lambda p: len(p["x"])  # noqa: E731
    nl = lambda p: len(p["layer_x"])  # noqa: E731
    out: dict[str, Any] = {"x": _concat(parts, lambda p: p["x"], nx),
                           "layer_x": _concat(parts, lambda p: p["layer_x"], nl)}
    for group in ("scalars", "breakdown"):
        keys = list(dict.fromkeys(k for p in parts for k in p[group]))
        out[group] = {}
        for k in keys:
            base = k[:-4] if k.endswith("_max") else None  # a 1-record bucket: max = value
            out[group][k] = _concat(
                parts, lambda p: p[group].get(k, p[group].get(base) if base else None), nx)
    out["val_loss"] = _concat(parts, lambda p: p["val_loss"], nx)
    out["bad_steps"] = _concat(parts, lambda p: p["bad_steps"], nx)
    ids = sorted({L["layer"] for p in parts for L in p["layers"]})
    layers = []
    for lid in ids:
        mine = [{L["layer"]: L for L in p["layers"]}.get(lid) for p in parts]
        entry: dict[str, Any] = {"layer": lid, "num_experts": max(
            (L["num_experts"] for L in mine if L), default=0)}
        for key in ("load", "max_vio", "dropped_frac", "router_entropy", "bias_range"):
            entry[key] = _concat(list(zip(parts, mine)),
                                 lambda pm: pm[1][key] if pm[1] else None, lambda pm: nl(pm[0]))
        layers.append(entry)
    out["layers"] = layers
    ranks: dict[str, Any] = {}
    with_ep = [p["ranks"] for p in parts if "num_ep" in p["ranks"]]
    if with_ep:
        ranks["num_ep"] = max(r["num_ep"] for r in with_ep)
        ranks["load"] = _concat(parts, lambda p: p["ranks"].get("load"), nl)
        _rank_lines(ranks, parts, "idle", nl)
    if any("time" in p["ranks"] for p in parts):
        _rank_lines(ranks, parts, "time", nx)
        ranks["time_is_busy"] = any(p["ranks"].get("time_is_busy") for p in parts)
    out["ranks"] = ranks
    return out


def _rank_lines(ranks: dict[str, Any], parts: list[dict[str, Any]], key: str, width) -> None:
    """Per-rank lines ``key`` (names ``key + '_names'``) joined over parts; the names of
    the part with the most lines."""
    names = max((p["ranks"].get(f"{key}_names") or [] for p in parts), key=len)
    ranks[f"{key}_names"] = names

    def line(p: dict[str, Any], i: int) -> list[Any] | None:
        lines = p["ranks"].get(key) or []
        return lines[i] if i < len(lines) else None

    ranks[key] = [_concat(parts, lambda p: line(p, i), width) for i in range(len(names))]
