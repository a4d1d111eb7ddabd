"""``python -m epscale.launch.agent [torchrun options] -m epscale train ...``

torchrun, plus what it lacks. First, it forwards SIGUSR1 to its worker processes instead of
dying of it. Slurm announces the end of a job's time (``#SBATCH --signal=B:USR1@SECS``) and
pre-emption with SIGUSR1; plain torchrun does not handle that signal, so its default action
would kill the agent and orphan the workers mid-step. Here the workers get the signal, the
trainer checkpoints at the end of the current step and exits 0, torchrun sees a clean finish,
and the batch script requeues the job, which resumes from that checkpoint.

The rendezvous, the restarts after a worker dies and the log files are torchrun's,
with one setting changed: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. By default torchrun's
c10d rendezvous hands the *same* TCP store to every restart of the workers without a
per-attempt key prefix, so a restarted gloo group can read the dead attempt's addresses and
hang in ``init_process_group`` ("Connection refused" to a port of the killed rank). With the
setting, every attempt gets a fresh store (seen with torch 2.13: 3 of 4 restarts hung before,
none of 5 after).

Three more things torchrun does not do, each hooked into its elastic agent in one place
(:func:`install`; they rely on torch 2.x internals named there):

- **No restart for an error a restart cannot fix.** The trainer exits with status 2 on a
  :class:`~epscale.config.ConfigError` (config, data, checkpoint mismatch; see
  :mod:`epscale.cli`). When every failed rank exited with 2, the group is stopped at once and
  this agent exits 2, instead of repeating the same error ``--max-restarts`` times.
- **Say what died.** Before a restart (or the end) one line on stderr names each failed rank,
  its pid and how it ended, and which restart this is: ``epscale launch: rank 1 (pid 1234)
  was killed by SIGKILL; restart 1 of 3 ...``.
- **Workers die with the agent.** Every worker gets SIGKILL as its parent-death signal
  (Linux ``PR_SET_PDEATHSIG``): if this agent is killed outright (SIGKILL, the OOM killer),
  its workers, which torchrun puts in sessions of their own, do not train on unwatched. A
  SIGTERM to the agent still stops them the graceful way (torchrun forwards it).

:func:`kill_tree` kills a process and everything it started (torchrun, its workers in their
own sessions, their children); ``epscale train --nproc N`` uses it on a second Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

FORWARDED_SIGNALS = (signal.SIGUSR1,)

# The trainer's exit status for a ConfigError (epscale.cli): a restart would fail the same way.
CONFIG_ERROR_EXIT = 2
PR_SET_PDEATHSIG = 1  # linux/prctl.h


# --------------------------------------------------------------------------------------
# the process tree, read from /proc
# --------------------------------------------------------------------------------------


class ProcInfo(NamedTuple):
    """One line of /proc/PID/stat: parent pid, session id, state letter (R, S, D, T, Z,
    ...) and start time (clock ticks after boot; tells a reused pid from the original)."""

    ppid: int
    sid: int
    state: str
    start: int


def process_table() -> dict[int, ProcInfo]:
    """Every process of this machine, pid -> :class:`ProcInfo` (empty without /proc)."""
    table = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = entry.read_text()
        except OSError:  # the process ended while we looked
            continue
        # "pid (comm) state ppid pgrp session ... starttime(22nd)": comm may hold spaces and ")".
        f = text[text.rfind(")") + 2:].split()
        if len(f) > 19:
            table[int(entry.parent.name)] = ProcInfo(int(f[1]), int(f[3]), f[0], int(f[19]))
    return table


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (read from /proc; empty where there is no /proc)."""
    return [child for child, info in process_table().items() if info.ppid == pid]


def _grow_tree(table: dict[int, ProcInfo], members: dict[int, int], sessions: set[int]) -> None:
    """Add to ``members`` (pid -> start time) every process of ``table`` whose parent is a
    member or whose session one of them leads (a worker's children stay in its session
    after the worker died and they were re-parented); ``sessions`` grows with them."""

    def is_member(pid: int) -> bool:  # the same process, not a later one with its pid
        return pid in members and pid in table and table[pid].start == members[pid]

    changed = True
    while changed:
        changed = False
        for pid, info in table.items():
            if not is_member(pid) and (is_member(info.ppid) or info.sid in sessions):
                members[pid] = info.start
                changed = True
                if info.sid == pid:
                    sessions.add(pid)


def kill_tree(root: int, timeout_s: float = 10.0, freeze_s: float = 1.0) -> list[int]:
    """SIGKILL ``root`` and every process it started, in any session: the process group of
    ``root`` is not enough, since torchrun starts each worker with a session of its own.

    The found processes are stopped first (SIGSTOP: a stopped process can neither fork nor
    exit, so its children stay where the walk finds them); once the whole tree is stopped,
    or after ``freeze_s`` (a process stuck in the kernel does not stop), all get SIGKILL,
    and /proc is walked again until no live process of the tree is left. Zombies count as
    gone (their parent or init reaps them). Returns the pids still alive after
    ``timeout_s`` (empty when all died)."""
    table = process_table()
    if root not in table:
        return []
    members = {root: table[root].start}
    sessions = {root} if table[root].sid == root else set()
    t0 = time.monotonic()
    while True:
        table = process_table()
        _grow_tree(table, members, sessions)
        live = [p for p, start in members.items()
                if p in table and table[p].start == start and table[p].state not in "ZXx"]
        if not live or time.monotonic() - t0 > timeout_s:
            return live
        running = [p for p in live if table[p].state not in "tT"]
        freeze = bool(running) and time.monotonic() - t0 < freeze_s
        for pid in running if freeze else live:
            try:
                os.kill(pid, signal.SIGSTOP if freeze else signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


# --------------------------------------------------------------------------------------
# the agent: torchrun with SIGUSR1 forwarding, no pointless restarts, named failures
# --------------------------------------------------------------------------------------


def _forward(signum: int, _frame) -> None:
    pids = child_pids(os.getpid())
    print(f"[epscale agent] got {signal.Signals(signum).name}; forwarding it to workers "
          f"{pids} so they checkpoint and exit", file=sys.stderr, flush=True)
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def describe_failure(rank: int, pid: int, exitcode: int) -> str:
    """'rank 1 (pid 1234) was killed by SIGKILL' or '... exited with status 1'."""
    if exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with status {exitcode}"
    return f"rank {rank} (pid {pid}) {how}"


def split_failures(failures: dict) -> tuple[dict, list[int]]:
    """``failures`` (global rank -> torch's ProcessFailure) -> (the failures that ended the
    group, the ranks torchrun stopped because of them). Once one rank fails, torch's
    SubprocessContext sends SIGTERM to the others and books their deaths as failures too;
    a death by SIGTERM next to a failure of another kind is taken as one of those."""
    causes = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM}
    if not causes:
        return dict(failures), []
    return causes, sorted(set(failures) - set(causes))


def is_config_error(failures: dict) -> bool:
    """Every rank whose failure ended the group (:func:`split_failures`) exited with
    status 2: a config, data or checkpoint error, which the next attempt would meet again."""
    causes, _stopped = split_failures(failures)
    return bool(causes) and all(f.exitcode == CONFIG_ERROR_EXIT for f in causes.values())


def explain_failure(agent, failures: dict) -> None:
    """On a failed group: print which ranks died, how and what happens next; when a restart
    cannot help (:func:`is_config_error`), set the agent's remaining restarts to 0 so that
    torch's run loop stops the group instead of restarting it."""
    causes, stopped = split_failures(failures)
    what = ", ".join(describe_failure(r, f.pid, f.exitcode) for r, f in sorted(causes.items()))
    if stopped:
        ranks = ", ".join(map(str, stopped))
        what += f" (torchrun then stopped rank{'s' if len(stopped) > 1 else ''} {ranks})"
    total = agent._worker_group.spec.max_restarts
    if is_config_error(failures):
        agent._remaining_restarts = 0
        nxt = ("that is a config, data or checkpoint error, which a restart cannot fix: "
               "not restarting; fix the error printed above and launch again")
    elif agent._remaining_restarts > 0:
        nxt = (f"restart {total - agent._remaining_restarts + 1} of {total} (resuming from "
               "the latest checkpoint)")
    else:
        nxt = f"no restarts left (--max-restarts {total}); stopping"
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
    print(f"epscale launch: [{stamp}] {what}; {nxt}", file=sys.stderr, flush=True)


def parent_death_preexec(sig: int):
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child get ``sig`` when this
    process dies (Linux ``PR_SET_PDEATHSIG``; kept across exec), and get it at once when this
    process died before the call; None off Linux. libc is resolved here, not in the forked
    child, so the child only makes two system calls."""
    if not sys.platform.startswith("linux"):
        return None
    libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
            os._exit(128 + int(sig))  # where ``sig`` is handled or ignored

    return preexec


def install() -> None:
    """Hook into torch's elastic agent (this process only; the agent runs nothing else).

    - ``LocalElasticAgent._monitor_workers`` (called by ``SimpleElasticAgent._invoke_run``
      after every ``--monitor-interval``): a FAILED/UNHEALTHY result goes through
      :func:`explain_failure` before the run loop decides to restart, using the agent's
      ``_remaining_restarts`` counter and ``_worker_group.spec.max_restarts``.
    - ``Popen`` of torch's ``subprocess_handler`` module (``SubprocessHandler._popen``
      starts each worker with it): adds the parent-death signal. The signal fires when the
      *thread* that started the worker ends, so it is set only for workers started from the
      main thread (where torch's run loop starts them). ``preexec_fn`` runs Python in the
      forked child; it only calls prctl through a libc handle resolved beforehand.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import (
        LocalElasticAgent,
    )
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as sh,
    )

    monitor = LocalElasticAgent._monitor_workers

    def monitor_and_explain(self, worker_group):
        result = monitor(self, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
            explain_failure(self, result.failures)
        return result

    LocalElasticAgent._monitor_workers = monitor_and_explain
    preexec, popen = parent_death_preexec(signal.SIGKILL), sh.Popen
    if preexec is None:
        return

    def popen_dying_with_agent(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            kwargs["preexec_fn"] = preexec
        return popen(*args, **kwargs)

    sh.Popen = popen_dying_with_agent


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with ``argv`` (its own command-line syntax), SIGUSR1 forwarding and the
    hooks of :func:`install`. Exits 2, without torchrun's traceback, when the group stopped
    on an error a restart cannot fix (the failed ranks printed it)."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # see module docstring
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, _forward)  # a Python handler is reset to default in exec'd workers
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    install()
    try:
        torchrun_main(argv if argv is not None else sys.argv[1:])
    except ChildFailedError as e:
        if is_config_error(e.failures):
            raise SystemExit(CONFIG_ERROR_EXIT) from None
        raise


if __name__ == "__main__":
    main()
