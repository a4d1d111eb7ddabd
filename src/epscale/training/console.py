"""What rank 0 shows: the start-up lines, a rich progress bar (step, loss, tokens/s, ETA)
and the end-of-run summary table. On a non-terminal (a log file, CI) the bar becomes one
plain line every ~5% of the run."""

from __future__ import annotations

import statistics
import sys
from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from ..plan.overlap import exposed_summary, format_by_kind


class TrainConsole:
    """Rank 0's view of the run; every method is a no-op on other ranks."""

    def __init__(self, enabled: bool = True, total_steps: int = 0):
        self.enabled = enabled
        self.console = Console(file=sys.stdout, highlight=False)
        self.total = total_steps
        self.progress: Progress | None = None
        self.task = None
        self._plain_every = max(1, total_steps // 20)

    def print(self, *args: Any, **kw: Any) -> None:
        if self.enabled:
            self.console.print(*args, **kw)

    def start(self, first_step: int) -> None:
        if not self.enabled:
            return
        if self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]step[/]"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss [bold]{task.fields[loss]}[/]"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=self.console, transient=False)
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.total, completed=first_step,
                                               loss="-", tps="-")

    def step(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step, loss, tps = rec["step"], rec.get("loss", float("nan")), rec.get("tokens_per_s", 0.0)
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", tps=f"{tps:,.0f}")
        elif step % self._plain_every == 0 or step == self.total:
            extra = f"  mtp {rec['mtp_loss']:.4f}" if "mtp_loss" in rec else ""
            extra += f"  val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
            self.console.print(f"step {step:>6}/{self.total}  loss {loss:.4f}{extra}  "
                               f"{tps:,.0f} tok/s  {rec.get('step_time_s', 0) * 1e3:.0f} ms/step")

    def note(self, text: str) -> None:
        """An event line (checkpoint, skip, rollback) above the bar."""
        if self.enabled:
            (self.progress.console if self.progress is not None else self.console).print(text)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def summary(self, records: list[dict[str, Any]], val_loss: float | None, skipped: int,
                rollbacks: int, unigram_nats: float | None) -> dict[str, Any]:
        """Print the end-of-run table; returns its numbers (for the 'end' event)."""
        recs = [r for r in records if not r.get("skipped")]
        if not recs:
            self.print("no training steps ran in this session")
            return {}
        steady = recs[len(recs) // 5:] or recs  # skip warm-up (first compiles, allocations)
        last = recs[-max(1, min(10, len(recs) // 10)):]

        def med(key):
            return statistics.median(float(r.get(key, 0.0)) for r in steady)

        bd = [r.get("time_breakdown", {}) for r in steady]
        comm = statistics.median((b.get("dispatch", 0) + b.get("combine", 0)) / max(r["step_time_s"], 1e-12)
                                 for b, r in zip(bd, steady))
        out = {
            "final_train_loss": statistics.fmean(r["loss"] for r in last),
            "final_val_loss": val_loss,
            "tokens_per_s": med("tokens_per_s"),
            "tokens_per_s_per_proc": med("tokens_per_s_per_proc"),
            "mfu": med("mfu"),
            "max_vio": statistics.fmean(r.get("max_vio", 0.0) for r in last),
            "dropped_frac": statistics.fmean(r.get("dropped_frac", 0.0) for r in last),
            "dispatch_combine_share": comm,
            "comm_share": med("comm_share"),
            "skipped_steps": skipped,
            "rollbacks": rollbacks,
            "unigram_nats": unigram_nats,
        }
        table = Table(title="Run summary", show_header=False)
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_row("final train loss (mean of last steps)", f"{out['final_train_loss']:.4f}")
        if val_loss is not None:
            table.add_row("final validation loss", f"{val_loss:.4f}")
        if unigram_nats is not None:
            table.add_row("unigram entropy (no-context baseline)", f"{unigram_nats:.4f}")
        table.add_row("tokens/s (all processes, median)", f"{out['tokens_per_s']:,.0f}")
        table.add_row("tokens/s per process", f"{out['tokens_per_s_per_proc']:,.0f}")
        table.add_row("MFU estimate", f"{100 * out['mfu']:.2f}%")
        table.add_row("MaxVio (last steps)", f"{out['max_vio']:.3f}")
        table.add_row("dropped assignments", f"{100 * out['dropped_frac']:.2f}%")
        table.add_row("step time in dispatch+combine", f"{100 * comm:.1f}%")
        table.add_row("step time in all communication", f"{100 * out['comm_share']:.1f}%")
        exposed = exposed_summary(steady)
        if exposed is not None:
            out["comm_exposed_share"] = exposed["exposed_share"]
            out["comm_exposed_by_kind"] = exposed["by_kind"]
            table.add_row("step time waiting on communication (exposed)",
                          f"{100 * exposed['exposed_share']:.1f}%")
            table.add_row("  exposed, by kind", format_by_kind(exposed["by_kind"]))
            table.add_row("communication hidden behind compute",
                          f"{100 * exposed['hidden_frac']:.1f}%")
        table.add_row("skipped steps / rollbacks", f"{skipped} / {rollbacks}")
        self.print(table)
        return out
