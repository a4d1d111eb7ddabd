"""Prepared datasets (``epscale data prepare``) on disk: the manifest, its checks, and the
shards read as one memory-mapped array.

Opening one (:func:`open_prepared`) reads ``manifest.json`` and ``stat`` s every shard.
The checks: the format, the tokenizer hash against ``data.tokenizer``, the vocabulary
against ``model.vocab_size``, every shard present with the size the manifest says (a
shard cut short by a crash or a copy is caught here). The pre-launch check (``checksums``,
once per launch) also hashes what is cheap to read: every document index whole (8 bytes
per document) and the first ``HEAD_BYTES`` of every token shard (manifests written since
that field exists), so a flipped byte there stops the run at start naming the file. The
SHA-256 of all the data is checked by ``epscale data verify DIR``, or before launch with
``data.verify_shards: true``: that reads all of it, once, in the launcher.

:class:`ShardedTokens` maps a shard the first time a window touches it and reads only
the pages a window covers; the shards join into one stream (a window may span two).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError

FORMAT = "epscale-tokens"
VERSION = 1
MANIFEST = "manifest.json"
STATE_DIR = ".prepare"  # an unfinished prepare's progress
DTYPES = ("uint16", "uint32")
HEAD_BYTES = 1 << 16  # the start of each token shard hashed at every launch ("head_sha256")


def shard_dtype(vocab_size: int) -> str:
    """The narrowest dtype that holds every id below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write_atomic(path: Path, data: np.ndarray) -> str:
    """Write ``data``'s bytes to ``path`` through a temporary file (write, fsync, rename:
    a reader sees the old file or the whole new one, never part of it); returns the
    SHA-256 of the bytes."""
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(view)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return hashlib.sha256(view).hexdigest()


def is_prepared(path: Path) -> bool:
    """``path`` is a prepared dataset, finished or not (a manifest or a prepare's progress)."""
    return path.is_dir() and ((path / MANIFEST).is_file() or (path / STATE_DIR).is_dir())


@dataclass
class Prepared:
    """A prepared dataset: its manifest and both splits as :class:`ShardedTokens`."""

    path: Path
    manifest: dict[str, Any]
    train: ShardedTokens
    val: ShardedTokens

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.manifest["tokenizer"]

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer["eos_id"])


def read_manifest(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST
    if not path.is_dir():
        raise DataError(f"prepared data directory '{path}' does not exist")
    if not mpath.is_file():
        if (path / STATE_DIR).is_dir():
            raise DataError(f"data source '{path}' is an unfinished 'epscale data prepare' (no "
                            f"{MANIFEST} yet); run the same prepare command again to finish it")
        raise DataError(f"data source '{path}' has no {MANIFEST}; is it an 'epscale data "
                        "prepare' output?")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"'{mpath}' cannot be read as JSON ({e}); prepare the data again") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"'{mpath}' is not an epscale token manifest (format "
                        f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("version") != VERSION:
        raise DataError(f"'{mpath}' has format version {manifest.get('version')!r}; this "
                        f"epscale reads version {VERSION}: prepare the data again")
    if manifest.get("dtype") not in DTYPES:
        raise DataError(f"'{mpath}' names dtype {manifest.get('dtype')!r}, not one of {DTYPES}")
    try:
        tok = manifest["tokenizer"]
        for key in ("hash", "vocab_size", "eos_id", "name"):
            tok[key]
        for split in ("train", "val"):
            for e in manifest["splits"][split]:
                for key in ("file", "index", "tokens", "documents", "sha256", "index_sha256"):
                    e[key]
    except (KeyError, TypeError) as e:
        raise DataError(f"'{mpath}' lacks {e} (or is malformed); prepare the data again") from None
    return manifest


def head_sha256(path: Path) -> str:
    """SHA-256 of the first :data:`HEAD_BYTES` of ``path``."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()


def open_prepared(path: Path, tokenizer_hash: str, tokenizer_name: str,
                  vocab_size: int, checksums: bool = False) -> Prepared:
    """The dataset in ``path``, checked against the run's tokenizer and model (without
    reading the data, except with ``checksums``: see the module docstring)."""
    manifest = read_manifest(path)
    tok = manifest["tokenizer"]
    copy = path / tok["file"] if tok.get("file") else None
    if tok["hash"] != tokenizer_hash:
        hint = (f"set data.tokenizer={copy} (the copy prepared with it)" if copy
                else "set data.tokenizer=bytes")
        given = ("is 'bytes' (the default)" if tokenizer_name == "bytes" else
                 f"'{tokenizer_name}' hashes to {tokenizer_hash[:12]}...")
        raise DataError(
            f"data source '{path}' was prepared with tokenizer {tok['name']} (sha256 "
            f"{tok['hash'][:12]}...), but data.tokenizer {given}: the token ids would mean "
            f"other text. {hint[0].upper()}{hint[1:]}, or prepare the data again with this "
            "tokenizer")
    if int(tok["vocab_size"]) > vocab_size:
        raise DataError(f"data source '{path}' holds token ids up to {int(tok['vocab_size']) - 1} "
                        f"(tokenizer {tok['name']}, {int(tok['vocab_size']):,} ids) but "
                        f"model.vocab_size is {vocab_size:,}; set model.vocab_size="
                        f"{-(-int(tok['vocab_size']) // 64) * 64}")
    dtype = manifest["dtype"]
    splits = {}
    for split in ("train", "val"):
        entries = manifest["splits"][split]
        splits[split] = ShardedTokens([path / e["file"] for e in entries],
                                      [int(e["tokens"]) for e in entries], dtype)
        for e in entries:
            _check_size(path, e, np.dtype(dtype).itemsize)
            if checksums:
                _check_cheap_hashes(path, e)
    return Prepared(path, manifest, splits["train"], splits["val"])


def _check_size(root: Path, entry: dict[str, Any], itemsize: int) -> None:
    for key, want in (("file", entry["tokens"] * itemsize), ("index", entry["documents"] * 8)):
        p = root / entry[key]
        try:
            size = p.stat().st_size
        except OSError as e:
            raise DataError(f"shard '{p}' of the prepared data cannot be read "
                            f"({e.strerror or e}); restore it or prepare the data again") from e
        if size != want:
            raise DataError(f"shard '{p}' has {size:,} bytes, not the {want:,} its manifest "
                            "says: it was cut short or changed after prepare; restore it or "
                            "prepare the data again")


def _check_cheap_hashes(root: Path, entry: dict[str, Any]) -> None:
    """The document index's SHA-256 and the shard head's (when the manifest has it)."""
    checks = [(root / entry["index"], entry["index_sha256"], sha256_file, "its document index")]
    if entry.get("head_sha256"):
        checks.append((root / entry["file"], entry["head_sha256"], head_sha256,
                       f"its first {HEAD_BYTES:,} bytes"))
    for p, want, digest, what in checks:
        try:
            got = digest(p)
        except OSError as e:
            raise DataError(f"shard '{p}' of the prepared data cannot be read "
                            f"({e.strerror or e}); restore it or prepare the data again") from e
        if got != want:
            raise DataError(
                f"shard '{p}' is damaged: the SHA-256 of {what} is {got[:12]}..., the manifest "
                f"says {want[:12]}... (changed after prepare). Restore it, or prepare the data "
                "again (epscale data prepare ... --overwrite); `epscale data verify "
                f"{root}` checks every shard whole")


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with p.open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def verify_shards(path: Path, report: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Check every shard's and index's SHA-256 against the manifest (reads all the data);
    raises DataError naming the first that differs. Returns the manifest."""
    manifest = read_manifest(path)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in ("train", "val"):
        for e in manifest["splits"][split]:
            _check_size(path, e, itemsize)
            for key, hkey in (("file", "sha256"), ("index", "index_sha256")):
                p = path / e[key]
                got = sha256_file(p)
                if got != e[hkey]:
                    raise DataError(
                        f"shard '{p}' does not match its manifest (sha256 {got[:12]}..., "
                        f"the manifest says {e[hkey][:12]}...): it was changed or damaged after "
                        "prepare; restore it, or prepare the data again (epscale data prepare "
                        "... --overwrite)")
                if report is not None:
                    report(e[key])
    return manifest


class ShardedTokens:
    """The token ids of several shard files read as one array: ``len``, ``size``,
    ``dtype`` and contiguous slicing (``tokens[a:b]`` -> a numpy array), which is all
    the sampler needs. A shard is memory-mapped the first time a slice touches it."""

    def __init__(self, paths: list[Path], sizes: list[int], dtype: str):
        self.paths, self.dtype = list(paths), np.dtype(dtype).newbyteorder("<")
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.size = int(self.offsets[-1])
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.size

    def _shard(self, i: int) -> np.ndarray:
        m = self._maps.get(i)
        if m is None:
            n = int(self.offsets[i + 1] - self.offsets[i])
            try:
                m = np.memmap(self.paths[i], dtype=self.dtype, mode="r", shape=(n,))
            except (OSError, ValueError) as e:
                raise DataError(f"shard '{self.paths[i]}' cannot be memory-mapped: {e}") from e
            self._maps[i] = m
        return m

    def locate(self, position: int) -> tuple[Path, int]:
        """The shard file and offset in it of global token ``position`` (for messages)."""
        i = int(np.searchsorted(self.offsets, position, side="right")) - 1
        return self.paths[i], position - int(self.offsets[i])

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("ShardedTokens supports contiguous slices only")
        start, stop, _ = key.indices(self.size)
        if stop <= start:
            return np.zeros(0, self.dtype)
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts = []
        i = first
        while start < stop:
            lo = start - int(self.offsets[i])
            hi = min(stop, int(self.offsets[i + 1])) - int(self.offsets[i])
            if hi > lo:
                parts.append(self._shard(i)[lo:hi])
                start += hi - lo
            i += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
