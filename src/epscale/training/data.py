"""Training data: byte-level text (the Python standard library's own sources by default,
or a user's files/folders) and pre-tokenized ``.bin`` memmaps; a deterministic, resumable
sampler that gives every rank a disjoint stream.

Legend: N tokens in a split, S sequence length, B sequences per micro-batch, W windows.

Sources (``data.source``):
* ``stdlib`` - every ``*.py`` under ``sysconfig.get_paths()['stdlib']`` (site-packages
  excluded), sorted by relative path; a file goes to validation when the hash of its
  relative path falls below ``val_fraction``.
* a text file or a folder of text files - bytes (vocab 256); a folder is split by path hash
  like stdlib, a single file by position (the last ``val_fraction`` of its bytes). A file is
  text unless a NUL byte sits in its first 8 KiB (:func:`binary_reason`); a folder's other
  files are skipped with a note in the data description, and a folder with no text file, or
  a single file that is not text, is an error.
* a ``.bin`` file of ``data.dtype`` token ids (nanoGPT convention), split by position, or a
  folder holding ``train.bin`` (and ``val.bin``).

Sampling: a split of N tokens holds W = (N - 1) // S windows of S + 1 tokens. Global sample
g reads window ``perm_epoch[g % W]`` with epoch = g // W and a permutation seeded by
(data.seed, epoch). Every optimizer step consumes ``world * grad_accum * B`` global samples;
rank r's micro-batch m takes a contiguous block of B of them. The position is one integer
(samples consumed), so a checkpoint resumes exactly, and changing the number of ranks while
keeping ``world * B`` fixed replays exactly the same global batches.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, DataConfig

BYTE_VOCAB = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}

# How much of a file's start decides whether it is text (the window git and GNU grep use).
TEXT_PROBE_BYTES = 8192
# What to use instead when the files are token ids, not text.
_TOKEN_HINT = ("for token ids give a raw .bin file of data.dtype ids as data.source, or a "
               "folder holding train.bin (and val.bin); see the epscale.training.data docstring")


class DataError(ConfigError):
    """A data source that cannot be used; the message names the path and why."""


# --------------------------------------------------------------------------------------
# Loading sources into token arrays
# --------------------------------------------------------------------------------------


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


def _read_text(path: Path) -> tuple[bytes, str | None]:
    """``(the file's bytes, None)`` for a text file, ``(b"", why not)`` for one that is not
    text (:func:`binary_reason`). Only the first :data:`TEXT_PROBE_BYTES` of a binary file
    are read, so skipping a folder's large binaries costs neither time nor memory."""
    try:
        with path.open("rb") as f:
            reason = binary_reason(f.read(TEXT_PROBE_BYTES))
            if reason is not None:
                return b"", reason
            f.seek(0)
            return f.read(), None
    except OSError as e:
        raise DataError(f"data file '{path}' cannot be read: {e.strerror or e}") from e


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
    """Read every text file once, keeping the non-empty ones (see :func:`_read_text`)."""
    found = _TextFiles([], [], 0)
    for p in files:
        data, reason = _read_text(p)
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


def _open_bin(path: Path, dtype: str, vocab_size: int) -> np.ndarray:
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"token file '{path}' cannot be read: {e.strerror or e}") from e
    itemsize = np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"token file '{path}' is empty")
    if size % itemsize:
        raise DataError(f"token file '{path}' has {size} bytes, not a multiple of "
                        f"{itemsize} (data.dtype={dtype}); is data.dtype right?")
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"token file '{path}' cannot be memory-mapped: {e}") from e
    _check_vocab(tokens, vocab_size, path)
    return tokens


def _check_vocab(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    chunk = 1 << 24
    for start in range(0, tokens.size, chunk):
        block = tokens[start:start + chunk]
        top = int(block.max())
        if top >= vocab_size:
            where = start + int(np.argmax(block >= vocab_size))
            raise DataError(f"token file '{path}' holds token id {int(tokens[where])} at "
                            f"index {where}, beyond model.vocab_size={vocab_size}")


@dataclass
class Splits:
    """Token arrays of the two splits (uint8 bytes or the .bin dtype) and where they came from."""

    train: np.ndarray
    val: np.ndarray
    description: str


def load_splits(cfg: DataConfig, vocab_size: int) -> Splits:
    """Read ``cfg.source`` into train/validation token arrays (see the module docstring).

    Raises DataError naming the path for a missing, empty or unreadable source, for a
    folder with no text file or a single file that is not text, and for token ids at or
    beyond ``vocab_size``.
    """
    src = cfg.source
    if src == "stdlib":
        root = stdlib_root()
        files = list_text_files(root, "*.py")
        if not files:
            raise DataError(f"data.source 'stdlib': no *.py files under '{root}'")
        _need_bytes(vocab_size, "stdlib")
        found = _read_text_files(root, files)
        train, val = _split_files(root, found, cfg.val_fraction)
        used = len(files) - len(found.skipped)
        return Splits(train, val, f"Python stdlib sources ({used} files under {root}"
                                  f"{_skipped_note(found)})")
    path = Path(src).expanduser()
    if not path.exists():
        raise DataError(f"data.source '{path}' does not exist (use 'stdlib', a text file or "
                        "folder, or a .bin token file)")
    if path.is_dir():
        if (path / "train.bin").is_file():
            train = _open_bin(path / "train.bin", cfg.dtype, vocab_size)
            if (path / "val.bin").is_file():
                val = _open_bin(path / "val.bin", cfg.dtype, vocab_size)
            else:
                train, val = _split_tail(train, cfg.val_fraction, path / "train.bin")
            return Splits(train, val, f"token files {path}/train.bin ({cfg.dtype})")
        files = list_text_files(path)
        if not files:
            raise DataError(f"data.source '{path}' is a folder with no files")
        _need_bytes(vocab_size, str(path))
        found = _read_text_files(path, files)
        train, val = _split_files(path, found, cfg.val_fraction)
        used = len(files) - len(found.skipped)
        return Splits(train, val, f"text files ({used} under {path}{_skipped_note(found)})")
    if path.suffix == ".bin":
        tokens = _open_bin(path, cfg.dtype, vocab_size)
        train, val = _split_tail(tokens, cfg.val_fraction, path)
        return Splits(train, val, f"token file {path} ({cfg.dtype})")
    _need_bytes(vocab_size, str(path))
    data, reason = _read_text(path)
    if reason is not None:
        raise DataError(f"data file '{path}' is not text ({reason}); {_TOKEN_HINT}")
    if not data:
        raise DataError(f"data file '{path}' is empty")
    train, val = _split_tail(np.frombuffer(data, dtype=np.uint8), cfg.val_fraction, path)
    return Splits(train, val, f"text file {path}")


def _need_bytes(vocab_size: int, source: str) -> None:
    if vocab_size < BYTE_VOCAB:
        raise DataError(f"data.source '{source}' is byte-level text and needs model.vocab_size "
                        f">= {BYTE_VOCAB}, got {vocab_size}")


# --------------------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------------------


class WindowSampler:
    """Deterministic windows of ``seq_len + 1`` tokens over one split.

    ``batch(first, count)`` returns global samples ``first .. first+count-1`` as
    (inputs_BS, targets_BS) int64 tensors; the same global index always gives the same window.
    ``shuffle=False`` reads windows in order (validation).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, shuffle: bool = True,
                 name: str = "train"):
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.num_windows = (tokens.size - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"the {name} split has {tokens.size} tokens, fewer than "
                            f"model.seq_len + 1 = {seq_len + 1}; use more data, a shorter "
                            "model.seq_len or another data.val_fraction")
        self._perm_epoch, self._perm = -1, None

    def _window(self, g: int) -> int:
        epoch, i = divmod(g, self.num_windows)
        if not self.shuffle:
            return i
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_windows, generator=gen).numpy()
            self._perm_epoch = epoch
        return int(self._perm[i])

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        S = self.seq_len
        rows = []
        for g in range(first, first + count):
            start = self._window(g) * S
            rows.append(np.asarray(self.tokens[start:start + S + 1], dtype=np.int64))
        block_BS1 = torch.from_numpy(np.stack(rows))
        return block_BS1[:, :-1].contiguous(), block_BS1[:, 1:].contiguous()


class DataLoader:
    """Per-rank view of the global sample stream, with a one-integer resumable position.

    ``next_micro_batch()`` returns this rank's next (inputs_BS, targets_BS);
    ``end_step()`` advances the global position past the whole step (all ranks, all
    micro-batches). ``position`` (global samples consumed) is what checkpoints store.
    """

    def __init__(self, splits: Splits, seq_len: int, micro_batch_size: int, grad_accum: int,
                 rank: int, world_size: int, seed: int):
        self.train = WindowSampler(splits.train, seq_len, seed, shuffle=True,
                                   name=f"train split of {splits.description}")
        self.val = WindowSampler(splits.val, seq_len, seed, shuffle=False,
                                 name=f"validation split of {splits.description}")
        self.B, self.accum, self.rank, self.world = micro_batch_size, grad_accum, rank, world_size
        self.position = 0
        self._micro = 0

    @property
    def samples_per_step(self) -> int:
        return self.world * self.accum * self.B

    def next_micro_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._micro >= self.accum:
            raise RuntimeError("next_micro_batch called more than grad_accum times in a step")
        first = self.position + (self._micro * self.world + self.rank) * self.B
        self._micro += 1
        return self.train.batch(first, self.B)

    def end_step(self) -> None:
        self.position += self.samples_per_step
        self._micro = 0

    def skip_steps(self, num_steps: int) -> None:
        """Advance past ``num_steps`` whole steps without reading them (spike rollback)."""
        self.position += num_steps * self.samples_per_step
        self._micro = 0

    def val_batches(self, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the fixed validation set: the same batches at every eval."""
        return [self.val.batch((i * self.world + self.rank) * self.B, self.B)
                for i in range(num_batches)]

    def state_dict(self) -> dict:
        return {"position": self.position, "samples_per_step": self.samples_per_step}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self._micro = 0


def byte_unigram_entropy(tokens: np.ndarray, vocab_size: int = BYTE_VOCAB) -> float:
    """Entropy (nats) of the token frequency distribution: what a model without context
    can reach; the trainer prints it next to the loss."""
    counts = np.bincount(np.asarray(tokens[: 1 << 24]), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
