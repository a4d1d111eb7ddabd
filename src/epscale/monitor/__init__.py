"""Monitoring a run directory: the HTML report, the live terminal view and the alert rules
behind ``epscale monitor`` (the command itself is ``epscale.monitor.cli``)."""

from .alerts import RULES, Alert, AlertRules, evaluate
from .runlog import RunLog, load_run

__all__ = ["Alert", "AlertRules", "RULES", "evaluate", "RunLog", "load_run"]
