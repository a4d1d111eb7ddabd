"""Training data: byte-level text (the Python standard library's own sources by default,
or a user's files/folders) and pre-tokenized ``.bin`` memmaps; a deterministic, resumable
sampler that gives every rank a disjoint stream.

Legend: N tokens in a split, S sequence length, B sequences per micro-batch, W windows.

Sources (``data.source``):
* ``stdlib`` - every ``*.py`` under ``sysconfig.get_paths()['stdlib']`` (site-packages
  excluded), sorted by relative path; a file goes to validation when the hash of its
  relative path falls below ``val_fraction``.
* a text file or a folder of text files - bytes (vocab 256); a folder is split by path hash
  like stdlib, a single file by position (the last ``val_fraction`` of its bytes).
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
    """Regular, non-hidden files under ``root`` in sorted relative-path order."""
    files = []
    for p in root.rglob(pattern):
        rel = p.relative_to(root).parts
        if any(part.startswith(".") or part in _SKIP_DIRS for part in rel):
            continue
        if p.is_file():
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"data file '{path}' cannot be read: {e.strerror or e}") from e


def _split_files(root: Path, files: list[Path], val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    train, val = [], []
    for p in files:
        data = _read_bytes(p)
        if data:
            (val if _is_val(p.relative_to(root).as_posix(), val_fraction) else train).append(data)
    if not train and not val:
        raise DataError(f"data source '{root}' holds no readable non-empty files")
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

    Raises DataError naming the path for a missing, empty or unreadable source, and for
    token ids at or beyond ``vocab_size``.
    """
    src = cfg.source
    if src == "stdlib":
        root = stdlib_root()
        files = list_text_files(root, "*.py")
        if not files:
            raise DataError(f"data.source 'stdlib': no *.py files under '{root}'")
        _need_bytes(vocab_size, "stdlib")
        train, val = _split_files(root, files, cfg.val_fraction)
        return Splits(train, val, f"Python stdlib sources ({len(files)} files under {root})")
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
        train, val = _split_files(path, files, cfg.val_fraction)
        return Splits(train, val, f"text files ({len(files)} under {path})")
    if path.suffix == ".bin":
        tokens = _open_bin(path, cfg.dtype, vocab_size)
        train, val = _split_tail(tokens, cfg.val_fraction, path)
        return Splits(train, val, f"token file {path} ({cfg.dtype})")
    _need_bytes(vocab_size, str(path))
    data = _read_bytes(path)
    if not data:
        raise DataError(f"data file '{path}' is empty")
    train, val = _split_tail(np.frombuffer(data, dtype=np.uint8), cfg.val_fraction, path)
    return Splits(train, val, f"text file {path}")


def _need_bytes(vocab_size: int, source: str) -> None:
    if vocab_size < BYTE_VOCAB:
        raise DataError(f"data.source '{source}' is byte-level text and needs model.vocab_size "
                        f">= {BYTE_VOCAB}, got {vocab_size}")


def check_source(cfg: DataConfig) -> None:
    """Cheap pre-flight check (before launching processes): the path exists and is not empty."""
    if cfg.source == "stdlib":
        return
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise DataError(f"data.source '{path}' does not exist (use 'stdlib', a text file or "
                        "folder, or a .bin token file)")
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(f"data file '{path}' is empty")


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
