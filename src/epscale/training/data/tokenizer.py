"""Tokenizers: ``bytes`` (built in) or a Hugging Face ``tokenizer.json`` (the ``tokenizers``
library), and training a byte-level BPE on the user's own text.

``data.tokenizer`` / ``--tokenizer`` is ``bytes`` or a PATH: a ``tokenizer.json`` file or a
directory holding one (a prepared data directory holds a copy). What the rest of the
package needs from a tokenizer is :class:`TokenizerInfo`-like: ``vocab_size`` (every id is
below it), ``eos_id`` (appended after every document by ``epscale data prepare``),
``bos_id`` (or None), ``hash`` (recorded in a prepared directory's manifest and checked
when training on it) and ``encode_batch(texts) -> list[uint32 arrays]``.

* ``bytes``: ids 0-255 are the UTF-8 bytes of the text, 256 is EOS and 257 BOS (vocab
  258). The trainer's raw text sources (``stdlib``, text files) use ids 0-255 only and no
  EOS, as they always have (vocab 256 is enough for them).
* A ``tokenizer.json``: the EOS/BOS tokens are the ``eos_token`` / ``bos_token`` of a
  ``tokenizer_config.json`` beside it when there is one, else the first of the usual names
  (:data:`EOS_NAMES`, :data:`BOS_NAMES`) among its added tokens. Text that happens to spell
  a special token (``<|endoftext|>`` in a document) is encoded as text, never as the
  special id, so the EOS id marks document ends only.

The hash is the SHA-256 of the file's JSON in canonical form (sorted keys, no spaces): a
copy, or the same tokenizer saved again with other formatting, hashes the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from .errors import DataError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eos|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]", "<|bos|>")
# What `epscale data train-tokenizer` writes.
TRAINED_EOS, TRAINED_BOS = "<|endoftext|>", "<|begin_of_text|>"
MIN_BPE_VOCAB = 256 + 2  # the byte alphabet and the two special tokens


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, EOS 256, BOS 257."""

    name = "bytes"
    kind = "bytes"
    vocab_size = 258
    eos_id = 256
    bos_id = 257
    hash = hashlib.sha256(b"epscale bytes tokenizer v1: utf-8 bytes, eos 256, bos 257").hexdigest()
    path: Path | None = None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for t in texts]

    def describe(self) -> str:
        return "bytes (UTF-8 bytes 0-255, EOS 256, BOS 257)"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from ``path`` (a tokenizer.json)."""

    kind = "huggingface"

    def __init__(self, path: Path, require_eos: bool = True):
        self.path = path
        self.name = str(path)
        try:
            text = path.read_text(encoding="utf-8")
            canonical = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
            self.tok = _HFTokenizer.from_str(text)
        except OSError as e:
            raise DataError(f"tokenizer '{path}' cannot be read: {e.strerror or e}") from e
        except Exception as e:
            raise DataError(f"tokenizer '{path}' is not a Hugging Face tokenizer.json ({e}); "
                            "give a tokenizer.json, a directory holding one, or 'bytes'") from e
        self.hash = hashlib.sha256(canonical.encode()).hexdigest()
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.tok.encode_special_tokens = True  # text spelling '<|endoftext|>' stays text
        names = _config_special_tokens(path.parent / CONFIG_FILE)
        self.eos_id = self._special(names.get("eos_token"), EOS_NAMES, vocab)
        self.bos_id = self._special(names.get("bos_token"), BOS_NAMES, vocab)
        if require_eos and self.eos_id is None:
            raise DataError(
                f"tokenizer '{path}' has no end-of-document token (none of {', '.join(EOS_NAMES)} "
                f"among its tokens, and no eos_token in a {CONFIG_FILE} beside it); add one "
                f"(e.g. as eos_token in {path.parent / CONFIG_FILE}) or train one with "
                "'epscale data train-tokenizer'")

    @staticmethod
    def _special(configured: str | None, names: tuple[str, ...], vocab: dict) -> int | None:
        for name in ((configured,) if configured else ()) + names:
            if name in vocab:
                return int(vocab[name])
        return None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def describe(self) -> str:
        special = f"EOS {self.eos_id}" + (f", BOS {self.bos_id}" if self.bos_id is not None else "")
        return f"{self.path} ({self.vocab_size:,} ids, {special})"


def _config_special_tokens(path: Path) -> dict[str, str]:
    """``eos_token`` / ``bos_token`` of a tokenizer_config.json (a string or {content: ...})."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"tokenizer config '{path}' cannot be read as JSON: {e}") from e
    out = {}
    for key in ("eos_token", "bos_token"):
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


Tokenizer = ByteTokenizer | HFTokenizer


def tokenizer_file(spec: str | Path) -> Path:
    """The tokenizer.json that ``spec`` (a file or a directory holding one) names."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
        if not path.is_file():
            raise DataError(f"tokenizer directory '{path.parent}' holds no {TOKENIZER_FILE}; give "
                            "a tokenizer.json, a directory holding one, or 'bytes'")
    elif not path.exists():
        raise DataError(f"tokenizer '{path}' does not exist; give a tokenizer.json, a directory "
                        "holding one (e.g. from 'epscale data train-tokenizer'), or 'bytes'")
    return path


def load_tokenizer(spec: str | Path, require_eos: bool = True) -> Tokenizer:
    """``'bytes'`` or a tokenizer.json / a directory holding one (see the module docstring)."""
    if str(spec) == "bytes":
        return ByteTokenizer()
    return HFTokenizer(tokenizer_file(spec), require_eos=require_eos)


def check_vocab(tok: Tokenizer, vocab_size: int, key: str = "data.tokenizer") -> None:
    """A clear error when the model's embedding cannot hold every id of ``tok``."""
    if tok.vocab_size > vocab_size:
        raise DataError(f"{key} '{tok.name}' has {tok.vocab_size:,} token ids but model.vocab_size "
                        f"is {vocab_size:,}; set model.vocab_size={_round_up(tok.vocab_size)} "
                        f"(at least {tok.vocab_size:,})")


def _round_up(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def copy_tokenizer(tok: Tokenizer, out_dir: Path) -> str | None:
    """Copy ``tok``'s files into ``out_dir`` (a prepared dataset keeps its tokenizer) and
    return the copy's file name (None for ``bytes``)."""
    if tok.path is None:  # bytes: no file, and no stale copy of another tokenizer
        for name in (TOKENIZER_FILE, CONFIG_FILE):
            (out_dir / name).unlink(missing_ok=True)
        return None
    for name in (TOKENIZER_FILE, CONFIG_FILE):
        src = tok.path if name == TOKENIZER_FILE else tok.path.parent / CONFIG_FILE
        dst = out_dir / name
        if src.is_file() and src.resolve() != dst.resolve():
            tmp = dst.with_name(dst.name + ".tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
    return TOKENIZER_FILE


@dataclass
class TrainedTokenizer:
    path: Path
    vocab_size: int
    eos_id: int
    bos_id: int
    documents: int
    text_bytes: int
    seconds: float


def train_bpe(documents: Iterable[str], vocab_size: int, out_dir: str | Path,
              min_frequency: int = 2) -> TrainedTokenizer:
    """Train a byte-level BPE (GPT-2 pre-tokenization, the 256 byte symbols, then merges up
    to ``vocab_size`` ids) on ``documents`` and write ``out_dir/tokenizer.json`` plus a
    ``tokenizer_config.json`` naming its EOS (``<|endoftext|>``, id 0) and BOS
    (``<|begin_of_text|>``, id 1). The same documents give the same file."""
    if vocab_size < MIN_BPE_VOCAB:
        raise DataError(f"--vocab {vocab_size} is too small: a byte-level BPE needs at least "
                        f"{MIN_BPE_VOCAB} ids (256 bytes and the EOS/BOS tokens)")
    if vocab_size > 1 << 32:
        raise DataError(f"--vocab {vocab_size} does not fit uint32 token ids")
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise DataError(f"--out '{out}' is a file; name a directory for the tokenizer")
    counted = {"docs": 0, "bytes": 0}

    def counting():
        for text in documents:
            counted["docs"] += 1
            counted["bytes"] += len(text)
            yield text

    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[TRAINED_EOS, TRAINED_BOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t0 = time.perf_counter()
    tok.train_from_iterator(counting(), trainer=trainer)
    seconds = time.perf_counter() - t0
    if counted["docs"] == 0:
        raise DataError("the inputs hold no text to train a tokenizer on")
    out.mkdir(parents=True, exist_ok=True)
    path = out / TOKENIZER_FILE
    tmp = path.with_name(path.name + ".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": TRAINED_EOS,
              "bos_token": TRAINED_BOS, "model_max_length": 1 << 30}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return TrainedTokenizer(path, tok.get_vocab_size(with_added_tokens=True),
                            tok.token_to_id(TRAINED_EOS), tok.token_to_id(TRAINED_BOS),
                            counted["docs"], counted["bytes"], seconds)
