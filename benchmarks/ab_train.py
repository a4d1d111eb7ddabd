"""The whole trainer from two revisions of epscale, run for real and compared bit for bit:
``epscale train`` from the working tree and from ``src/epscale`` of a base revision
(``git archive REV src/epscale`` into a directory, run with PYTHONPATH pointing at it), on
the same config and run-directory layout. For claims of the form "this change moves code
around and changes no behaviour" (and "at the same speed").

    .venv/bin/python benchmarks/ab_train.py --base main
    .venv/bin/python benchmarks/ab_train.py --base fb11ac7 --cases demo,pipeline --steps 6
    .venv/bin/python benchmarks/ab_train.py --base .base      # a directory holding src/epscale
    .venv/bin/python benchmarks/ab_train.py --base main --new HEAD   # committed work only

Cases (all on configs/tiny.yaml, a few steps, validation and checkpoints inside them):

* ``demo``: 1 process, the recipe as it is (ep=2 needs 2 ranks, so parallel.ep=1).
* ``fsdp``: ``--nproc 2 parallel.fsdp=true parallel.ep=2``.
* ``pipeline``: ``--nproc 2 parallel.pp=2`` with what tests/test_pipeline.py uses (1F1B,
  2 micro-batches of 2 sequences, untied embeddings).
* ``elastic``: 2 processes (ep=2) stop at a checkpoint half-way; 1 process (ep=1)
  continues from it in the same run directory.

For each case and each side: every numeric field of every step record of metrics.jsonl
(loss, grad_norm, val_loss, lr, per-layer expert loads, biases, router entropy, ...; the
wall-clock ones listed in ``TIMING`` aside) and every tensor of the final checkpoint (model,
optimizer state, torch RNG states where ``train.seed`` seeded them, extra files; not the
unseeded Python ``random`` state) must be equal BIT FOR BIT (NaN equals NaN). The
event names of metrics.jsonl must come in the same order. Exit status 1 on any
difference. The speed columns print each side's median tokens/s over the steps after the
first, measured in this one run; ``--rounds R`` runs each side R times, alternating base
and new (so a busy machine hits both alike), and prints the median of the runs' medians.
A busy machine moves wall-clock figures a lot; the CPU columns (user + system seconds of
all of a run's processes, start-up included: the same work on both sides) move less. A
base/new CPU ratio above 1 means the working tree used less CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import yaml
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_revisions import revision_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# step-record fields that are wall-clock or memory measurements: they differ run to run
TIMING = {"time", "tokens_per_s", "tokens_per_s_per_proc", "step_time_s", "time_breakdown",
          "comm_share", "mfu", "rank_step_time_s", "rank_wait_frac", "mem_mb", "rank_mem_mb",
          "comm_s", "comm_exposed_s", "comm_exposed_share", "comm_by_kind"}
# the Python ``random`` state each rank saves: nothing seeds it, so it differs run to run
UNSEEDED = re.compile(r"rank_\d+\.pt\.python\.")
# the torch RNG state each rank saves: compared where train.seed seeded it (the
# one-process build does); a meta-device build never seeds it, so it differs run to run
TORCH_RNG = re.compile(r"rank_\d+\.pt\.torch$")
COMMON = ["train.eval_every=2", "train.eval_batches=2", "train.ckpt_every=2",
          "train.collective_timeout_s=0", "train.preflight=false", "train.warmup_steps=2"]
PIPELINE = ["parallel.pp=2", "parallel.ep=1", "train.micro_batch_size=2",
            "train.grad_accum=2", "model.tie_embeddings=false", "moe.bias_update_speed=0.01"]


def cases(steps: int) -> dict[str, list[tuple[int, list[str]]]]:
    """name -> the launches, in order, into one run directory: (processes, overrides)."""
    s = [f"train.steps={steps}", *COMMON]
    half = max(2, steps // 2 // 2 * 2)  # a checkpoint step (ckpt_every = 2)
    return {
        "demo": [(1, [*s, "parallel.ep=1"])],
        "fsdp": [(2, [*s, "parallel.fsdp=true", "parallel.ep=2"])],
        "pipeline": [(2, [*s, *PIPELINE])],
        "elastic": [(2, [*s, "parallel.ep=2", f"--stop-at={half}"]), (1, [*s, "parallel.ep=1"])],
    }


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children and theirs."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def launch(src: Path, run_dir: Path, nproc: int, overrides: list[str], log) -> float:
    """One ``epscale train`` of the tree ``src`` (its ``src`` directory); the CPU seconds
    it took, all its processes together (start-up included)."""
    flags = [o for o in overrides if o.startswith("--")]
    keys = [o for o in overrides if not o.startswith("--")]
    config = str(ROOT / "configs" / "tiny.yaml")
    cmd = [sys.executable, "-m", "epscale", "train", "--config", config,
           "--run-dir", str(run_dir), *(["--nproc", str(nproc)] if nproc > 1 else []),
           *flags, *keys]
    env = {**os.environ, "PYTHONPATH": str(src)}
    cpu0 = children_cpu_s()
    proc = subprocess.run(cmd, env=env, cwd=run_dir.parent, capture_output=True, text=True)
    log.write(f"$ PYTHONPATH={src} {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (PYTHONPATH={src}) failed with status "
                         f"{proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return children_cpu_s() - cpu0


def read_metrics(run_dir: Path) -> tuple[list[dict], list[str]]:
    steps, events = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" in rec:
            events.append(rec["event"])
        else:
            steps.append(rec)
    return steps, events


def same(a, b) -> bool:
    """Bit-for-bit equality of JSON values (floats by their bits; NaN equals NaN)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def compare_metrics(base: Path, new: Path) -> list[str]:
    (sb, eb), (sn, en) = read_metrics(base), read_metrics(new)
    out = []
    if eb != en:
        out.append(f"events differ: base {eb} / new {en}")
    if len(sb) != len(sn):
        out.append(f"{len(sb)} step records in base, {len(sn)} in new")
    for rb, rn in zip(sb, sn):
        if rb.keys() != rn.keys():
            out.append(f"step {rb.get('step')}: keys differ: {sorted(rb.keys() ^ rn.keys())}")
        for k in sorted(rb.keys() - TIMING):
            if k in rn and not same(rb[k], rn[k]):
                out.append(f"step {rb.get('step')}: {k}: base {rb[k]!r} / new {rn[k]!r}")
    return out


def final_checkpoint(run_dir: Path) -> Path:
    found = sorted((run_dir / "checkpoints").glob("step_*"))
    if not found:
        raise SystemExit(f"{run_dir}: no checkpoint")
    return found[-1]


def flat_tensors(obj, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): obj}


def compare_checkpoints(base: Path, new: Path) -> tuple[list[str], int]:
    cb, cn = final_checkpoint(base), final_checkpoint(new)
    out = []
    if cb.name != cn.name:
        out.append(f"final checkpoints differ: {cb.name} / {cn.name}")
    state = []
    for c in (cb, cn):
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore")
            full = flat_tensors(_load_state_dict_from_keys(checkpoint_id=str(c)))
        for extra in sorted(c.glob("*.pt")):
            full.update(flat_tensors(torch.load(extra, weights_only=False), f"{extra.name}."))
        state.append(full)
    fb, fn = ({k: v for k, v in full.items() if not UNSEEDED.match(k)} for full in state)
    if fb.keys() != fn.keys():
        out.append(f"checkpoint entries differ: {sorted(fb.keys() ^ fn.keys())[:10]}")
    n = 0
    seed = int(yaml.safe_load((base / "config.yaml").read_text())["train"]["seed"])
    for k in sorted(fb.keys() & fn.keys()):
        a, b = fb[k], fn[k]
        if TORCH_RNG.match(k) and unseeded(a, b, seed):
            continue
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            n += 1
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                    a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                    b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)):
                out.append(f"checkpoint tensor {k} differs")
        elif not same(a, b):
            out.append(f"checkpoint entry {k}: base {a!r} / new {b!r}")
    return out, n


def unseeded(a: torch.Tensor, b: torch.Tensor, seed: int) -> bool:
    """Two saved torch RNG states whose generators were seeded differently, neither from
    ``seed``: nothing seeded them (they started from a random seed)."""
    seeds = []
    for state in (a, b):
        g = torch.Generator()
        g.set_state(state)
        seeds.append(g.initial_seed())
    return seeds[0] != seeds[1] and seed not in seeds


def median_tps(run_dir: Path) -> float:
    steps, _ = read_metrics(run_dir)
    tps = [r["tokens_per_s"] for r in steps[1:]] or [r["tokens_per_s"] for r in steps]
    return statistics.median(tps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision (or a directory holding a "
                   "revision's src/epscale) to compare the working tree against")
    p.add_argument("--new", default=None, help="the same for the other side (default: the "
                   "working tree); a revision such as HEAD lets the tree change while it runs")
    p.add_argument("--cases", default="demo,fsdp,pipeline,elastic")
    p.add_argument("--steps", type=int, default=4, help="steps per case (default 4)")
    p.add_argument("--rounds", type=int, default=1, help="runs per side for the speed "
                   "figure, alternating (the median of the runs' medians); the first is compared")
    p.add_argument("--keep", default=None, help="keep the run directories under this path")
    args = p.parse_args(argv)
    table = cases(args.steps)
    unknown = [c for c in args.cases.split(",") if c not in table]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {', '.join(table)}")
    with tempfile.TemporaryDirectory(prefix="ab_train_") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        base_src = Path(revision_dir(args.base, str(work / "base_tree"))).parent
        new_src = (Path(revision_dir(args.new, str(work / "new_tree"))).parent if args.new
                   else ROOT / "src")
        sides = {"base": base_src, "new": new_src}
        failed = False
        with open(work / "ab_train.log", "w") as log:
            print(f"base: {args.base} ({base_src}); new: {args.new or 'the working tree'} "
                  f"({new_src})")
            print(f"{'case':10s} {'metrics':>8s} {'ckpt':>14s} {'base tok/s':>11s} "
                  f"{'new tok/s':>10s} {'new/base':>8s} {'base CPU s':>10s} {'new CPU s':>9s} "
                  f"{'base/new':>8s}")
            for name in args.cases.split(","):
                runs, tps, cpu = {}, {"base": [], "new": []}, {"base": [], "new": []}
                for r in range(args.rounds):  # base, new, base, new, ...
                    for side, src in sides.items():
                        run_dir = work / side / f"{name}.{r}" if r else work / side / name
                        shutil.rmtree(run_dir, ignore_errors=True)  # a kept one from before
                        run_dir.parent.mkdir(parents=True, exist_ok=True)
                        cpu[side].append(sum(launch(src, run_dir, nproc, over, log)
                                             for nproc, over in table[name]))
                        runs.setdefault(side, run_dir)  # the first round's are compared
                        tps[side].append(median_tps(run_dir))
                diffs = compare_metrics(runs["base"], runs["new"])
                ck_diffs, n = compare_checkpoints(runs["base"], runs["new"])
                tb, tn = statistics.median(tps["base"]), statistics.median(tps["new"])
                cb, cn = statistics.median(cpu["base"]), statistics.median(cpu["new"])
                ok_m = "same" if not diffs else f"{len(diffs)} diff"
                ok_c = f"same ({n})" if not ck_diffs else f"{len(ck_diffs)} diff"
                print(f"{name:10s} {ok_m:>8s} {ok_c:>14s} {tb:11.0f} {tn:10.0f} {tn / tb:8.3f} "
                      f"{cb:10.1f} {cn:9.1f} {cb / cn:8.3f}")
                for d in (diffs + ck_diffs)[:20]:
                    print(f"    {d}")
                failed |= bool(diffs or ck_diffs)
        print("bit for bit: " + ("NO" if failed else "yes, every case"))
        return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
