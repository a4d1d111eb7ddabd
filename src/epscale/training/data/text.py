"""Byte-level text sources: the Python standard library's own sources, or a user's text
file or folder, read whole into memory as bytes (vocab 256, no end-of-document id: files
are joined with no separator, as the byte-level default always has been).

* ``stdlib`` - every ``*.py`` under ``sysconfig.get_paths()['stdlib']`` (site-packages
  excluded), sorted by relative path; a file goes to validation when the hash of its
  relative path falls below ``val_fraction``.
* a text file or a folder of text files; a folder is split by path hash like stdlib, a
  single file by position (the last ``val_fraction`` of its bytes). A file is text unless
  a NUL byte sits in its first 8 KiB (:func:`binary_reason`); a folder's other files are
  skipped with a note in the data description, and a folder with no text file, or a
  single file that is not text, is an error.

For corpora beyond memory, tokenize with ``epscale data prepare`` and train on the
prepared directory (:mod:`epscale.training.data.shards`).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import BYTE_VOCAB, DataError

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}

# How much of a file's start decides whether it is text (the window git and GNU grep use).
TEXT_PROBE_BYTES = 8192
# What to use instead when the files are token ids, not text.
_TOKEN_HINT = ("for token ids give a raw .bin file of data.dtype ids as data.source, or a "
               "folder holding train.bin (and val.bin), or a directory from 'epscale data "
               "prepare'; see the epscale.training.data docstring")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_val(rel_path: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < val_fraction


def list_text_files(root: Path, pattern: str = "*") -> list[Path]:
    """Regular, non-hidden files under ``root`` in sorted relative-path order: the
    candidates; whether each is text is decided when it is read (:func:`binary_reason`),
    so that every file is read once."""
    files = []
    for p in root.rglob(pattern):
        rel = p.relative_to(root).parts
        if any(part.startswith(".") or part in _SKIP_DIRS for part in rel):
            continue
        if p.is_file():
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_text_file(path: Path, what: str = "data file") -> tuple[bytes, str | None]:
    """``(the file's bytes, None)`` for a text file, ``(b"", why not)`` for one that is not
    text (:func:`binary_reason`). Only the first :data:`TEXT_PROBE_BYTES` of a binary file
    are read, so skipping a folder's large binaries costs neither time nor memory.
    ``what`` names the file in the error when it cannot be read."""
    try:
        with path.open("rb") as f:
            reason = binary_reason(f.read(TEXT_PROBE_BYTES))
            if reason is not None:
                return b"", reason
            f.seek(0)
            return f.read(), None
    except OSError as e:
        raise DataError(f"{what} '{path}' cannot be read: {e.strerror or e}") from e


def binary_reason(data: bytes) -> str | None:
    """Why ``data`` (a file's bytes, or its first bytes) is not text, or None when it is text.

    The rule: a NUL byte in the first :data:`TEXT_PROBE_BYTES` bytes means binary (as in
    git and GNU grep). It is cheap (8 KiB per file) and robust:
    images, archives, executables, pickles and token arrays carry NULs in their headers or
    small ids, and compressed or random bytes miss a NUL in 8 KiB with probability
    (255/256)**8192, about 1e-14. UTF-16 text has NULs too and is skipped (re-encode it as
    UTF-8). UTF-8 is not required: a byte-level model reads latin-1 or koi8-r text as well
    as UTF-8, and the standard library ships such sources.
    """
    if data.find(b"\0", 0, TEXT_PROBE_BYTES) >= 0:
        return f"NUL bytes in its first {TEXT_PROBE_BYTES // 1024} KiB"
    return None


@dataclass
class _TextFiles:
    """What reading a folder's candidate files found: the text of each non-empty text file
    by relative path, the files skipped as not text (relative path, reason), the empty ones."""

    texts: list[tuple[str, bytes]]
    skipped: list[tuple[str, str]]
    empty: int


def _read_text_files(root: Path, files: list[Path]) -> _TextFiles:
    """Read every text file once, keeping the non-empty ones (see :func:`read_text_file`)."""
    found = _TextFiles([], [], 0)
    for p in files:
        data, reason = read_text_file(p)
        rel = p.relative_to(root).as_posix()
        if reason is not None:
            found.skipped.append((rel, reason))
        elif data:
            found.texts.append((rel, data))
        else:
            found.empty += 1
    if not found.texts:
        raise _no_text_error(root, len(files), found)
    return found


def _no_text_error(root: Path, num_files: int, found: _TextFiles) -> DataError:
    """The error for a folder whose files hold no text: how many of each kind, one example."""
    if not found.skipped:
        return DataError(f"data source '{root}' holds no readable non-empty files")
    rel, reason = found.skipped[0]
    example = f"e.g. {rel}: {reason}"
    if found.empty:
        what = (f"none of them non-empty text ({len(found.skipped)} not text, {example}; "
                f"{found.empty} empty)")
    else:
        what = f"none of them text ({example})"
    return DataError(f"data.source '{root}' holds {num_files} files, {what}; {_TOKEN_HINT}")


def _skipped_note(found: _TextFiles) -> str:
    """'' or the description's note on the files skipped as not text (count, one example)."""
    if not found.skipped:
        return ""
    rel, reason = found.skipped[0]
    return f"; skipped {len(found.skipped)} that are not text, e.g. {rel} ({reason})"


def _split_files(root: Path, found: _TextFiles, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    train, val = [], []
    for rel, data in found.texts:
        (val if _is_val(rel, val_fraction) else train).append(data)
    if not train or not val:
        # Too few files for a hash split: fall back to a positional split of everything.
        return _split_tail(np.frombuffer(b"".join(train + val), dtype=np.uint8), val_fraction, root)
    return (np.frombuffer(b"".join(train), dtype=np.uint8),
            np.frombuffer(b"".join(val), dtype=np.uint8))


def _split_tail(tokens: np.ndarray, val_fraction: float, path: Path) -> tuple[np.ndarray, np.ndarray]:
    if tokens.size < 4:
        raise DataError(f"data source '{path}' holds only {tokens.size} tokens; need more "
                        "to split into train and validation")
    cut = int(tokens.size * (1.0 - val_fraction))
    cut = min(max(cut, 2), tokens.size - 2)
    return tokens[:cut], tokens[cut:]


def load_text(source: str, val_fraction: float, vocab_size: int) -> tuple[np.ndarray, np.ndarray, str]:
    """``(train, val, description)`` of a byte-level text source: ``'stdlib'``, a folder of
    text files or one text file (uint8 arrays in memory; see the module docstring)."""
    if source == "stdlib":
        root = stdlib_root()
        files = list_text_files(root, "*.py")
        if not files:
            raise DataError(f"data.source 'stdlib': no *.py files under '{root}'")
        need_bytes(vocab_size, "stdlib")
        found = _read_text_files(root, files)
        train, val = _split_files(root, found, val_fraction)
        used = len(files) - len(found.skipped)
        return train, val, (f"Python stdlib sources ({used} files under {root}"
                            f"{_skipped_note(found)})")
    path = Path(source).expanduser()
    if path.is_dir():
        files = list_text_files(path)
        if not files:
            raise DataError(f"data.source '{path}' is a folder with no files")
        need_bytes(vocab_size, str(path))
        found = _read_text_files(path, files)
        train, val = _split_files(path, found, val_fraction)
        used = len(files) - len(found.skipped)
        return train, val, f"text files ({used} under {path}{_skipped_note(found)})"
    need_bytes(vocab_size, str(path))
    data, reason = read_text_file(path)
    if reason is not None:
        raise DataError(f"data file '{path}' is not text ({reason}); {_TOKEN_HINT}")
    if not data:
        raise DataError(f"data file '{path}' is empty")
    train, val = _split_tail(np.frombuffer(data, dtype=np.uint8), val_fraction, path)
    return train, val, f"text file {path}"


def need_bytes(vocab_size: int, source: str) -> None:
    if vocab_size < BYTE_VOCAB:
        raise DataError(f"data.source '{source}' is byte-level text and needs model.vocab_size "
                        f">= {BYTE_VOCAB}, got {vocab_size}")
