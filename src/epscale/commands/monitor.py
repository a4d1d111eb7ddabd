"""``epscale monitor RUN_DIR``: report, live view and alert check of a training run.

    epscale monitor RUN_DIR                 write RUN_DIR/report.html (or --out PATH)
    epscale monitor RUN_DIR --check         evaluate the alert rules: one line per alert and
                                            exit 1, or a one-line all-clear and exit 0
    epscale monitor RUN_DIR --follow        live terminal dashboard while the job runs
    epscale monitor RUN_DIR --check --ended after the job (a Slurm epilog): the job is over,
                                            so a run without an 'end' event crashed

Alert thresholds: ``--rule key=value`` (repeatable), ``--rules FILE.yaml``, and
RUN_DIR/alerts.yaml when present (file first, then the --rule overrides); see
``epscale.monitor.alerts.AlertRules`` for the keys and their defaults.
Exit codes: 0 fine, 1 alerts fired (--check), 2 bad arguments, no readable run, or a
report that cannot be written (a full disk: one line naming the path).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..config import ConfigError
from ..appendfile import disk_error
from ..monitor.alerts import CHECK_FIELDS, RULES, AlertRules, evaluate
from ..monitor.live import follow
from ..monitor.report import write_report
from ..monitor.report_stream import ReportSeries
from ..monitor.runlog import load_run
from ..plan.overlap import exposed_summary, format_by_kind


def configure_parser(p) -> None:
    import argparse
    from dataclasses import fields

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    defaults = AlertRules()
    keys = ", ".join(f"{f.name}={getattr(defaults, f.name):g}" for f in fields(AlertRules))
    p.epilog = ("alert rules and their defaults (override with --rule key=value, --rules "
                "FILE or RUN_DIR/alerts.yaml):\n  " + "\n  ".join(_wrap(keys, 88)) +
                "\nexit status: 0 fine, 1 alerts fired (--check), 2 bad arguments or no run")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds metrics.jsonl)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="evaluate the alert rules; exit 1 with one line per alert, else 0")
    mode.add_argument("--follow", action="store_true",
                      help="live terminal dashboard that tails metrics.jsonl (Ctrl-C to stop)")
    p.add_argument("--out", metavar="PATH", help="where to write the HTML report "
                   "(default RUN_DIR/report.html)")
    p.add_argument("--rule", action="append", default=[], metavar="key=value",
                   help="override an alert threshold, e.g. --rule imbalance_max_vio=2.0")
    p.add_argument("--rules", metavar="FILE", help="YAML file of alert thresholds")
    p.add_argument("--interval", type=float, default=2.0,
                   help="--follow: seconds between refreshes (default 2)")
    p.add_argument("--max-points", type=int, default=1000,
                   help="report: most columns per plot; longer runs are bucketed (default 1000)")
    p.add_argument("--exit-on-end", action="store_true",
                   help="--follow: stop when the run writes its 'end' event (or its "
                        "processes on this host have all exited)")
    p.add_argument("--ended", action="store_true",
                   help="--check/report: the job is over (e.g. in a Slurm epilog), so a run "
                        "without an 'end' event crashed: flag it now, not after "
                        "heartbeat_timeout_s")


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


def load_rules(args) -> AlertRules:
    path = args.rules
    if path is None and (Path(args.run_dir) / "alerts.yaml").is_file():
        path = Path(args.run_dir) / "alerts.yaml"
    return AlertRules.load(path, args.rule)


def _warn(lines: list[str]) -> None:
    for w in lines:
        print(f"warning: {w}", file=sys.stderr)


def exposed_line(steps: list[dict]) -> str | None:
    """'communication: ...' with the exposed share of the step (median over the steps after
    the first fifth, as the run summary), by kind, and the share hidden behind compute;
    None for a run without communication or from before these fields."""
    steady = steps[len(steps) // 5:] or steps
    ex = exposed_summary(steady)
    if ex is None or not any(r.get("comm_s", 0) > 0 for r in steady):
        return None
    return (f"communication: exposed {100 * ex['exposed_share']:.1f}% of the step "
            f"({format_by_kind(ex['by_kind'])}); {100 * ex['hidden_frac']:.1f}% of its time in "
            "flight hidden behind compute")


def run(args) -> int:
    rules = load_rules(args)  # ConfigError -> exit 2 with the message (epscale.cli)
    if args.interval <= 0:
        raise ConfigError(f"--interval {args.interval!r} is invalid: must be > 0 seconds")
    if args.max_points < 10:
        raise ConfigError(f"--max-points {args.max_points!r} is invalid: must be >= 10")
    if args.follow:
        if args.ended:
            raise ConfigError("--ended is invalid with --follow: it says the job is over; use "
                              "it with --check or the report")
        if not Path(args.run_dir).is_dir():
            print(f"epscale monitor: error: run directory '{args.run_dir}' does not exist",
                  file=sys.stderr)
            return 2

        return follow(Path(args.run_dir), rules, interval=args.interval,
                      exit_on_end=args.exit_on_end)
    try:
        # --check reads only what the rules need of the older records (a long run's file
        # is streamed; see epscale.monitor.alerts.CHECK_FIELDS)
        # the report keeps the same slim records for the rules and builds its plotted
        # series while streaming (epscale.monitor.report_stream)
        series = None if args.check else ReportSeries(args.run_dir, args.max_points)
        run_log = load_run(args.run_dir, fields=CHECK_FIELDS if args.check else None,
                           observe=series.add if series else None)
    except FileNotFoundError as e:
        print(f"epscale monitor: error: {e}", file=sys.stderr)
        return 2
    plotted = series.finish(run_log) if series else None
    _warn(run_log.warnings)
    now = time.time()
    alerts = evaluate(run_log, rules, now=now, job_over=args.ended)
    if args.check:
        for a in alerts:
            print(a.line())
        line = exposed_line(run_log.steps)
        if line:
            print(line)
        if alerts:
            return 1
        last = run_log.last_step
        print(f"OK {run_log.name}: no alerts ({len(RULES)} rules, {len(run_log.steps)} records, "
              f"last step {last if last is not None else '—'})")
        return 0

    out = Path(args.out) if args.out else Path(args.run_dir) / "report.html"
    tmp = out.with_name(f".{out.name}.tmp")  # an old report stays whole until the new one is
    try:
        write_report(run_log, alerts, rules, tmp, now=now, max_points=args.max_points,
                     series=plotted)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if not disk_error(e):
            raise
        print(f"epscale monitor: error: cannot write {out} ({e.strerror}); nothing was written. "
              "Free space on its file system or pass --out PATH elsewhere; "
              "`epscale monitor RUN_DIR --check` needs no space", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(run_log.steps)} records, {len(alerts)} alert"
          f"{'s' if len(alerts) != 1 else ''})")
    return 0
