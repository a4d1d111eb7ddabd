"""Data pipeline: ``epscale data prepare`` throughput against the tokenizer's own
batch-encode loop, and the data loader's share of the training step time.

    python benchmarks/data.py [--vocab 8192] [--steps 40] [--nproc 2] [--json PATH]

Corpus: the Python standard library's ``*.py`` sources (the demo's text, ~30 MB), a
byte-level BPE of ``--vocab`` ids trained on it first (its time is printed too).

Prepare, side by side in one run, tokens/s of wall time:
* baseline: ``tokenizer.encode_batch_fast`` over the documents already in memory, in
  batches of 512 - once single-threaded (``TOKENIZERS_PARALLELISM=false``), once on the
  library's own thread pool (all cores). No reading, no writing: the best case.
* ``prepare(workers=1)`` and ``prepare(workers=2)``: files read, split, tokenized, EOS
  appended, shards written (fsync, SHA-256) and the manifest, from a cold start.
Judged by prepare(1) / baseline(1 thread) and prepare(N) / baseline(all threads); the
two outputs are also checked to be the same bytes.

Loader share: ``epscale train --config configs/tiny.yaml --nproc N`` on the prepared
directory (and, for comparison, on the byte-level stdlib default) for ``--steps`` steps;
the trainer's own "data" timer (drawing the batch: the mixture draw, the windows read
from the memory-mapped shards, the id check) over the step time, median of the steps
after the first third. Target: under 1%. Also the loader alone: microseconds per
micro-batch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from epscale.config import DataConfig
from epscale.training.data import (DataLoader, list_text_files, load_data, load_tokenizer,
                                   stdlib_root)
from epscale.training.data.prepare import prepare
from epscale.training.data.tokenizer import train_bpe

REPO = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def baseline(tok_path: Path, docs: list[str], threads: str) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and tokens of encode_batch_fast over ``docs``
    (TOKENIZERS_PARALLELISM=threads)."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = threads
    try:
        tok = load_tokenizer(tok_path).tok
        t0, c0 = time.perf_counter(), cpu_seconds()
        n = 0
        for i in range(0, len(docs), 512):
            n += sum(len(e.ids) for e in tok.encode_batch_fast(docs[i:i + 512],
                                                               add_special_tokens=False))
        return time.perf_counter() - t0, cpu_seconds() - c0, n
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def train_share(work: Path, nproc: int, steps: int, over: list[str]) -> dict:
    run = work / f"run-{len(list(work.glob('run-*')))}"
    cmd = [sys.executable, "-m", "epscale", "train", "--config",
           str(REPO / "configs" / "tiny.yaml"), "--nproc", str(nproc), "--run-dir", str(run),
           f"train.steps={steps}", "train.eval_every=0", "train.ckpt_every=0", "train.warmup_steps=2", *over]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "event" not in r][steps // 3:]
    shares = [r["time_breakdown"]["data"] / r["step_time_s"] for r in recs]
    return {"data_share": statistics.median(shares),
            "data_ms": 1e3 * statistics.median(r["time_breakdown"]["data"] for r in recs),
            "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in recs),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs)}


def loader_us(cfg: DataConfig, vocab: int, seq: int, batch: int, n: int = 300) -> float:
    data = load_data(cfg, vocab)
    loader = DataLoader(data, seq, batch, 1, 0, 1, 0)
    loader.next_micro_batch()
    loader.end_step()
    t0 = time.perf_counter()
    for _ in range(n):
        loader.next_micro_batch()
        loader.end_step()
    return 1e6 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--no-train", action="store_true", help="prepare and loader figures only")
    ap.add_argument("--json", default=None, help="write the headline figures here")
    ap.add_argument("--keep", default=None, help="work directory to keep (default: a temp dir)")
    args = ap.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="epscale-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    root = stdlib_root()
    files = [p for p in list_text_files(root, "*.py") if p.stat().st_size]  # named: non-empty
    docs = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    mb = sum(len(d.encode()) for d in docs) / 1e6
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; corpus: {len(files)} stdlib .py "
          f"files, {mb:.1f} MB")
    t0 = time.perf_counter()
    tok = train_bpe(iter(docs), args.vocab, work / "tok")
    print(f"train-tokenizer: BPE of {tok.vocab_size} ids in {time.perf_counter() - t0:.1f} s")
    out: dict = {"machine": cpu_name(), "cores": os.cpu_count(), "corpus_mb": mb}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for threads, name in (("false", "baseline_1_thread"), ("true", "baseline_all_threads")):
        secs, cpu, n = baseline(tok.path, docs, threads)
        out[name], out[f"{name}_per_cpu_s"] = n / secs, n / cpu
        print(f"{name:24s} {n / secs / 1e6:6.2f} M tokens/s wall, {n / cpu / 1e6:5.2f} M per "
              f"CPU-second  ({n:,} tokens in {secs:.2f} s)")
    outputs = {}
    for w in args.workers:
        dest = work / f"prep-w{w}"
        t0, c0 = time.perf_counter(), cpu_seconds()
        r = prepare(files, work / "tok", dest, workers=w, overwrite=True, progress=False)
        secs, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        n = r.manifest["tokens"]["train"] + r.manifest["tokens"]["val"]
        out[f"prepare_{w}_workers"], out[f"prepare_{w}_workers_per_cpu_s"] = n / secs, n / cpu
        outputs[w] = {p.name: p.read_bytes() for p in sorted(dest.iterdir()) if p.is_file()}
        print(f"prepare, {w} worker(s)       {n / secs / 1e6:6.2f} M tokens/s wall, "
              f"{n / cpu / 1e6:5.2f} M per CPU-second  ({n:,} tokens incl. EOS in {secs:.2f} s)")
    same = all(o == outputs[args.workers[0]] for o in outputs.values())
    print(f"outputs at {', '.join(map(str, args.workers))} workers identical: {same}")
    w_max = max(args.workers)
    out["ratio_prepare1_vs_1_thread"] = out.get("prepare_1_workers", 0) / out["baseline_1_thread"]
    ratio_n = out[f"prepare_{w_max}_workers"] / out["baseline_all_threads"]
    out[f"ratio_prepare{w_max}_vs_all_threads"] = ratio_n
    print(f"prepare(1) / baseline(1 thread)   = {out['ratio_prepare1_vs_1_thread']:.2f}")
    print(f"prepare({w_max}) / baseline(all threads) = {ratio_n:.2f}")
    prep = work / f"prep-w{w_max}"
    vocab = -(-tok.vocab_size // 64) * 64
    us_prep = loader_us(DataConfig(source=str(prep), tokenizer=str(prep)), vocab, 128, 4)
    us_bytes = loader_us(DataConfig(), 256, 128, 4)
    print(f"loader alone (4 x 128 tokens): prepared shards {us_prep:.0f} us, stdlib bytes "
          f"{us_bytes:.0f} us per micro-batch")
    out["loader_us_prepared"], out["loader_us_bytes"] = us_prep, us_bytes
    shards = [f"data.source={prep}", f"data.tokenizer={prep}", f"model.vocab_size={vocab}"]
    runs = [("prepared", shards), ("prepared_doc_masking", [*shards, "data.doc_masking=true"]),
            ("stdlib_bytes", [])]
    if args.no_train:
        runs = []
    for name, over in runs:
        res = train_share(work, args.nproc, args.steps, over)
        out[f"train_{name}"] = res
        print(f"train {name:22s} data {res['data_ms']:.2f} ms of a {res['step_ms']:.0f} ms step "
              f"= {100 * res['data_share']:.2f}%  ({res['tokens_per_s']:,.0f} tok/s, "
              f"{args.nproc} processes)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
