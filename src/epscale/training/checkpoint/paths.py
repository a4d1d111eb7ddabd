"""Where checkpoints live and whether one is sound.

Layout of one checkpoint, ``RUN_DIR/checkpoints/step_00000100/``:

* DCP files (``.metadata``, ``__{rank}_0.distcp``) holding ``{"model": ..., "optim": ...}``
  (see :mod:`.state`);
* ``rank_{r}.pt``: that rank's RNG states;
* ``meta.json``, written last by rank 0: step, layout, data position, loop counters, the
  config, and the size and SHA-256 of every file (a corrupt file is detected on load).

A checkpoint that fails these checks is moved to ``checkpoints/corrupt/`` (kept for
inspection, never counted toward ``train.ckpt_keep``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from ...config import ConfigError

FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message names its path."""


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"step_{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step_*`` directory, oldest first (complete or not)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' is incomplete: no meta.json") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint '{path}' has an unreadable meta.json: {e}") from None


def validate(path: Path, verify_hashes: bool = True) -> dict:
    """The checkpoint's meta if every listed file is present with the recorded size (and
    hash); raises CheckpointError naming the path and the first problem otherwise."""
    meta = read_meta(path)
    files = meta.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointError(f"checkpoint '{path}' is incomplete: meta.json lists no DCP files")
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint '{path}' is incomplete: '{name}' is missing")
        if f.stat().st_size != info["size"]:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: '{name}' has "
                                  f"{f.stat().st_size} bytes, expected {info['size']}")
        if verify_hashes and sha256(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: '{name}' fails its SHA-256 check")
    return meta


def corrupt_root(run_dir: str | Path) -> Path:
    """Where checkpoints that fail their checks are moved, kept for inspection."""
    return checkpoints_root(run_dir) / "corrupt"


def set_aside(path: Path, reason: str) -> Path:
    """Move the checkpoint ``path`` to ``checkpoints/corrupt/`` (never deleted, and no
    longer counted as a checkpoint), with ``REASON.txt`` saying why. Returns where it went."""
    dest_root = path.parent / "corrupt"
    dest_root.mkdir(exist_ok=True)
    dest, n = dest_root / path.name, 1
    while dest.exists():
        n += 1
        dest = dest_root / f"{path.name}.{n}"
    os.replace(path, dest)
    (dest / "REASON.txt").write_text(reason + "\n")
    return dest


def is_rollback_target(meta: dict) -> bool:
    """Whether a checkpoint was written while the loss was normal (meta.json's
    ``guard.healthy``, see :class:`epscale.training.guard.SpikeGuard`); one written before
    that mark existed counts as one."""
    return (meta.get("guard") or {}).get("healthy", True) is not False


def latest_valid(run_dir: str | Path, report: Callable[[str], None] = print,
                 move_corrupt: bool = False, rollback: bool = False) -> tuple[Path, dict] | None:
    """The newest checkpoint that validates, reporting (with its path) every newer one
    that does not; None when there is none. ``move_corrupt``: also move those to
    ``checkpoints/corrupt/`` (the trainer does, on rank 0; read-only callers do not).
    ``rollback``: the newest that is also a rollback target (:func:`is_rollback_target`)."""
    for _step, path in reversed(list_checkpoints(run_dir)):
        if rollback and not is_rollback_target(read_meta_or_empty(path)):
            continue
        try:
            return path, validate(path)
        except CheckpointError as e:
            if move_corrupt:
                dest = set_aside(path, str(e))
                report(f"{e}; moved it to {dest} and trying the previous checkpoint")
            else:
                report(f"{e}; trying the previous checkpoint")
    return None


def prune(run_dir: str | Path, keep: int, verified: set[Path] | None = None,
          report: Callable[[str], None] = print) -> list[Path]:
    """Keep the newest ``keep`` checkpoints that verify (size and SHA-256 of every file;
    one verification per checkpoint per ``verified`` set), move the ones that fail to
    ``checkpoints/corrupt/``, delete the older verified ones, except the newest rollback
    target when none of the kept ones is (a spike then still has somewhere to go back
    to). Returns the kept ones."""
    verified = verified if verified is not None else set()
    kept: list[Path] = []
    target = False  # a rollback target among the kept ones
    for _step, path in reversed(list_checkpoints(run_dir)):
        if len(kept) >= keep and (target or not is_rollback_target(read_meta_or_empty(path))):
            shutil.rmtree(path, ignore_errors=True)
            continue
        if path not in verified:
            try:
                validate(path)
            except CheckpointError as e:
                dest = set_aside(path, str(e))
                report(f"{e}; moved it to {dest} (it does not count toward train.ckpt_keep)")
                continue
            verified.add(path)
        kept.append(path)
        target = target or is_rollback_target(read_meta_or_empty(path))
    return kept


def read_meta_or_empty(path: Path) -> dict:
    """meta.json of ``path``, or {} when it cannot be read (validation says why)."""
    try:
        return read_meta(path)
    except CheckpointError:
        return {}
