"""``python -m epscale.launch.agent [torchrun options] -m epscale train ...``

torchrun, plus one thing it lacks: it forwards SIGUSR1 to its worker processes instead of
dying of it. Slurm announces the end of a job's time (``#SBATCH --signal=B:USR1@SECS``) and
pre-emption with SIGUSR1; plain torchrun does not handle that signal, so its default action
would kill the agent and orphan the workers mid-step. Here the workers get the signal, the
trainer checkpoints at the end of the current step and exits 0, torchrun sees a clean finish,
and the batch script requeues the job, which resumes from that checkpoint.

Everything else (rendezvous, ``--max-restarts`` after a worker dies, log files) is torchrun's,
with one setting changed: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. By default torchrun's
c10d rendezvous hands the *same* TCP store to every restart of the workers without a
per-attempt key prefix, so a restarted gloo group can read the dead attempt's addresses and
hang in ``init_process_group`` ("Connection refused" to a port of the killed rank). With the
setting, every attempt gets a fresh store (seen with torch 2.13: 3 of 4 restarts hung before,
none of 5 after).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

FORWARDED_SIGNALS = (signal.SIGUSR1,)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (read from /proc; empty where there is no /proc)."""
    out = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = entry.read_text()
        except OSError:  # the process ended while we looked
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry.parent.name))
    return out


def _forward(signum: int, _frame) -> None:
    pids = child_pids(os.getpid())
    print(f"[epscale agent] got {signal.Signals(signum).name}; forwarding it to workers "
          f"{pids} so they checkpoint and exit", file=sys.stderr, flush=True)
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with ``argv`` (its own command-line syntax) and SIGUSR1 forwarding."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # see module docstring
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, _forward)  # a Python handler is reset to default in exec'd workers
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
