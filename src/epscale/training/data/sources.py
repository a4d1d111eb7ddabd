"""What ``data.source`` / ``data.sources`` name, opened for training: each source's two
splits as token arrays (in memory for byte-level text; memory-mapped for ``.bin`` files
and prepared shards), its end-of-document id, and the mixture weights.

Kinds of source (a path, or ``stdlib``):

* ``stdlib``, a text file, a folder of text files: byte-level text, read whole
  (:mod:`epscale.training.data.text`); only with ``data.tokenizer: bytes``.
* a directory from ``epscale data prepare`` (it holds ``manifest.json``): shards streamed
  by memory map (:mod:`epscale.training.data.shards`); its tokenizer must be
  ``data.tokenizer`` (same hash).
* a ``.bin`` file of ``data.dtype`` token ids (nanoGPT convention), split by position, or
  a folder holding ``train.bin`` (and ``val.bin``); no document boundaries.

``thorough`` (the pre-launch checks, once, in the launcher) also reads the data: every
id of a ``.bin`` against ``model.vocab_size``, and with ``data.verify_shards`` every
prepared shard's SHA-256. The trainer's ranks open sources without reading them; the
sampler checks the ids of every window it reads (a few thousand ints).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...config import DataConfig
from .errors import DataError
from .shards import is_prepared, open_prepared, verify_shards
from .text import _split_tail, load_text
from .tokenizer import ByteTokenizer, Tokenizer, check_vocab, load_tokenizer


@dataclass
class Splits:
    """One source: token arrays of its two splits (a numpy array, a memmap or
    :class:`~epscale.training.data.shards.ShardedTokens`) and where they came from.

    eos_id: the end-of-document id that follows every document (None: no boundaries).
    id_limit: every id is below it (the model's vocab_size; None: not checked).
    name: the path, for messages. weight: the share of training samples (mixtures).
    short_hint: what to do when a split is shorter than one window.
    """

    train: Any
    val: Any
    description: str
    eos_id: int | None = None
    id_limit: int | None = None
    name: str = ""
    weight: float = 1.0
    short_hint: str = "use more data, a shorter model.seq_len or another data.val_fraction"


@dataclass
class Mixture:
    """The sources of a run and their normalised weights (one source: weight 1)."""

    parts: list[Splits]
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    doc_masking: bool = False

    @property
    def weights(self) -> list[float]:
        total = sum(p.weight for p in self.parts)
        return [p.weight / total for p in self.parts]

    @property
    def train_tokens(self) -> int:
        return sum(int(p.train.size) for p in self.parts)

    @property
    def val_tokens(self) -> int:
        return sum(int(p.val.size) for p in self.parts)

    @property
    def eos_id(self) -> int | None:
        return self.parts[0].eos_id

    @property
    def description(self) -> str:
        if len(self.parts) == 1:
            text = self.parts[0].description
        else:
            text = f"mixture of {len(self.parts)} sources (" + "; ".join(
                f"{100 * w:.0f}% {p.description}" for p, w in zip(self.parts, self.weights)) + ")"
        if self.doc_masking:
            text += ", document masking on"
        return text


def _open_bin(path: Path, dtype: str, vocab_size: int, thorough: bool) -> np.ndarray:
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
    if thorough:
        _check_ids(tokens, vocab_size, path)
    return tokens


def _check_ids(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    chunk = 1 << 24
    for start in range(0, tokens.size, chunk):
        block = tokens[start:start + chunk]
        top = int(block.max())
        if top >= vocab_size:
            where = start + int(np.argmax(block >= vocab_size))
            raise DataError(f"token file '{path}' holds token id {int(tokens[where])} at "
                            f"index {where}, beyond model.vocab_size={vocab_size}")


def _raw_text_needs_bytes(tok: Tokenizer, source: str) -> None:
    if not isinstance(tok, ByteTokenizer):
        raise DataError(
            f"data.source '{source}' is raw text, which the trainer reads as bytes, but "
            f"data.tokenizer is '{tok.name}'; tokenize it first: epscale data prepare {source} "
            f"--tokenizer {tok.name} --out DIR, then train with data.source=DIR")


def open_source(source: str, cfg: DataConfig, tok: Tokenizer, vocab_size: int,
                thorough: bool = False) -> Splits:
    """One source (see the module docstring), checked against ``tok`` and ``vocab_size``."""
    if source == "stdlib":
        _raw_text_needs_bytes(tok, source)
        train, val, desc = load_text(source, cfg.val_fraction, vocab_size)
        return Splits(train, val, desc, None, vocab_size, source)
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data.source '{path}' does not exist (use 'stdlib', a text file or "
                        "folder, a .bin token file, or a directory from 'epscale data prepare')")
    if is_prepared(path):
        data = open_prepared(path, tok.hash, tok.name, vocab_size)
        if thorough and cfg.verify_shards:  # after the cheap checks: this reads everything
            verify_shards(path)
        m = data.manifest
        if data.val.size == 0:
            raise DataError(f"data source '{path}' has no validation documents; prepare it again "
                            "with a larger --val-fraction")
        recorded = "bytes" if m["tokenizer"]["kind"] == "bytes" else m["tokenizer"]["name"]
        same = "" if recorded == tok.name else f"; prepared with {recorded}, the same sha256"
        desc = (f"prepared {path} ({m['documents']['train'] + m['documents']['val']:,} documents"
                f" in {len(m['splits']['train']) + len(m['splits']['val'])} shards of "
                f"{m['dtype']} ids; tokenizer {tok.name} (data.tokenizer{same}), vocab "
                f"{m['tokenizer']['vocab_size']:,})")
        return Splits(data.train, data.val, desc, data.eos_id, vocab_size, str(path),
                      short_hint="prepare it again with a larger --val-fraction (or more "
                      "text), or use a shorter model.seq_len")
    if path.is_dir() and (path / "train.bin").is_file():
        train = _open_bin(path / "train.bin", cfg.dtype, vocab_size, thorough)
        if (path / "val.bin").is_file():
            val = _open_bin(path / "val.bin", cfg.dtype, vocab_size, thorough)
        else:
            train, val = _split_tail(train, cfg.val_fraction, path / "train.bin")
        return Splits(train, val, f"token files {path}/train.bin ({cfg.dtype})", None,
                      vocab_size, str(path))
    if path.is_file() and path.suffix == ".bin":
        tokens = _open_bin(path, cfg.dtype, vocab_size, thorough)
        train, val = _split_tail(tokens, cfg.val_fraction, path)
        return Splits(train, val, f"token file {path} ({cfg.dtype})", None, vocab_size, str(path))
    _raw_text_needs_bytes(tok, str(path))
    train, val, desc = load_text(str(path), cfg.val_fraction, vocab_size)
    return Splits(train, val, desc, None, vocab_size, str(path))


def source_list(cfg: DataConfig) -> list[tuple[str, float]]:
    """``(path, weight)`` of every source the config names."""
    if cfg.sources:
        return [(s["path"], float(s["weight"])) for s in cfg.sources]
    return [(cfg.source, 1.0)]


def load_data(cfg: DataConfig, vocab_size: int, thorough: bool = False) -> Mixture:
    """Every source of ``cfg`` opened (:func:`open_source`), the tokenizer checked against
    ``model.vocab_size``, and ``data.doc_masking`` against the sources' boundaries."""
    paths = [path for path, _ in source_list(cfg)]
    twice = [p for i, p in enumerate(paths) if p in paths[:i]]
    if twice:
        raise DataError(f"data.sources names '{twice[0]}' twice; give each source once (its "
                        "weight sets its share)")
    tok = load_tokenizer(cfg.tokenizer, require_eos=False)
    if not isinstance(tok, ByteTokenizer):
        check_vocab(tok, vocab_size)
    if cfg.doc_masking:  # before reading anything
        bare = [path for path, _ in source_list(cfg)
                if path == "stdlib" or not is_prepared(Path(path).expanduser())]
        if bare:
            raise DataError(f"data.doc_masking needs document boundaries, but data source "
                            f"'{bare[0]}' has none (raw text and .bin files are one stream); "
                            "prepare it with 'epscale data prepare', or set "
                            "data.doc_masking=false")
    parts = []
    for path, weight in source_list(cfg):
        part = open_source(path, cfg, tok, vocab_size, thorough)
        part.weight = weight
        parts.append(part)
    eos = {p.eos_id for p in parts if p.eos_id is not None}
    if len(eos) > 1:
        raise DataError(f"the data sources end documents with different ids ({sorted(eos)}); "
                        "mix sources prepared with the same tokenizer")
    return Mixture(parts, tok, cfg.doc_masking)


def load_splits(cfg: DataConfig, vocab_size: int, thorough: bool = True) -> Splits:
    """The one source of ``cfg.source`` (the byte-level default included), with the
    thorough checks by default (see the module docstring)."""
    return load_data(cfg, vocab_size, thorough).parts[0]
