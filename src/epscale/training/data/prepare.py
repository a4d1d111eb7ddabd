"""``epscale data prepare``: text -> shards of token ids that the trainer streams from disk.

    prepare(["corpus/", "web.jsonl.gz"], tokenizer="tok/", out="data/prep", workers=8)

What it writes in ``out`` (the layout :mod:`epscale.training.data.shards` reads):

* ``train-00000.bin``, ``train-00001.bin``, ... and ``val-00000.bin``, ...: the token ids of
  whole documents, EOS after each, as little-endian ``uint16`` (vocab <= 65,536) or
  ``uint32``. A document goes to validation when the hash of its text falls below
  ``val_fraction`` (so a duplicate lands in the same split as its twin).
* ``train-00000.idx`` ...: each document's end offset in its shard (uint64, EOS included).
* ``tokenizer.json`` (and ``tokenizer_config.json``): a copy of the tokenizer.
* ``manifest.json``, written last: the tokenizer (hash, vocab size, EOS/BOS ids), the
  dtype, token and document counts per split, every shard's size and SHA-256, the source
  files and the settings. A directory without it is not a finished dataset.

How: the inputs are cut into tasks (:mod:`epscale.training.data.readers`) that ``workers``
processes read and tokenize; the results are taken in task order, so the shards are the
same bytes at any worker count and on every run of the same inputs with the same
tokenizer and settings. A shard closes at the first task boundary after it reaches
``shard_tokens`` tokens; each close (a *commit*) writes the train and validation shards
collected so far to temporary files, fsyncs and renames them, then records the commit in
``out/.prepare/state.json``. An interrupted run, started again with the same command,
checks the committed shards (every size; the SHA-256 of the last commit's), removes
anything written after the last commit and goes on from the task after it: the result is
the bytes an uninterrupted run writes.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from .commits import Buffer, Output
from .errors import DataError
from .readers import InputFile, ReadStats, Task, collect_inputs, plan_tasks, read_task
from .shards import FORMAT, MANIFEST, VERSION, shard_dtype
from .tokenizer import Tokenizer, copy_tokenizer, load_tokenizer

DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_CHUNK_BYTES = 4 << 20
ENCODE_BATCH = 512  # documents per encode_batch call in a worker


@dataclass
class PrepareResult:
    out: Path
    manifest: dict[str, Any]
    finished: bool          # False when stopped early (stop_after_commits)
    up_to_date: bool        # the directory already held this dataset: nothing was done
    resumed_commits: int    # commits kept from an interrupted run
    seconds: float
    tokens_this_run: int
    workers: int


@dataclass
class _Settings:
    tokenizer: str
    text_field: str
    val_fraction: float
    shard_tokens: int
    chunk_bytes: int
    strict: bool


# --------------------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(settings: _Settings, dtype: str, tok: Tokenizer | None = None) -> None:
    """Each worker process: one tokenizer, and single-threaded encoding (the processes
    are the parallelism; a Rust thread pool per process would oversubscribe the cores)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if tok is None:  # a pool process: Ctrl-C is the parent's to handle (it stops the pool)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        tok = load_tokenizer(settings.tokenizer)
    _WORKER.update(tok=tok, settings=settings, dtype=dtype)


@dataclass
class _TaskResult:
    index: int
    tokens: dict[str, np.ndarray]    # split -> ids of its documents, EOS after each
    doc_lens: dict[str, np.ndarray]  # split -> each document's length (EOS included)
    stats: ReadStats
    weight: int


def _is_val(text: str, val_fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < val_fraction * 2.0 ** 64


def _encode(tok: Tokenizer, texts: list[str], stats: ReadStats) -> list[np.ndarray]:
    try:
        return tok.encode_batch(texts)
    except (UnicodeEncodeError, TypeError):
        # A JSON string can hold lone surrogates (\ud800), which are not text: replace them.
        fixed = []
        for t in texts:
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                stats.invalid_utf8 += 1
                t = t.encode("utf-8", "replace").decode("utf-8")
            fixed.append(t)
        return tok.encode_batch(fixed)


def _run_task(task: Task) -> _TaskResult:
    tok, s, dtype = _WORKER["tok"], _WORKER["settings"], _WORKER["dtype"]
    stats = ReadStats()
    docs = list(read_task(task, s.text_field, s.strict, stats))
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    lens: dict[str, list[int]] = {"train": [], "val": []}
    eos = np.array([tok.eos_id], dtype=np.uint32)
    for i in range(0, len(docs), ENCODE_BATCH):
        batch = docs[i:i + ENCODE_BATCH]
        for text, ids in zip(batch, _encode(tok, batch, stats)):
            split = "val" if _is_val(text, s.val_fraction) else "train"
            parts[split] += (ids, eos)
            lens[split].append(ids.size + 1)
    tokens = {k: (np.concatenate(v).astype(dtype) if v else np.zeros(0, dtype))
              for k, v in parts.items()}
    return _TaskResult(task.index, tokens, {k: np.asarray(v, np.int64) for k, v in lens.items()},
                       stats, task.weight)


def _fingerprint(settings: _Settings, tok: Tokenizer, inputs: list[InputFile]) -> str:
    blob = {"format": FORMAT, "version": VERSION, "tokenizer_hash": tok.hash,
            **{k: v for k, v in asdict(settings).items() if k != "tokenizer"},
            "inputs": [[str(f.resolved), f.size, f.mtime_ns] for f in inputs]}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


class _Progress:
    """A rich bar (input bytes done, documents, tokens, tokens/s, ETA) on a terminal; a
    plain line every ~10% otherwise; nothing when ``enabled`` is False."""

    def __init__(self, enabled: bool, total: int, done: int, console: Console):
        self.enabled, self.total, self.console = enabled, max(total, 1), console
        self.t0 = time.perf_counter()
        self.bar = None
        self._next_line = 0.1
        if enabled and console.is_terminal:
            self.bar = Progress(TextColumn("[bold]prepare[/]"), BarColumn(), TaskProgressColumn(),
                                TextColumn("{task.fields[docs]} docs  {task.fields[toks]} tokens  "
                                           "{task.fields[rate]} tok/s"),
                                TextColumn("ETA"), TimeRemainingColumn(), console=console)
            self.task = self.bar.add_task("prepare", total=self.total, completed=done,
                                          docs="0", toks="0", rate="-")
            self.bar.start()

    def update(self, done: int, docs: int, tokens_total: int, tokens_run: int) -> None:
        if not self.enabled:
            return
        rate = tokens_run / max(time.perf_counter() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.update(self.task, completed=done, docs=f"{docs:,}", toks=f"{tokens_total:,}",
                            rate=f"{rate:,.0f}")
        elif done / self.total >= self._next_line:
            self._next_line = done / self.total + 0.1
            self.console.print(f"prepare: {100 * done / self.total:3.0f}%  {docs:,} docs  "
                               f"{tokens_total:,} tokens  {rate:,.0f} tok/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _inline_pool(settings: _Settings, dtype: str, tok: Tokenizer):
    """``workers=1``: the tasks run in this process, single-threaded like a worker."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    _init_worker(settings, dtype, tok)

    def restore():
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old
        _WORKER.clear()

    return restore


def prepare(inputs: list[str | Path], tokenizer: str | Path, out: str | Path, *,
            workers: int = 1, text_field: str = "text", val_fraction: float = 0.01,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            strict: bool = False, overwrite: bool = False, progress: bool = True,
            console: Console | None = None,
            stop_after_commits: int | None = None) -> PrepareResult:
    """Tokenize ``inputs`` into shards in ``out`` (see the module docstring).

    Raises DataError naming the file for an input that is missing, empty, unreadable or
    not text, invalid UTF-8 under ``strict``, a JSON line without ``text_field``, a
    tokenizer without an EOS token, an ``out`` that holds something else, and inputs
    with no documents. ``stop_after_commits`` stops after that many commits as if
    interrupted (for tests).
    """
    if workers < 1:
        raise DataError(f"--workers {workers}: must be >= 1")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if shard_tokens < 1 or chunk_bytes < 1:
        raise DataError("--shard-tokens and the chunk size must be positive")
    console = console or Console(file=sys.stdout, highlight=False, soft_wrap=True)
    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer)
    dtype = shard_dtype(tok.vocab_size)
    out_dir = Path(out).expanduser().resolve()
    files = [f for f in collect_inputs(inputs)  # never our own output, if it lies in an input
             if out_dir not in f.resolved.parents]
    tasks = plan_tasks(files, chunk_bytes, text_field)
    settings = _Settings(str(tokenizer), text_field, float(val_fraction), int(shard_tokens),
                         int(chunk_bytes), bool(strict))
    output = Output(Path(out).expanduser(), _fingerprint(settings, tok, files), dtype)
    mode = output.open(overwrite)
    if mode == "done":
        manifest = json.loads((output.out / MANIFEST).read_text())
        return PrepareResult(output.out, manifest, True, True, 0, time.perf_counter() - t0, 0, 0)
    resumed = len(output.commits)
    start = output.next_task
    stats = output.stats()
    totals = {s: sum(e["tokens"] for e in output.shards[s]) for s in ("train", "val")}
    done_weight = sum(t.weight for t in tasks[:start])
    pool, restore, bar = None, None, None
    try:
        if workers == 1:
            restore = _inline_pool(settings, dtype, tok)
            results = (_run_task(t) for t in tasks[start:])
        else:
            pool = _start_pool(workers, settings, dtype)  # before the progress bar's thread
            results = _ordered(pool, tasks[start:], 2 * workers)
        bar = _Progress(progress, sum(t.weight for t in tasks), done_weight, console)
        finished, tokens_run = _consume(results, output, bar, stats, totals, done_weight,
                                        shard_tokens, len(tasks), stop_after_commits)
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
        if restore is not None:
            restore()
    if not finished:
        return PrepareResult(output.out, {}, False, False, resumed, time.perf_counter() - t0,
                             tokens_run, workers)
    if stats["documents"] == 0:
        raise DataError(_no_documents(files, stats))
    manifest = _manifest(output, tok, settings, files, stats, totals)
    output.finish(manifest)
    return PrepareResult(output.out, manifest, True, False, resumed, time.perf_counter() - t0,
                         tokens_run, workers)


def _consume(results, output: Output, bar: _Progress, stats: dict[str, Any],
             totals: dict[str, int], done_weight: int, shard_tokens: int, num_tasks: int,
             stop_after_commits: int | None) -> tuple[bool, int]:
    """Take the task results in order into the shard buffers, committing a shard pair at
    the first task boundary after the train buffer reaches ``shard_tokens``; returns
    (finished, tokens written)."""
    buffers = {"train": Buffer(), "val": Buffer()}
    tokens_run, commits_run = 0, 0

    def commit(next_task: int) -> int:
        for split in ("train", "val"):
            totals[split] += buffers[split].tokens
        return output.commit(buffers, next_task, dict(stats))

    for res in results:
        for split in ("train", "val"):
            buffers[split].add(res.tokens[split], res.doc_lens[split])
        _add_stats(stats, res.stats)
        done_weight += res.weight
        pending = sum(b.tokens for b in buffers.values())
        bar.update(done_weight, stats["documents"], sum(totals.values()) + pending,
                   tokens_run + pending)
        if buffers["train"].tokens >= shard_tokens:
            tokens_run += commit(res.index + 1)
            commits_run += 1
            if stop_after_commits is not None and commits_run >= stop_after_commits:
                return False, tokens_run
    if any(b.tokens for b in buffers.values()):
        tokens_run += commit(num_tasks)
    return True, tokens_run


def _start_pool(workers: int, settings: _Settings, dtype: str):
    """``workers`` processes (forked where the platform can), each with its tokenizer.
    TOKENIZERS_PARALLELISM is set while they start: the library then neither warns about
    a fork after its thread pool ran nor starts one in the children."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return mp.get_context(method).Pool(workers, initializer=_init_worker,
                                           initargs=(settings, dtype))
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _ordered(pool, tasks: list[Task], window: int):
    """Results of ``tasks`` in order, with at most ``window`` in flight (memory stays
    bounded however far the workers could run ahead)."""
    pending: deque = deque()
    it = iter(tasks)
    for task in it:
        pending.append(pool.apply_async(_run_task, (task,)))
        if len(pending) >= window:
            break
    while pending:
        res = pending.popleft().get()
        nxt = next(it, None)
        if nxt is not None:
            pending.append(pool.apply_async(_run_task, (nxt,)))
        yield res


def _add_stats(stats: dict[str, Any], s: ReadStats) -> None:
    stats["documents"] += s.documents
    stats["empty"] += s.empty
    stats["invalid_utf8"] += s.invalid_utf8
    stats["skipped_count"] += len(s.skipped)
    room = 20 - len(stats["skipped"])
    stats["skipped"] = stats["skipped"] + [list(x) for x in s.skipped[:max(room, 0)]]


def _no_documents(files: list[InputFile], stats: dict[str, Any]) -> str:
    what = f"{len(files)} file(s)"
    notes = []
    if stats["skipped_count"]:
        name, why = stats["skipped"][0]
        notes.append(f"{stats['skipped_count']} not text, e.g. {name}: {why}")
    if stats["empty"]:
        notes.append(f"{stats['empty']} empty document(s)")
    extra = f" ({'; '.join(notes)})" if notes else ""
    return (f"the inputs ({what}{extra}) hold no documents; give text files, folders, "
            ".jsonl(.gz) or .parquet files with text")


def _manifest(output: Output, tok: Tokenizer, settings: _Settings, files: list[InputFile],
              stats: dict[str, Any], totals: dict[str, int]) -> dict[str, Any]:
    copied = copy_tokenizer(tok, output.out)
    return {
        "format": FORMAT, "version": VERSION, "fingerprint": output.fingerprint,
        "tokenizer": {"kind": tok.kind, "file": copied,
                      "name": str(tok.path.resolve()) if tok.path else tok.name, "hash": tok.hash,
                      "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id},
        "dtype": output.dtype,
        "tokens": totals,
        "documents": {s: sum(e["documents"] for e in output.shards[s]) for s in ("train", "val")},
        "splits": output.shards,
        "settings": {k: v for k, v in asdict(settings).items() if k != "tokenizer"},
        "read": {"empty_documents": stats["empty"], "invalid_utf8_documents": stats["invalid_utf8"],
                 "files_not_text": stats["skipped_count"],
                 "files_not_text_examples": stats["skipped"]},
        "sources": [{"path": str(f.resolved), "kind": f.kind, "bytes": f.size} for f in files],
    }


def summary_lines(result: PrepareResult) -> list[str]:
    """What ``epscale data prepare`` prints when it is done."""
    m = result.manifest
    tok, docs, toks = m["tokenizer"], m["documents"], m["tokens"]
    if result.up_to_date:
        return [(f"{result.out} is up to date ({docs['train'] + docs['val']:,} documents, "
                 f"{toks['train'] + toks['val']:,} tokens); nothing to do (--overwrite redoes "
                 "it)")]
    rate = result.tokens_this_run / max(result.seconds, 1e-9)
    nshards = {s: len(m["splits"][s]) for s in ("train", "val")}
    lines = [
        (f"prepared {docs['train'] + docs['val']:,} documents ({docs['train']:,} train / "
         f"{docs['val']:,} validation) into {toks['train'] + toks['val']:,} tokens "
         f"({m['dtype']}, vocab {tok['vocab_size']:,}, EOS {tok['eos_id']} after each "
         f"document) in {result.seconds:.1f} s ({rate:,.0f} tokens/s, {result.workers} "
         "worker(s))"),
        (f"  {result.out}: {nshards['train']} train + {nshards['val']} validation shard(s), "
         f"manifest.json, {len(m['sources'])} source file(s)"),
    ]
    if result.resumed_commits:
        lines.append(f"  resumed after {result.resumed_commits} commit(s) of an interrupted run")
    r = m["read"]
    notes = []
    if r["invalid_utf8_documents"]:
        notes.append(f"{r['invalid_utf8_documents']:,} document(s) with invalid UTF-8 "
                     "(replaced by U+FFFD; --strict makes it an error)")
    if r["files_not_text"]:
        name, why = r["files_not_text_examples"][0]
        notes.append(f"{r['files_not_text']:,} file(s) skipped as not text, e.g. {name} ({why})")
    if r["empty_documents"]:
        notes.append(f"{r['empty_documents']:,} empty document(s) skipped")
    if docs["val"] == 0:
        notes.append("no validation documents: training needs some; prepare again with a "
                     "larger --val-fraction")
    lines += [f"  note: {n}" for n in notes]
    return lines

