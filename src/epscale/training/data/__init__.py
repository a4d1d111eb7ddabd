"""Training data: tokenizers, ``epscale data prepare`` (text -> token shards), the sources a
run reads (byte-level text, ``.bin`` memmaps, prepared shards streamed from disk, mixtures
of them by weight) and the deterministic, resumable sampler.

Modules: :mod:`.tokenizer` (``bytes`` or a Hugging Face tokenizer.json; training a
byte-level BPE), :mod:`.readers` (text, .jsonl(.gz), Parquet inputs cut into tasks),
:mod:`.prepare` (parallel tokenization into shards, resumable, byte-identical),
:mod:`.shards` (the manifest, its checks, memory-mapped shards), :mod:`.text` (byte-level
text sources, the default ``stdlib``), :mod:`.sources` (``data.source`` / ``data.sources``
opened and checked), :mod:`.sampler` (windows, the mixture draw, the per-rank loader).

The config keys (``data.*``, :class:`epscale.config.DataConfig`):

* ``source``: ``stdlib`` (default), a text file or folder, a ``.bin`` token file (or a
  folder with ``train.bin``/``val.bin``), or a directory from ``epscale data prepare``.
* ``sources``: ``[{path: DIR, weight: 0.7}, {path: DIR2, weight: 0.3}]`` mixes sources by
  weight (instead of ``source``).
* ``tokenizer``: ``bytes`` (default) or the tokenizer.json (or a directory holding one)
  the prepared data was made with; its vocabulary must fit ``model.vocab_size``.
* ``doc_masking``: attention stops at document ends and the loss skips the EOS -> next
  document join (prepared data only; see :class:`epscale.model.Transformer`).
* ``verify_shards``: check every prepared shard's SHA-256 before launch (reads all data).
* ``dtype`` (of ``.bin`` files), ``val_fraction`` (of raw sources), ``seed``.
"""

from .errors import BYTE_VOCAB, DataError
from .sampler import (DataLoader, FeistelPermutation, WindowSampler, byte_unigram_entropy,
                      unigram_entropy)
from .shards import ShardedTokens, open_prepared, read_manifest, verify_shards
from .sources import Mixture, Splits, load_data, load_splits, open_source
from .text import TEXT_PROBE_BYTES, _is_val, binary_reason, list_text_files, stdlib_root
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

__all__ = [
    "BYTE_VOCAB", "TEXT_PROBE_BYTES", "ByteTokenizer", "DataError", "DataLoader",
    "FeistelPermutation", "HFTokenizer", "Mixture", "ShardedTokens", "Splits", "WindowSampler",
    "_is_val", "binary_reason", "byte_unigram_entropy", "list_text_files", "load_data",
    "load_splits", "load_tokenizer", "open_prepared", "open_source", "read_manifest",
    "stdlib_root", "train_bpe", "unigram_entropy", "verify_shards",
]
