"""Append-only line files that survive a full disk: metrics.jsonl and the rank logs.

A line is written with one ``write(2)`` of its bytes on an ``O_APPEND`` descriptor, so a
reader never sees half a line from a write that succeeded. When the file system refuses
(no space, a quota, a read-only or no-permission file), the part of the line that did get
written is cut off again, one line on stderr names the file and the cause, and the run
goes on: lines are then held in memory (up to ``hold``; past it the oldest are dropped and
counted) and written once there is space again, or dropped (``hold=0``, for logs). Any
other error is raised: only the disk's own refusals are survivable.
"""

from __future__ import annotations

import errno
import os
import sys
from collections import deque
from pathlib import Path
from typing import Callable

# The errors of a file system that refuses a write: full, over quota, file too large,
# read-only, no permission (an immutable file or directory).
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EPERM,
                         errno.EACCES})


def disk_error(e: BaseException) -> bool:
    """Whether ``e`` is a file system refusing a write (see DISK_ERRNOS)."""
    return isinstance(e, OSError) and e.errno in DISK_ERRNOS


def warn_stderr(text: str) -> None:
    print(f"epscale: warning: {text}", file=sys.stderr, flush=True)


class AppendFile:
    """``path`` opened for appending (created with its directory when missing)."""

    def __init__(self, path: str | Path, hold: int = 0,
                 report: Callable[[str], None] = warn_stderr):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                           0o644)
        self._size = os.fstat(self._fd).st_size
        self.hold, self.report = hold, report
        self._held: deque[bytes] = deque()
        self.dropped = 0             # lines lost (past ``hold``, or at close)
        self.failing: str | None = None  # why writes fail now, or None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def write_line(self, text: str) -> bool:
        """Append ``text`` + newline (or hold it); True when it reached the file."""
        self._held.append(text.encode("utf-8") + b"\n")
        if len(self._held) > max(self.hold, 1):
            self._held.popleft()
            self.dropped += 1
        return self._drain()

    def _drain(self) -> bool:
        while self._held:
            data = self._held[0]
            try:
                n = os.write(self._fd, data)
                if n != len(data):  # the file system took part of it: out of space
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as e:
                if not disk_error(e):
                    raise
                self._cut_partial()
                if self.hold == 0:
                    self._held.clear()
                    self.dropped += 1
                if self.failing is None:
                    self.failing = e.strerror or str(e)
                    kept = (f"new lines are held in memory (up to {self.hold:,}) and written "
                            "once there is space" if self.hold else "new lines are dropped "
                            "until there is space")
                    self.report(f"cannot write {self.path} ({self.failing}); {kept}; the run "
                                "goes on. Free space on its file system.")
                return False
            self._size += n
            self._held.popleft()
        if self.failing is not None:
            lost = f", {self.dropped:,} line(s) lost" if self.dropped else ""
            self.report(f"{self.path} is writable again (held lines written{lost})")
            self.failing = None
        return True

    def _cut_partial(self) -> None:
        """Cut what a failed write left of its line (the file then ends at a whole line)."""
        try:
            if os.fstat(self._fd).st_size > self._size:
                os.ftruncate(self._fd, self._size)
        except OSError:
            pass  # cannot even truncate: the reader skips a broken last line

    def close(self) -> None:
        if self._fd is None:
            return
        if self._held and not self._drain():
            self.dropped += len(self._held)
            self.report(f"{len(self._held):,} line(s) for {self.path} could not be written "
                        f"({self.failing}) and are lost")
            self._held.clear()
        os.close(self._fd)
        self._fd = None
