"""The run-directory lock: one trainer per run directory.

Rank 0 holds an OS lock (``flock``) on ``RUN_DIR/run.lock`` for the life of the run and
writes who holds it into that file (host, pid, start time, command). A second trainer on
the same directory does not get the lock and stops with exit status 2 naming the holder.
The kernel drops the lock when its process dies however it dies (SIGKILL, OOM, a lost
node), so a lock file left behind is stale by construction: the next trainer takes it
over and says whose it was.

Shared file systems: on NFS (v3 with lockd, v4) Linux maps ``flock`` onto byte-range
locks the server arbitrates, so the lock holds across nodes; a node that dies holding it
keeps it until the server's lease runs out (NFSv4: about 90 s). On Lustre ``flock`` is
cluster-wide only when the client mounts with ``-o flock``; ``-o localflock`` locks only
within one node, and without either option locking fails (ENOSYS), which is reported
here as a warning and the run continues unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from ..config import ConfigError

LOCK_FILE = "run.lock"
# errors that mean "this file system does not do locks", not "someone holds it"
_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class RunDirectoryInUse(ConfigError):
    """Another live process holds the run directory's lock."""


def _holder_text(info: dict) -> str:
    since = info.get("since")
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
            if isinstance(since, (int, float)) else "an unknown time")
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (since {when})"


def read_holder(run_dir: str | Path) -> dict:
    """What the lock file says about its last holder ({} when absent or unreadable)."""
    try:
        return json.loads((Path(run_dir) / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}


class RunLock:
    """The lock of one run directory, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, note: Callable[[str], None], wait_s: float = 0.0) -> "RunLock":
        """Take the lock or raise :class:`RunDirectoryInUse` naming the holder. ``wait_s``:
        keep trying this long first (an elastic restart whose previous rank 0 may still
        be going away). ``note`` gets one line when a dead process's lock is taken over or
        when the file system cannot lock."""
        fd = _take(self.path, wait_s, note)
        if fd is None:
            return self
        old = read_holder(self.path.parent)
        if old.get("pid") is not None:
            note(f"took over the run directory lock of {_holder_text(old)}, a process that "
                 "is no longer running")
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
                "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Clear the holder and drop the lock (the file stays: unlinking a lock file
        another process may be opening races with it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # a full or read-only disk: the holder then reads as stale, which it is
        finally:
            os.close(fd)  # drops the flock


def restart_wait() -> float:
    """How long a trainer waits for the lock: 0 on a first start; on an elastic restart
    (torchrun's TORCHELASTIC_RESTART_COUNT > 0) up to two minutes, for the previous rank 0
    to go away (on NFS, for the server to drop the lock of a node that died)."""
    return 120.0 if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 else 0.0


def check_unlocked(run_dir: str | Path) -> None:
    """Raise :class:`RunDirectoryInUse` when a live trainer holds ``run_dir``'s lock (a
    launcher's check before it starts workers); takes nothing, writes nothing."""
    path = Path(run_dir) / LOCK_FILE
    if path.is_file():
        fd = _take(path, 0.0, lambda _line: None)
        if fd is not None:
            os.close(fd)


def _take(path: Path, wait_s: float, note: Callable[[str], None]) -> int | None:
    """An open descriptor of ``path`` holding its flock; None when the file system cannot
    lock (said through ``note``); :class:`RunDirectoryInUse` when another process holds it
    past ``wait_s`` seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if e.errno in _UNSUPPORTED:
                os.close(fd)
                note(f"the file system of {path.parent} cannot lock files ({e.strerror}); "
                     "nothing stops a second trainer on this run directory (on Lustre, "
                     "mount with -o flock)")
                return None
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
        if time.monotonic() >= deadline:
            os.close(fd)
            raise RunDirectoryInUse(
                f"run directory '{path.parent}' is in use by another trainer: "
                f"{_holder_text(read_holder(path.parent))}. Two trainers on one run directory "
                "overwrite each other's checkpoints and metrics. Wait for it to finish, stop "
                f"it (touch {path.parent / 'STOP'}), or pass another --run-dir.")
        time.sleep(0.5)
