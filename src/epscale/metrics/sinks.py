"""Where step records go: metrics.jsonl (the source of truth), TensorBoard, Prometheus.

Every sink takes the same plain dicts: ``write(record)`` for a step record and
``event(record)`` for a non-step event (a dict with an ``"event"`` key).
``MetricsWriter`` fans one record out to several sinks; build it on rank 0 only
(``MetricsWriter.open(run_dir, rank=rank)`` returns a writer without sinks elsewhere)::

    writer = MetricsWriter.open(run_dir, rank=rank, tensorboard=True, prometheus_port=9400)
    writer.event("start", step=0)
    writer.write(record)          # once per step
    writer.close()                # or: with MetricsWriter.open(...) as writer: ...

TensorBoard needs the ``tensorboard`` package and Prometheus ``prometheus_client``, both in
the ``monitor`` extra (``pip install 'epscale[monitor]'``). Environment variables switch
them on without a config change: ``EPSCALE_TENSORBOARD=1``, ``EPSCALE_PROMETHEUS_PORT=9400``.

metrics.jsonl is the source of truth: failing to open it stops the run; a full disk while
writing it does not (the records wait in memory, see :class:`JsonlSink`). TensorBoard
and Prometheus are optional: when one cannot start (a busy port, a missing package, an
unwritable directory) the run goes on without it and ``writer.notes`` says so, for the
trainer's start-up header.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from ..appendfile import AppendFile, warn_stderr

# Scalars of a step record that every numeric sink exports (record key -> metric stem).
SCALAR_KEYS: tuple[str, ...] = (
    "loss", "mtp_loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_proc",
    "step_time_s", "comm_share", "mfu", "max_vio", "worst_rank_idle", "dropped_frac", "mem_mb")
LAYER_KEYS: tuple[str, ...] = ("max_vio", "dropped_frac", "router_entropy", "bias_min", "bias_max")


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


class Sink(ABC):
    """Base sink: subclasses implement ``write`` and, if they care, ``event``/``close``."""

    @abstractmethod
    def write(self, record: dict[str, Any]) -> None:
        """Take one step record (the metrics.jsonl schema)."""

    def event(self, record: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None


class JsonlSink(Sink):
    """Appends one JSON object per line to ``path``, each with one write, so a reader
    tailing the file (``epscale monitor --follow``) sees every step at once and a crash
    loses at most the line being written. Non-finite floats are written as
    ``NaN``/``Infinity`` (Python's json reads them back); an appended file is continued,
    never truncated (resume). A full disk is survived (:class:`AppendFile`): one warning,
    the records held in memory until there is space again."""

    HOLD = 100_000  # records kept in memory while the disk is full (~100-200 MB at most)

    def __init__(self, path: str | Path, report: Callable[[str], None] = warn_stderr):
        self.path = Path(path)
        self._f = AppendFile(self.path, hold=self.HOLD, report=report)

    def _line(self, record: dict[str, Any]) -> None:
        self._f.write_line(json.dumps(record, separators=(",", ":")))

    def write(self, record: dict[str, Any]) -> None:
        self._line(record)

    def event(self, record: dict[str, Any]) -> None:
        self._line(record)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def _missing_extra(package: str, what: str) -> ImportError:
    return ImportError(f"{what} needs the '{package}' package, which is not installed; "
                       f"install the monitor extra: pip install 'epscale[monitor]'")


class TensorBoardSink(Sink):
    """Scalars into a TensorBoard event file under ``log_dir``: the SCALAR_KEYS, the
    time breakdown (``time/<section>``), per-layer ``layer<i>/<key>`` numbers, dead-expert
    counts, and a histogram of each layer's tokens per expert (``layer<i>/tokens_per_expert``,
    one sample per expert id weighted by its count)."""

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's wrapper raises when tensorboard is missing
            raise _missing_extra("tensorboard", "TensorBoardSink") from e
        self.log_dir = Path(log_dir)
        self._w = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, record: dict[str, Any]) -> None:
        import numpy as np

        step = int(record.get("step", 0))
        for key in SCALAR_KEYS:
            v = _num(record.get(key))
            if v is not None:
                self._w.add_scalar(key, v, step)
        for sec, v in (record.get("time_breakdown") or {}).items():
            if _num(v) is not None:
                self._w.add_scalar(f"time/{sec}", float(v), step)
        for lay in record.get("layers") or []:
            lid = lay.get("layer")
            for key in LAYER_KEYS:
                v = _num(lay.get(key))
                if v is not None:
                    self._w.add_scalar(f"layer{lid}/{key}", v, step)
            if "dead_experts" in lay:
                self._w.add_scalar(f"layer{lid}/dead_experts", len(lay["dead_experts"]), step)
            counts = lay.get("tokens_per_expert")
            if counts and sum(counts) > 0:
                ids = np.repeat(np.arange(len(counts)), np.asarray(counts, dtype=np.int64))
                self._w.add_histogram(f"layer{lid}/tokens_per_expert", ids, step,
                                      bins=np.arange(len(counts) + 1) - 0.5)

    def event(self, record: dict[str, Any]) -> None:
        self._w.add_text("events", json.dumps(record), int(record.get("step", 0)))

    def close(self) -> None:
        self._w.flush()
        self._w.close()


class PrometheusSink(Sink):
    """Serves the latest step's numbers at ``http://<addr>:<port>/metrics`` for a cluster's
    Prometheus (``dashboards/grafana-epscale.json`` reads them). port 0 picks a free port
    (see ``.port``). Every metric carries a ``run`` label. Exported gauges (prefix
    ``epscale_``): step, last_step_timestamp_seconds, the SCALAR_KEYS (tokens_per_s is
    ``tokens_per_second``, step_time_s ``step_time_seconds``), ``time_breakdown_seconds
    {section}``, ``layer_<key>{layer}`` for LAYER_KEYS, ``layer_dead_experts{layer}``,
    ``expert_tokens{layer,expert}``, ``rank_load{layer,rank}``,
    ``rank_step_time_seconds{rank}``, ``skipped_steps_total`` and ``events_total{event}``."""

    RENAME = {"tokens_per_s": "tokens_per_second", "tokens_per_s_per_proc":
              "tokens_per_second_per_proc", "step_time_s": "step_time_seconds"}

    def __init__(self, port: int, addr: str = "127.0.0.1", run: str = "run"):
        try:
            import prometheus_client as pc
        except ImportError as e:
            raise _missing_extra("prometheus_client", "PrometheusSink") from e
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"PrometheusSink: port={port!r} must be an integer in [0, 65535]")
        self.run = run
        self.registry = reg = pc.CollectorRegistry()
        G, C = pc.Gauge, pc.Counter
        self._scalars = {k: G(f"epscale_{self.RENAME.get(k, k)}", f"step record '{k}'", ["run"],
                              registry=reg) for k in SCALAR_KEYS}
        self._step = G("epscale_step", "last step written", ["run"], registry=reg)
        self._stamp = G("epscale_last_step_timestamp_seconds", "unix time of the last step",
                        ["run"], registry=reg)
        self._time = G("epscale_time_breakdown_seconds", "exclusive seconds per step section",
                       ["run", "section"], registry=reg)
        self._layer = {k: G(f"epscale_layer_{k}", f"per-layer '{k}'", ["run", "layer"],
                            registry=reg) for k in LAYER_KEYS}
        self._dead = G("epscale_layer_dead_experts", "experts without tokens for n steps",
                       ["run", "layer"], registry=reg)
        self._expert = G("epscale_expert_tokens", "assignments per expert in the last step",
                         ["run", "layer", "expert"], registry=reg)
        self._rank_load = G("epscale_rank_load", "assignments computed per EP rank",
                            ["run", "layer", "rank"], registry=reg)
        self._rank_time = G("epscale_rank_step_time_seconds", "step time per rank",
                            ["run", "rank"], registry=reg)
        self._skipped = C("epscale_skipped_steps", "steps skipped (non-finite)", ["run"],
                          registry=reg)
        self._events = C("epscale_events", "non-step events", ["run", "event"], registry=reg)
        self._server, self._thread = pc.start_http_server(port, addr=addr, registry=reg)
        self.addr = addr
        self.port = int(self._server.server_port)

    @property
    def url(self) -> str:
        """Where a scraper finds the endpoint. A wildcard bind (0.0.0.0, ::) is named by this
        host's name, since the wildcard address itself is no place to connect to."""
        host = self.addr
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        elif ":" in host:
            host = f"[{host}]"  # an IPv6 literal
        return f"http://{host}:{self.port}/metrics"

    def write(self, record: dict[str, Any]) -> None:
        r = self.run
        for key, g in self._scalars.items():
            v = _num(record.get(key))
            if v is not None:
                g.labels(r).set(v)
        self._step.labels(r).set(int(record.get("step", 0)))
        self._stamp.labels(r).set(float(record.get("time", time.time())))
        skipped = self._skipped.labels(r)  # exported (as 0) from the first step on
        if record.get("skipped"):
            skipped.inc()
        for sec, v in (record.get("time_breakdown") or {}).items():
            if _num(v) is not None:
                self._time.labels(r, sec).set(float(v))
        for lay in record.get("layers") or []:
            lid = str(lay.get("layer"))
            for key, g in self._layer.items():
                v = _num(lay.get(key))
                if v is not None:
                    g.labels(r, lid).set(v)
            if "dead_experts" in lay:
                self._dead.labels(r, lid).set(len(lay["dead_experts"]))
            for e, c in enumerate(lay.get("tokens_per_expert") or []):
                self._expert.labels(r, lid, str(e)).set(c)
            for p, c in enumerate(lay.get("rank_load") or []):
                self._rank_load.labels(r, lid, str(p)).set(c)
        for p, t in enumerate(record.get("rank_step_time_s") or []):
            self._rank_time.labels(r, str(p)).set(t)

    def event(self, record: dict[str, Any]) -> None:
        self._events.labels(self.run, str(record.get("event"))).inc()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def open_prometheus(port: int, addr: str, run: str) -> tuple[PrometheusSink | None, str]:
    """Start the Prometheus endpoint, or explain why not: (sink, note) on success, (None,
    warning) when it cannot start. An optional sink must never stop a run, so a busy port,
    an address this host does not have or a missing ``prometheus_client`` is a warning for
    the start-up header, and training goes on with metrics.jsonl (which holds every number
    the endpoint would have served). An invalid port number still raises ValueError: that is
    a config mistake, caught by the config check before launch."""
    where = f"metrics.prometheus_port {port} on {addr}"
    try:
        sink = PrometheusSink(port, addr, run=run)
    except ImportError as e:
        return None, f"warning: {where}: {e}; no Prometheus endpoint this run"
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            fix = ("is in use ({}: {}): no Prometheus endpoint this run; pick another port "
                   "(metrics.prometheus_port=0 picks a free one)")
        else:
            fix = ("cannot be served ({}: {}): no Prometheus endpoint this run; check "
                   "metrics.prometheus_addr (an address of this host, 127.0.0.1 or 0.0.0.0)")
        return None, f"warning: {where} " + fix.format(type(e).__name__, e)
    where = "" if addr not in ("", "0.0.0.0", "::") else f" (all interfaces, {addr or '0.0.0.0'})"
    return sink, f"metrics: Prometheus endpoint at {sink.url}{where}"


def open_tensorboard(log_dir: Path) -> tuple[TensorBoardSink | None, str]:
    """Open the TensorBoard event file, or explain why not: (sink, note) or (None, warning).
    Optional like Prometheus: a missing ``tensorboard`` package or a directory that cannot
    be created (permissions, a full disk) leaves the run going with metrics.jsonl."""
    try:
        sink = TensorBoardSink(log_dir)
    except (ImportError, OSError) as e:
        return None, (f"warning: metrics.tensorboard: cannot write {log_dir} "
                      f"({type(e).__name__}: {e}): no TensorBoard events this run")
    return sink, f"metrics: TensorBoard events in {log_dir}"


class MetricsWriter:
    """Fans step records and events out to sinks; a writer without sinks does nothing
    (what ranks other than 0 get). Sinks that raise are reported once and dropped, so a
    full disk under TensorBoard does not stop training."""

    def __init__(self, sinks: Iterable[Sink] = (), notes: Iterable[str] = ()):
        self.sinks: list[Sink] = list(sinks)
        # Lines for the run's start-up header: where the metrics go, what could not open.
        self.notes: list[str] = list(notes)

    @classmethod
    def open(cls, run_dir: str | Path, *, rank: int = 0, tensorboard: bool | None = None,
             prometheus_port: int | None = None, prometheus_addr: str = "127.0.0.1",
             run_name: str | None = None) -> "MetricsWriter":
        """The standard sinks of a run directory, on rank 0 only: RUN_DIR/metrics.jsonl,
        TensorBoard events in RUN_DIR/tensorboard when ``tensorboard`` (None reads
        ``EPSCALE_TENSORBOARD``), Prometheus on ``prometheus_addr``:``prometheus_port``
        (None reads ``EPSCALE_PROMETHEUS_PORT``; unset means off; 127.0.0.1 serves this
        host only, 0.0.0.0 every interface, for a scraper on another machine).

        ``.notes`` of the writer says where the optional sinks went, or, as a line starting
        with "warning:", why one could not start: the run goes on without it (see
        :func:`open_prometheus`). Failing to open metrics.jsonl raises."""
        if rank != 0:
            return cls([])
        run_dir = Path(run_dir)
        if tensorboard is None:
            tensorboard = os.environ.get("EPSCALE_TENSORBOARD", "") not in ("", "0", "false")
        if prometheus_port is None and os.environ.get("EPSCALE_PROMETHEUS_PORT"):
            raw = os.environ["EPSCALE_PROMETHEUS_PORT"]
            try:
                prometheus_port = int(raw)
            except ValueError:
                raise ValueError(f"EPSCALE_PROMETHEUS_PORT={raw!r} must be a port number")
        sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl")]
        opened: list[tuple[Sink | None, str]] = []
        if tensorboard:
            opened.append(open_tensorboard(run_dir / "tensorboard"))
        if prometheus_port is not None:
            opened.append(open_prometheus(prometheus_port, prometheus_addr,
                                          run_name or run_dir.name))
        sinks += [sink for sink, _ in opened if sink is not None]
        return cls(sinks, notes=[note for _, note in opened])

    def _each(self, method: str, record: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(record)
            except Exception as e:  # noqa: BLE001 - a sink must not kill the training job
                if isinstance(sink, JsonlSink):
                    raise  # the source of truth: failing to write it is fatal
                import warnings

                warnings.warn(f"metrics sink {type(sink).__name__} failed ({e}); disabled")
                self.sinks.remove(sink)

    def write(self, record: dict[str, Any]) -> None:
        """One step record (a dict with at least ``step``)."""
        self._each("write", record)

    def event(self, name: str | dict[str, Any], step: int = 0, **fields: Any) -> dict[str, Any]:
        """A non-step event line: ``event("checkpoint", step=100, path=...)`` or a ready
        dict with an ``"event"`` key. ``time`` is filled in when missing."""
        rec = dict(name) if isinstance(name, dict) else {"event": name, "step": int(step), **fields}
        rec.setdefault("time", time.time())
        self._each("event", rec)
        return rec

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

