"""Reading a run directory: metrics.jsonl, config.yaml and heartbeats, tolerantly.

The reader accepts any file that follows the metrics.jsonl contract (see
``epscale.metrics``) and treats every field except ``step`` as optional. Damage is
skipped with a warning, never fatal: a truncated last line (a crash mid-write), a line
that is not JSON, a half-written heartbeat file. When step numbers go back (a rollback or
a resume from an older checkpoint), the records from the abandoned timeline are dropped so
the plots and rules see the trajectory the run actually kept (the events stay); a second
line for the same step is merged into the first (e.g. a separate ``val_loss`` line).

Whether a run is over is read from its own files where it can be: ``processes_gone`` says
so when every heartbeat was written on this host, by this attempt, by a process that no
longer exists (the monitor must see the trainer's processes: same host and pid namespace).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from ..config import yaml_load


@dataclass
class RunLog:
    """Everything known about one run. ``steps``: step records in step order;
    ``events``: non-step lines; ``heartbeats``: rank -> latest heartbeat dict;
    ``warnings``: what was skipped and why."""

    run_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] | None = None
    heartbeats: dict[int, dict[str, Any]] = field(default_factory=dict)
    has_heartbeat_dir: bool = False
    warnings: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ building
    def add(self, rec: dict[str, Any], where: str = "") -> None:
        """Add one parsed line (a step record or an event)."""
        if "event" in rec:
            self.events.append(rec)
            return
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            self.warnings.append(f"{where}has no integer 'step' and no 'event'; skipped")
            return
        rec["step"] = int(step)
        if self.steps and self.steps[-1]["step"] == rec["step"]:
            self.steps[-1] = {**self.steps[-1], **rec}  # e.g. a separate val_loss line
            return
        while self.steps and self.steps[-1]["step"] >= rec["step"]:
            self.steps.pop()  # abandoned timeline (rollback / resume)
        self.steps.append(rec)

    # ------------------------------------------------------------------ queries
    @property
    def name(self) -> str:
        if self.config and isinstance(self.config.get("name"), str):
            return self.config["name"]
        return self.run_dir.name

    @property
    def ended(self) -> bool:
        """True when the log holds an 'end' event after the last 'start'/'resume'."""
        state = False
        for ev in self.events:
            if ev.get("event") == "end":
                state = True
            elif ev.get("event") in ("start", "resume"):
                state = False
        return state

    @property
    def last_start_time(self) -> float | None:
        """Time of the last 'start'/'resume' event (when the current attempt began)."""
        for ev in reversed(self.events):
            if ev.get("event") in ("start", "resume"):
                return num(ev.get("time"))
        return None

    @property
    def last_checkpoint_step(self) -> int | None:
        """Step of the newest checkpoint saved (a 'checkpoint' event), None when none was."""
        for ev in reversed(self.events):
            if ev.get("event") == "checkpoint" and isinstance(ev.get("step"), int):
                return ev["step"]
        return None

    @property
    def last_step(self) -> int | None:
        return self.steps[-1]["step"] if self.steps else None

    @property
    def world_size(self) -> int | None:
        """dp x ep from config.yaml, else what the records or heartbeats show."""
        par = (self.config or {}).get("parallel") or {}
        try:
            if par:
                return int(par.get("dp", 1)) * int(par.get("ep", 1))
        except (TypeError, ValueError):
            pass
        for rec in reversed(self.steps):
            if isinstance(rec.get("world_size"), int):
                return rec["world_size"]
            if isinstance(rec.get("rank_step_time_s"), list):
                return len(rec["rank_step_time_s"])
        return max(self.heartbeats) + 1 if self.heartbeats else None

    def layer_ids(self) -> list[int]:
        """Every layer id seen in any record's ``layers``, sorted."""
        ids: set[int] = set()
        for rec in self.steps:
            for lay in layers_of(rec):
                ids.add(lay["layer"])
        return sorted(ids)


def layers_of(rec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A record's well-formed layer entries (dicts with an integer ``layer``)."""
    for i, lay in enumerate(rec.get("layers") or []):
        if isinstance(lay, dict):
            lid = lay.get("layer", i)
            if isinstance(lid, int) and not isinstance(lid, bool):
                if "layer" not in lay:
                    lay = {**lay, "layer": lid}
                yield lay


def num(v: Any) -> float | None:
    """A number as float (NaN/inf kept), None for anything else (missing, bool, text)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def fmt_value(v: Any, pct: bool = False, ms: bool = False) -> str:
    """A metric for people: '—' when missing, a percentage, milliseconds, or 4 significant
    digits (thousands separators from 10,000 on)."""
    x = num(v)
    if x is None:
        return "—"
    if not math.isfinite(x):
        return str(x)
    if pct:
        return f"{100 * x:.1f}%"
    if ms:
        return f"{1e3 * x:.1f} ms"
    return f"{x:,.0f}" if abs(x) >= 1e4 else f"{x:.4g}"


def finite(v: Any) -> bool:
    x = num(v)
    return x is not None and math.isfinite(x)


def parse_line(text: str, hook=None) -> dict[str, Any] | None:
    """One JSONL line -> dict, or None when it is not a JSON object."""
    try:
        obj = json.loads(text, object_pairs_hook=hook)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


BLOCK_BYTES = 1 << 20  # metrics.jsonl is read and parsed this much at a time


def _parse_block(raws: list[bytes], first_line: int, name: str, keep: frozenset[str] | None = None,
                 slim_before: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
    """The JSON objects of complete lines ``raws`` (line numbers from ``first_line``):
    parsed as one JSON array, so the records share their key strings (a long run's keys
    then cost once, not once per record) and the parser runs once per block; a block with
    a damaged line is parsed line by line to skip just that line. ``keep``: step records
    on lines before ``slim_before`` keep only these keys, at every level (events stay
    whole): their other values are never built."""
    numbered = [(first_line + i, r) for i, r in enumerate(raws) if r.strip()]
    groups = [numbered]
    if keep is not None:
        slimmed = [(n, r) for n, r in numbered if n < slim_before and b'"event"' not in r]
        groups = [slimmed, [(n, r) for n, r in numbered if not (n < slim_before and
                                                               b'"event"' not in r)]]
    out, warns = [], []
    for i, group in enumerate(groups):
        hook = ((lambda pairs: {k: v for k, v in pairs if k in keep})
                if keep is not None and i == 0 else None)
        try:
            objs = json.loads(b"[" + b",".join(r for _, r in group) + b"]",
                              object_pairs_hook=hook)
        except ValueError:
            objs = [parse_line(r.decode("utf-8", errors="replace"), hook) for _, r in group]
        for (line_no, _), obj in zip(group, objs):
            if isinstance(obj, dict):
                out.append((line_no, obj))
            else:
                warns.append(f"{name} line {line_no} is not a JSON object; skipped")
    out.sort(key=lambda x: x[0])
    return [obj for _, obj in out], warns


class JsonlTail:
    """Incremental reader of a growing JSONL file (``--follow``, and the whole file for
    :func:`load_run`): ``read()`` returns the complete lines added since the last call and
    keeps a partial last line for later; ``blocks()`` yields them a block at a time, so
    a long file is never held whole in memory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.offset = 0
        self.line_no = 0
        self._partial = b""

    def blocks(self, keep: frozenset[str] | None = None, slim_before: int = 0
               ) -> Iterator[tuple[list[dict[str, Any]], list[str]]]:
        """(new parsed objects, warnings about lines that were not JSON), per block of
        about :data:`BLOCK_BYTES` of the lines added since the last call (``keep`` and
        ``slim_before``: see :func:`_parse_block`)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size < self.offset:  # the file was replaced: start over
            self.offset, self.line_no, self._partial = 0, 0, b""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            while data := f.read(BLOCK_BYTES):
                self.offset += len(data)
                *complete, self._partial = (self._partial + data).split(b"\n")
                first, self.line_no = self.line_no + 1, self.line_no + len(complete)
                yield _parse_block(complete, first, self.path.name, keep, slim_before)

    def read(self) -> tuple[list[dict[str, Any]], list[str]]:
        """(new parsed objects, warnings about lines that were not JSON)."""
        out: list[dict[str, Any]] = []
        warns: list[str] = []
        for objs, w in self.blocks():
            out += objs
            warns += w
        return out, warns

    def rest(self) -> tuple[list[dict[str, Any]], list[str]]:
        """What is left after the last newline, taken as the final line: parsed if it is
        whole JSON, else reported as truncated (a crash mid-write)."""
        out, warns = [], []
        rest = self._partial.strip()
        if rest:
            obj = parse_line(rest.decode("utf-8", errors="replace"))
            if obj is None:
                warns.append(f"{self.path.name} line {self.line_no + 1} is truncated (the run "
                             "stopped mid-write?); skipped")
            else:
                out.append(obj)
            self._partial = b""
        return out, warns

    def finish(self) -> tuple[list[dict[str, Any]], list[str]]:
        """:meth:`read`, then :meth:`rest`."""
        out, warns = self.read()
        more, w = self.rest()
        return out + more, warns + w


def read_heartbeats(run_dir: Path) -> tuple[dict[int, dict[str, Any]], list[str]]:
    beats: dict[int, dict[str, Any]] = {}
    warns: list[str] = []
    hb_dir = run_dir / "heartbeats"
    for p in sorted(hb_dir.glob("rank*.json")) if hb_dir.is_dir() else []:
        try:
            rank = int(p.stem[4:])
        except ValueError:
            continue
        obj = parse_line(p.read_text(errors="replace"))
        if obj is None:
            warns.append(f"heartbeat {p.name} is not valid JSON (being rewritten?); skipped")
            continue
        obj.setdefault("rank", rank)
        beats[rank] = obj
    return beats, warns


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie (exited, not yet
    reaped by its parent: it trains no more). A process of another user counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # no /proc (not Linux): kill() said it exists
    return "\nState:\tZ" not in status


def processes_gone(log: RunLog, host: str | None = None) -> str | None:
    """Why the run's processes are known to be over, or None when that cannot be told.

    It can be told when there are heartbeat files, each names ``host`` (default: this
    machine) and an integer pid, each was written by the current attempt (not before its
    'start'/'resume' event: a resumed run's old heartbeats name the previous attempt's
    pids) and none of those processes is alive. A heartbeat from another node, or without
    a pid, leaves it unknown (the heartbeat-timeout rule covers those runs)."""
    host = host or socket.gethostname()
    beats = log.heartbeats
    started = log.last_start_time
    if not beats:
        return None
    pids = []
    for hb in beats.values():
        pid, t = hb.get("pid"), num(hb.get("time"))
        if hb.get("host") != host or isinstance(pid, bool) or not isinstance(pid, int):
            return None
        if started is not None and (t is None or t < started):
            return None
        if pid_alive(pid):
            return None
        pids.append(pid)
    shown = ",".join(str(p) for p in sorted(pids)[:8]) + (",..." if len(pids) > 8 else "")
    return (f"every rank's process has exited (host {host}, pid{'s' if len(pids) > 1 else ''} "
            f"{shown} from heartbeats/)")


def read_config(run_dir: Path) -> tuple[dict[str, Any] | None, list[str]]:
    p = run_dir / "config.yaml"
    if not p.is_file():
        return None, []
    try:
        data = yaml_load(p.read_text())
    except yaml.YAMLError as e:
        return None, [f"config.yaml is not valid YAML ({e}); ignored"]
    return (data if isinstance(data, dict) else None), []


def count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            n += block.count(b"\n")
    return n


@dataclass(frozen=True)
class Fields:
    """What a reader of a :class:`RunLog` needs of each step record (``top``) and of
    each of its layers (``layer``); :func:`load_run` keeps only these keys (at any level)
    of the step records but those of about the last ``full_tail`` lines."""

    top: frozenset[str]
    layer: frozenset[str]
    full_tail: int = 1000

    def slim(self, rec: dict[str, Any]) -> dict[str, Any]:
        """A copy of step record ``rec`` with only these keys (its layers' too)."""
        out = {k: v for k, v in rec.items() if k in self.top}
        if isinstance(out.get("layers"), list):
            out["layers"] = [{k: v for k, v in lay.items() if k in self.layer}
                             if isinstance(lay, dict) else lay for lay in out["layers"]]
        return out


def load_run(run_dir: str | Path, fields: Fields | None = None,
             observe: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> RunLog:
    """Read RUN_DIR, streaming metrics.jsonl a block at a time. ``fields``: keep only
    these of each step record but the newest ``fields.full_tail`` (what `monitor --check`
    reads: a long run then fits in a fraction of the memory). ``observe``: sees each whole
    non-event line in file order and returns what the log keeps of it (the report's
    streaming series). Raises FileNotFoundError when it holds no metrics.jsonl."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        what = ("does not exist" if not run_dir.exists() else "has no metrics.jsonl (the "
                f"trainer never got as far as opening it: see {run_dir}/logs/ and the job's "
                "output)")
        raise FileNotFoundError(f"run directory '{run_dir}' {what}")
    log = RunLog(run_dir)
    log.config, warns = read_config(run_dir)
    log.warnings += warns
    tail = JsonlTail(metrics)
    keep, slim_before = None, 0
    if fields is not None:  # slim all but about the last full_tail lines
        keep, slim_before = fields.top | fields.layer, count_lines(metrics) - fields.full_tail
    # a block at a time (tail.rest() only after the last block: it takes what is left)
    for objs, warns in itertools.chain(tail.blocks(keep, slim_before), _later(tail.rest)):
        log.warnings += warns
        for obj in objs:
            if observe is not None and "event" not in obj:
                obj = observe(obj)
            log.add(obj, where="a metrics.jsonl line ")
    refresh_heartbeats(log)
    return log


def _later(fn: Callable[[], Any]) -> Iterator[Any]:
    """Yields ``fn()``, called only when the iteration gets there."""
    yield fn()


def refresh_heartbeats(log: RunLog) -> None:
    log.has_heartbeat_dir = (log.run_dir / "heartbeats").is_dir()
    log.heartbeats, warns = read_heartbeats(log.run_dir)
    log.warnings += warns
