"""The output directory of ``epscale data prepare``: shards written atomically, the commit
log (``.prepare/state.json``) and resuming an interrupted run (see
:mod:`epscale.training.data.prepare` for the layout)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError
from .shards import HEAD_BYTES, MANIFEST, STATE_DIR, sha256_file, write_atomic

STATE_FILE = "state.json"
# The files a prepare writes (only these are ever removed from an output directory).
OUR_FILES = re.compile(r"^((train|val)-\d{5,}\.(bin|idx)|manifest\.json|tokenizer(_config)?\.json)"
                       r"(\.tmp)?$")


@dataclass
class Buffer:
    parts: list[np.ndarray] = field(default_factory=list)
    lens: list[np.ndarray] = field(default_factory=list)
    tokens: int = 0

    def add(self, tokens: np.ndarray, lens: np.ndarray) -> None:
        if tokens.size:
            self.parts.append(tokens)
            self.lens.append(lens)
            self.tokens += tokens.size


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Output:
    """The output directory and its commit log (``.prepare/state.json``)."""

    def __init__(self, out: Path, fingerprint: str, dtype: str):
        self.out, self.fingerprint, self.dtype = out, fingerprint, dtype
        self.state_path = out / STATE_DIR / STATE_FILE
        self.commits: list[dict[str, Any]] = []
        self.shards: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}

    # ---------------------------------------------------------------- opening
    def open(self, overwrite: bool) -> str:
        """'fresh', 'resume' or 'done' (a finished dataset of these inputs and settings)."""
        out = self.out
        if out.exists() and not out.is_dir():
            raise DataError(f"--out '{out}' is a file; name a directory for the prepared data")
        out.mkdir(parents=True, exist_ok=True)
        manifest = out / MANIFEST
        if manifest.is_file() and not overwrite:
            try:
                fp = json.loads(manifest.read_text()).get("fingerprint")
            except (OSError, ValueError):
                fp = None
            if fp == self.fingerprint:
                return "done"
            raise DataError(f"--out '{out}' already holds a prepared dataset of other inputs, "
                            "tokenizer or settings; choose another --out, or pass --overwrite "
                            "to replace it")
        if self.state_path.is_file() and not overwrite:
            try:
                state = json.loads(self.state_path.read_text())
            except (OSError, ValueError) as e:
                raise DataError(f"'{self.state_path}' (an interrupted prepare's progress) cannot "
                                f"be read ({e}); pass --overwrite to start again") from e
            if state.get("fingerprint") != self.fingerprint:
                raise DataError(f"--out '{out}' holds an interrupted prepare of other inputs, "
                                "tokenizer or settings; run that command again to finish it, "
                                "or pass --overwrite to start again with this one")
            self._resume(state)
            return "resume"
        foreign = [p.name for p in out.iterdir()
                   if p.name != STATE_DIR and not OUR_FILES.match(p.name)]
        if foreign:
            raise DataError(f"--out '{out}' is not empty (e.g. '{foreign[0]}') and is not a "
                            "prepared dataset; choose a new or empty directory")
        self._clean(keep=set())
        return "fresh"

    def _resume(self, state: dict[str, Any]) -> None:
        """Keep the longest run of commits whose shards are whole: every shard's size,
        and the SHA-256 of the last commit's (a crash can only have hit those)."""
        itemsize = np.dtype(self.dtype).itemsize
        kept: list[dict[str, Any]] = []
        shards = {"train": [], "val": []}
        commits = state.get("commits", [])
        for i, commit in enumerate(commits):
            ok = True
            for split in ("train", "val"):
                for entry in commit["shards"][split]:
                    ok = ok and self._shard_ok(entry, itemsize, deep=i == len(commits) - 1)
            if not ok:
                break
            kept.append(commit)
            for split in ("train", "val"):
                shards[split] += commit["shards"][split]
        self.commits, self.shards = kept, shards
        keep = {e[k] for split in shards.values() for e in split for k in ("file", "index")}
        self._clean(keep)

    def _shard_ok(self, entry: dict[str, Any], itemsize: int, deep: bool) -> bool:
        data, index = self.out / entry["file"], self.out / entry["index"]
        try:
            if data.stat().st_size != entry["tokens"] * itemsize or \
                    index.stat().st_size != entry["documents"] * 8:
                return False
        except OSError:
            return False
        return not deep or (sha256_file(data) == entry["sha256"] and
                            sha256_file(index) == entry["index_sha256"])

    def _clean(self, keep: set[str]) -> None:
        """Remove the shard, temporary and manifest files not in ``keep`` (only files
        this module writes; nothing else in the directory is touched)."""
        for p in self.out.iterdir():
            if p.is_file() and OUR_FILES.match(p.name) and p.name not in keep and \
                    not p.name.startswith("tokenizer"):
                p.unlink()
        if not keep:
            shutil.rmtree(self.out / STATE_DIR, ignore_errors=True)

    # ---------------------------------------------------------------- writing
    @property
    def next_task(self) -> int:
        return self.commits[-1]["next_task"] if self.commits else 0

    def stats(self) -> dict[str, Any]:
        return dict(self.commits[-1]["stats"]) if self.commits else {
            "documents": 0, "empty": 0, "invalid_utf8": 0, "skipped": [], "skipped_count": 0}

    def commit(self, buffers: dict[str, Buffer], next_task: int, stats: dict[str, Any]) -> int:
        """Write the buffered shards (temporary file, fsync, rename), then record the
        commit; returns the tokens written."""
        new = {"train": [], "val": []}
        written = 0
        for split, buf in buffers.items():
            if not buf.tokens:
                continue
            name = f"{split}-{len(self.shards[split]):05d}"
            tokens = np.concatenate(buf.parts).astype(np.dtype(self.dtype).newbyteorder("<"),
                                                      copy=False)
            ends = np.cumsum(np.concatenate(buf.lens)).astype("<u8")
            entry = {"file": f"{name}.bin", "index": f"{name}.idx", "tokens": int(tokens.size),
                     "documents": int(ends.size),
                     "sha256": write_atomic(self.out / f"{name}.bin", tokens),
                     "index_sha256": write_atomic(self.out / f"{name}.idx", ends),
                     "head_sha256": hashlib.sha256(
                         memoryview(tokens).cast("B")[:HEAD_BYTES]).hexdigest()}
            new[split].append(entry)
            self.shards[split].append(entry)
            written += tokens.size
            buffers[split] = Buffer()
        _fsync_dir(self.out)
        self.commits.append({"next_task": next_task, "shards": new, "stats": stats})
        self._write_state()
        return written

    def _write_state(self) -> None:
        self.state_path.parent.mkdir(exist_ok=True)
        blob = json.dumps({"fingerprint": self.fingerprint, "commits": self.commits}).encode()
        write_atomic(self.state_path, np.frombuffer(blob, np.uint8))

    def finish(self, manifest: dict[str, Any]) -> None:
        blob = (json.dumps(manifest, indent=1) + "\n").encode()
        write_atomic(self.out / MANIFEST, np.frombuffer(blob, np.uint8))
        _fsync_dir(self.out)
        shutil.rmtree(self.out / STATE_DIR, ignore_errors=True)
