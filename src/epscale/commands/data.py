"""``epscale data``: tokenizers and prepared token shards for pretraining.

    epscale data train-tokenizer INPUT... --vocab N --out DIR [--text-field text]
    epscale data prepare INPUT... --tokenizer T --out DIR [--workers N] [--text-field text]
    epscale data verify DIR

INPUT: text files, folders, ``.jsonl`` / ``.jsonl.gz`` (the string in ``--text-field``) and
Parquet files (the column ``--text-field``). ``prepare`` writes shards of token ids, a
document index and manifest.json into DIR; train on it with ``data.source=DIR
data.tokenizer=T``. See :mod:`epscale.training.data.prepare`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from rich.console import Console

from ..training.data import readers
from ..training.data.prepare import (DEFAULT_CHUNK_BYTES, DEFAULT_SHARD_TOKENS, prepare,
                                     summary_lines)
from ..training.data.shards import verify_shards
from ..training.data.tokenizer import train_bpe


def _inputs(p) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files, folders, .jsonl/.jsonl.gz or .parquet files")
    p.add_argument("--text-field", default="text",
                   help="the JSON field / Parquet column that holds the text (default: text)")
    p.add_argument("--strict", action="store_true",
                   help="invalid UTF-8 is an error (default: replaced by U+FFFD and counted)")


def configure_parser(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    tt = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on your text")
    _inputs(tt)
    tt.add_argument("--vocab", type=int, required=True, help="vocabulary size (ids), e.g. 32000")
    tt.add_argument("--out", required=True, help="directory for tokenizer.json")
    tt.add_argument("--min-frequency", type=int, default=2,
                    help="a merge needs at least this many occurrences (default 2)")
    pr = sub.add_parser("prepare", help="tokenize text into shards the trainer streams")
    _inputs(pr)
    pr.add_argument("--tokenizer", required=True,
                    help="'bytes', a tokenizer.json or a directory holding one")
    pr.add_argument("--out", required=True, help="output directory")
    pr.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="tokenizer processes (default: the cores, at most 8)")
    pr.add_argument("--val-fraction", type=float, default=0.01,
                    help="share of documents (by hash of their text) for validation (0.01)")
    pr.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                    help=f"tokens per shard, about (default {DEFAULT_SHARD_TOKENS:,})")
    pr.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                    help="input bytes per worker task (default 4 MiB)")
    pr.add_argument("--overwrite", action="store_true",
                    help="replace what --out holds (a finished or interrupted dataset)")
    pr.add_argument("--no-progress", action="store_true", help="no progress bar")
    vf = sub.add_parser("verify", help="check every shard of a prepared directory against "
                        "its manifest (SHA-256)")
    vf.add_argument("dir")


def run(args) -> int:
    console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    if args.action == "train-tokenizer":
        stats = readers.ReadStats()
        docs = readers.iter_documents(args.inputs, args.text_field, args.strict, stats)
        t = train_bpe(docs, args.vocab, args.out, min_frequency=args.min_frequency)
        console.print(f"trained a byte-level BPE tokenizer of {t.vocab_size:,} tokens on "
                      f"{t.documents:,} documents ({t.text_bytes / 1e6:.1f}M characters) in "
                      f"{t.seconds:.1f} s: EOS <|endoftext|> = {t.eos_id}, BOS "
                      f"<|begin_of_text|> = {t.bos_id}")
        console.print(f"  wrote {t.path} (and tokenizer_config.json); use it with: epscale "
                      f"data prepare ... --tokenizer {t.path.parent}")
        if t.vocab_size < args.vocab:
            console.print(f"  note: the text held merges for {t.vocab_size:,} tokens only, "
                          f"fewer than --vocab {args.vocab:,}")
        if stats.invalid_utf8:
            console.print(f"  note: {stats.invalid_utf8:,} document(s) with invalid UTF-8 "
                          "(replaced by U+FFFD)")
        return 0
    if args.action == "prepare":
        try:
            result = prepare(args.inputs, args.tokenizer, args.out, workers=args.workers,
                             text_field=args.text_field, val_fraction=args.val_fraction,
                             shard_tokens=args.shard_tokens, chunk_bytes=args.chunk_bytes,
                             strict=args.strict, overwrite=args.overwrite,
                             progress=not args.no_progress, console=console)
        except KeyboardInterrupt:
            console.print(f"interrupted: the shards committed so far are kept in {args.out}; "
                          "run the same command again to go on from there")
            return 130
        for line in summary_lines(result):
            console.print(line)
        tok = result.manifest["tokenizer"]
        where = f"{args.out}/{tok['file']}" if tok["file"] else "bytes"
        console.print(f"  train on it: epscale train data.source={args.out} "
                      f"data.tokenizer={where} model.vocab_size={-(-tok['vocab_size'] // 64) * 64}")
        return 0
    t0 = time.perf_counter()
    checked: list[str] = []
    manifest = verify_shards(Path(args.dir).expanduser(), report=checked.append)
    toks = manifest["tokens"]
    console.print(f"{args.dir}: {len(checked)} files match manifest.json ({toks['train']:,} "
                  f"train / {toks['val']:,} validation tokens, {manifest['dtype']}, tokenizer "
                  f"{manifest['tokenizer']['name']}) in {time.perf_counter() - t0:.1f} s")
    return 0

