"""Reading documents from the inputs of ``epscale data prepare`` / ``train-tokenizer``.

An input is a text file (one document), a ``.jsonl`` / ``.jsonl.gz`` file (one document
per line: the string in field ``text_field``), a Parquet file (one document per row: the
string in column ``text_field``) or a folder of any of these (files sorted by relative
path; hidden files and folders skipped; a text file with a NUL byte in its first 8 KiB is
skipped as not text and counted).

The work is cut into :class:`Task` s that a worker process reads and tokenizes on its own,
in a fixed order that depends only on the inputs (their paths and sizes) and
``chunk_bytes``, never on the number of workers: consecutive small text files together,
an uncompressed ``.jsonl`` by byte ranges (a task takes the lines that *start* in its
range), a ``.jsonl.gz`` whole (gzip cannot seek: split a big one into several files to
read it in parallel), a Parquet file by row groups.

Text must be UTF-8. Invalid bytes are replaced by U+FFFD and the documents counted, or,
with ``strict``, are an error naming the file and the byte offset.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DataError
from .text import list_text_files, read_text_file

JSONL_SUFFIXES = (".jsonl", ".ndjson")
GZ_SUFFIXES = (".jsonl.gz", ".ndjson.gz")
PARQUET_SUFFIXES = (".parquet", ".pq")
TEXT_FILES_PER_TASK = 1024


@dataclass(frozen=True)
class InputFile:
    path: Path
    kind: str  # 'text' | 'jsonl' | 'jsonl.gz' | 'parquet'
    size: int
    mtime_ns: int
    given: bool  # named on the command line (an empty or binary one is an error)
    resolved: Path  # the absolute path, symlinks resolved (what the manifest records)


@dataclass(frozen=True)
class Task:
    """One worker's share: ``paths`` (several text files, or one file) and, for a
    ``jsonl`` byte range or a Parquet row group, ``start``/``stop``. ``weight``: its input
    bytes, for the progress bar."""

    index: int
    kind: str
    paths: tuple[str, ...]
    start: int = 0
    stop: int = -1
    weight: int = 0
    given: bool = False


@dataclass
class ReadStats:
    """What reading found besides documents (summed over tasks)."""

    documents: int = 0
    empty: int = 0           # documents with no text, skipped
    invalid_utf8: int = 0    # documents whose invalid UTF-8 bytes were replaced
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, why) not read

    def add(self, other: ReadStats) -> None:
        self.documents += other.documents
        self.empty += other.empty
        self.invalid_utf8 += other.invalid_utf8
        self.skipped += other.skipped


def input_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(GZ_SUFFIXES):
        return "jsonl.gz"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def collect_inputs(paths: list[str | Path]) -> list[InputFile]:
    """Every file the inputs name, in order (a folder's files sorted), each once."""
    if not paths:
        raise DataError("no inputs given; name text files, folders, .jsonl(.gz) or .parquet files")
    out, seen = [], set()
    for spec in paths:
        path = Path(spec).expanduser()
        if not path.exists():
            raise DataError(f"input '{path}' does not exist")
        if path.is_dir():
            files = list_text_files(path)
            if not files:
                raise DataError(f"input folder '{path}' holds no files")
            given = False
        else:
            files, given = [path], True
        for f in files:
            key = f.resolve()
            if key in seen:
                continue
            seen.add(key)
            try:
                st = f.stat()
            except OSError as e:
                raise DataError(f"input '{f}' cannot be read: {e.strerror or e}") from e
            if given and st.st_size == 0:
                raise DataError(f"input '{f}' is empty; remove it from the inputs")
            out.append(InputFile(f, input_kind(f), st.st_size, st.st_mtime_ns, given, key))
    return out


def plan_tasks(inputs: list[InputFile], chunk_bytes: int, text_field: str) -> list[Task]:
    """The inputs cut into tasks (see the module docstring); Parquet files are opened for
    their row-group layout (metadata only) and their column checked."""
    tasks: list[Task] = []
    group: list[InputFile] = []

    def flush_group():
        if group:
            tasks.append(Task(len(tasks), "text", tuple(str(f.path) for f in group),
                              weight=sum(f.size for f in group), given=any(f.given for f in group)))
            group.clear()

    for f in inputs:
        if f.kind == "text":
            group.append(f)
            if sum(g.size for g in group) >= chunk_bytes or len(group) >= TEXT_FILES_PER_TASK:
                flush_group()
            continue
        flush_group()
        if f.kind == "jsonl":
            for start in range(0, max(f.size, 1), chunk_bytes):
                stop = min(start + chunk_bytes, f.size)
                tasks.append(Task(len(tasks), "jsonl", (str(f.path),), start, stop, stop - start))
        elif f.kind == "jsonl.gz":
            tasks.append(Task(len(tasks), "jsonl.gz", (str(f.path),), weight=f.size))
        else:
            pf = _parquet_file(f.path)
            _parquet_column(pf, f.path, text_field)
            meta = pf.metadata
            if meta.num_rows == 0:
                raise DataError(f"input '{f.path}' is a Parquet file with no rows")
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                tasks.append(Task(len(tasks), "parquet", (str(f.path),), g, g + 1,
                                  rg.total_byte_size))
    flush_group()
    return tasks


# --------------------------------------------------------------------------------------
# Reading one task's documents
# --------------------------------------------------------------------------------------


def read_task(task: Task, text_field: str, strict: bool,
              stats: ReadStats) -> Iterator[str]:
    """The task's documents in order (empty ones skipped and counted in ``stats``)."""
    if task.kind == "text":
        docs = _text_files(task, stats, strict)
    elif task.kind == "jsonl":
        docs = _jsonl_range(Path(task.paths[0]), task.start, task.stop, text_field, strict, stats)
    elif task.kind == "jsonl.gz":
        docs = _jsonl_gz(Path(task.paths[0]), text_field, strict, stats)
    else:
        docs = _parquet_rows(Path(task.paths[0]), task.start, text_field, strict, stats)
    for text in docs:
        if text:
            stats.documents += 1
            yield text
        else:
            stats.empty += 1


def _decode(data: bytes, where: str, strict: bool, stats: ReadStats, base: int = 0) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if strict:
            raise DataError(f"{where} is not valid UTF-8 (byte {base + e.start}: "
                            f"{data[e.start:e.start + 4]!r}); re-encode it as UTF-8, or drop "
                            "--strict to replace invalid bytes with U+FFFD (counted)") from None
        stats.invalid_utf8 += 1
        return data.decode("utf-8", errors="replace")


def _text_files(task: Task, stats: ReadStats, strict: bool) -> Iterator[str]:
    for name in task.paths:
        path = Path(name)
        data, reason = read_text_file(path, "input")  # a binary file: its first 8 KiB only
        if reason is not None:
            if task.given and len(task.paths) == 1:
                raise DataError(f"input '{path}' is not text ({reason}); give text files, "
                                ".jsonl(.gz) or .parquet")
            stats.skipped.append((name, reason))
            continue
        yield _decode(data, f"input '{path}'", strict, stats)


def _jsonl_doc(line: bytes, path: Path, offset: int, text_field: str, strict: bool,
               stats: ReadStats) -> str | None:
    if not line.strip():
        return None
    where = lambda: f"input '{path}' line {_line_number(path, offset)}"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        text = _decode(line, where(), strict, stats, 0)
    try:
        record = json.loads(text)
    except ValueError as e:
        raise DataError(f"{where()} is not valid JSON ({e}); each line of a .jsonl file must "
                        "be one JSON object") from None
    if not isinstance(record, dict):
        raise DataError(f"{where()} is a JSON {type(record).__name__}, not an object with a "
                        f"'{text_field}' field")
    if text_field not in record:
        keys = ", ".join(list(record)[:12]) or "none"
        raise DataError(f"{where()} has no field '{text_field}' (its fields: {keys}); choose "
                        "the field that holds the text with --text-field")
    value = record[text_field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where()}: field '{text_field}' is a {type(value).__name__}, not a "
                        "string; choose the field that holds the text with --text-field")
    return value


def _line_number(path: Path, offset: int) -> int:
    """1-based line number of byte ``offset`` in an uncompressed (or gzip) file: counted
    only when an error is reported."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    count, done = 1, 0
    with opener(path, "rb") as f:
        while done < offset:
            block = f.read(min(1 << 20, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count


def _jsonl_range(path: Path, start: int, stop: int, text_field: str, strict: bool,
                 stats: ReadStats) -> Iterator[str]:
    """The lines of ``path`` that start at a byte offset in [start, stop)."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise DataError(f"input '{path}' cannot be read: {e.strerror or e}") from e
    with f:
        pos = start
        if start > 0:
            f.seek(start - 1)
            pos = start - 1 + len(f.readline())  # the line that holds byte start-1 is not ours
        while pos < stop:
            line = f.readline()
            if not line:
                break
            doc = _jsonl_doc(line, path, pos, text_field, strict, stats)
            pos += len(line)
            if doc is not None:
                yield doc


def _jsonl_gz(path: Path, text_field: str, strict: bool, stats: ReadStats) -> Iterator[str]:
    pos = 0
    try:
        with gzip.open(path, "rb") as f:
            for line in f:
                doc = _jsonl_doc(line, path, pos, text_field, strict, stats)
                pos += len(line)
                if doc is not None:
                    yield doc
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"input '{path}' cannot be read as gzip ({e}); is it a complete "
                        ".jsonl.gz file?") from e
    if pos == 0:
        raise DataError(f"input '{path}' is empty once decompressed")


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq  # an optional extra: only Parquet inputs need it
    except ImportError as e:
        raise DataError(f"input '{path}' is Parquet, which needs pyarrow: pip install "
                        "'epscale[parquet]'") from e
    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"input '{path}' cannot be read as Parquet ({e})") from e


def _parquet_column(pf, path: Path, text_field: str) -> None:
    names = pf.schema_arrow.names
    if text_field not in names:
        raise DataError(f"input '{path}' has no column '{text_field}' (its columns: "
                        f"{', '.join(names[:12])}); choose the column that holds the text "
                        "with --text-field")
    kind = str(pf.schema_arrow.field(text_field).type)
    if kind not in ("string", "large_string", "binary", "large_binary", "string_view"):
        raise DataError(f"input '{path}': column '{text_field}' holds {kind}, not text; choose "
                        "the column that holds the text with --text-field")


def _parquet_rows(path: Path, group: int, text_field: str, strict: bool,
                  stats: ReadStats) -> Iterator[str]:
    pf = _parquet_file(path)
    try:
        column = pf.read_row_group(group, columns=[text_field]).column(0)
    except Exception as e:
        raise DataError(f"input '{path}' row group {group} cannot be read ({e})") from e
    for value in column.to_pylist():
        if value is None:
            yield ""
        elif isinstance(value, bytes):
            yield _decode(value, f"input '{path}' (row group {group})", strict, stats)
        else:
            yield value


def iter_documents(paths: list[str | Path], text_field: str = "text", strict: bool = False,
                   stats: ReadStats | None = None,
                   chunk_bytes: int = 16 << 20) -> Iterator[str]:
    """Every document of the inputs in order (for training a tokenizer)."""
    stats = stats if stats is not None else ReadStats()
    for task in plan_tasks(collect_inputs(paths), chunk_bytes, text_field):
        yield from read_task(task, text_field, strict, stats)
