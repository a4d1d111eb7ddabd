"""One MoE layer from two revisions of epscale, side by side in one process: the
working tree's ``epscale`` against ``src/epscale`` of a git revision, loaded as a
second package. For claims of the form "this change made the layer N% faster".

    .venv/bin/python benchmarks/ab_revisions.py --base HEAD~1
    .venv/bin/python benchmarks/ab_revisions.py --base HEAD~1 --path rows   # the EP-style path
    .venv/bin/python benchmarks/ab_revisions.py --base HEAD~1 --path ep     # 2 gloo ranks, dedup
    .venv/bin/python benchmarks/ab_revisions.py --base HEAD~1 --configs narrow,64/6/512/256/2048
    .venv/bin/python benchmarks/ab_revisions.py --base e3b2090~1 --configs coarse,fine,narrow \\
        --threads 1 --clock cpu --rounds 6 --json ab.json

Where there is no git history (a device machine gets a copy of the working tree only),
``--base`` also takes a directory holding a revision's ``src/epscale``, prepared with
``mkdir -p .base && git archive REV src/epscale | tar -x -C .base``:

    python benchmarks/ab_revisions.py --base .base --device cuda     # on a GPU

Both layers get the same weights and the same input; their outputs must agree within
the dtype's tolerance before anything is timed, and the ``bitwise`` column says whether
the output, the input gradient and every parameter gradient are bit for bit the same (a
change that claims to change no behaviour must show ``yes``). Steps (forward + backward,
gradients set to None between steps) alternate between the two in every round, so a noisy
neighbour hits both alike; each side's figure is its best step. speedup = base time /
new time (above 1: the working tree is faster).

``--path ep`` runs both layers expert-parallel over ``--nproc`` gloo processes (each
revision's own ``ParallelDims`` and ``parallelize``, ``--dispatcher``); every rank checks
its outputs and gradient shards, and the times are rank 0's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

import epscale

ROOT = Path(__file__).resolve().parent.parent
if str(Path(__file__).resolve().parent) not in sys.path:  # spawned ranks import this module
    sys.path.insert(0, str(Path(__file__).resolve().parent))
CONFIGS = {
    "coarse": dict(E=8, K=2, D=1024, F=1024, T=4096),
    "fine": dict(E=64, K=8, D=1024, F=256, T=4096),
    "narrow": dict(E=128, K=8, D=512, F=128, T=2048),
    "mid": dict(E=32, K=4, D=768, F=512, T=2048),
    "wide": dict(E=16, K=2, D=512, F=1408, T=2048),
}


def revision_dir(rev: str, workdir: str) -> str:
    """The ``src/epscale`` directory of ``rev`` (a git revision, extracted into
    ``workdir``, or a directory holding a revision's ``src/epscale``)."""
    if os.path.isdir(rev):
        pkg_dir = os.path.join(rev, "src", "epscale")
        if not os.path.isfile(os.path.join(pkg_dir, "__init__.py")):
            raise SystemExit(f"--base {rev}: a directory, but {pkg_dir}/__init__.py is not "
                             "there; fill it with `git archive REV src/epscale | tar -x -C "
                             f"{rev}`")
        return pkg_dir
    try:
        blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src/epscale"],
                              check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", b"") or b""
        raise SystemExit(f"cannot read src/epscale at revision {rev!r} from {ROOT}: "
                         f"{err.decode(errors='replace').strip() or e}")
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(workdir, filter="data")
    return os.path.join(workdir, "src", "epscale")


def load_revision(rev: str, workdir: str):
    """``src/epscale`` of ``rev`` imported as the package ``epscale_base``. Its modules
    import each other relatively, so they stay inside that package."""
    return _import_as_base(revision_dir(rev, workdir))


def _import_as_base(pkg_dir: str):
    spec = importlib.util.spec_from_file_location(
        "epscale_base", os.path.join(pkg_dir, "__init__.py"), submodule_search_locations=[pkg_dir])
    module = importlib.util.module_from_spec(spec)
    sys.modules["epscale_base"] = module
    spec.loader.exec_module(module)
    return module


def build(pkg, shape, dtype, path: str, state=None):
    cfg = pkg.MoEConfig(dim=shape["D"], hidden_dim=shape["F"], num_experts=shape["E"],
                        top_k=shape["K"], score_func="softmax", route_norm=True)
    torch.manual_seed(0)
    moe = pkg.MoE(cfg).to(dtype)
    if path == "rows":  # dispatch -> experts(x_RD) -> combine, the path EP dispatchers take
        local = importlib.import_module(pkg.__name__ + ".dispatch.local")
        kw = {}
        if hasattr(moe.experts, "row_buffers"):  # revisions whose dispatchers get a workspace
            kw["workspace"] = moe.experts.row_buffers()
        moe.dispatcher = local.LocalDispatcher(cfg.num_experts, fuse=False, **kw)
    if state is not None:
        missing = moe.load_state_dict(state, strict=False)
        if missing.missing_keys:
            raise SystemExit(f"the base revision's layer has parameters the working tree's "
                             f"has not: {missing.missing_keys}; compare revisions with one layout")
    return moe


def step(moe, x, gy):
    moe.zero_grad(set_to_none=True)
    x.grad = None
    y = moe(x)
    y.backward(gy)
    return y


def compare(new, base, x, gy) -> tuple[float, bool]:
    """(relative norm difference of the outputs, whether output, input gradient and every
    parameter gradient are bit for bit equal) for one forward + backward of each."""
    y_n = step(new, x, gy).detach()
    g_n = [x.grad.clone()] + [p.grad for _, p in sorted(new.named_parameters())]
    y_b = step(base, x, gy).detach()
    g_b = [x.grad.clone()] + [p.grad for _, p in sorted(base.named_parameters())]
    diff = ((y_n.float() - y_b.float()).norm() / y_b.float().norm()).item()
    same = torch.equal(y_n, y_b) and len(g_n) == len(g_b) and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(g_n, g_b))
    return diff, same


def best_times(pair, x, gy, rounds: int, reps: int, clock, sync, barrier=lambda: None) -> dict:
    best = {"base": float("inf"), "new": float("inf")}
    for _ in range(rounds):
        for side, moe in pair:
            step(moe, x, gy)  # warm-up after the other side ran
            sync()
            for _ in range(reps):
                barrier()
                t0 = clock()
                step(moe, x, gy)
                sync()
                best[side] = min(best[side], clock() - t0)
    return best


def _inputs(shape, seed: int, device, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape["T"], shape["D"], generator=g).to(device, dtype).requires_grad_(True)
    gy = torch.randn(shape["T"], shape["D"], generator=g).to(device, dtype)
    return x, gy


def _ep_worker(rank, nproc, base_dir, shape, dtype_name, dispatcher, rounds, reps, clock_name):
    """One rank of --path ep: both revisions' layers, expert-parallel over the world."""
    import torch.distributed as dist

    base_pkg = _import_as_base(base_dir)
    dtype = getattr(torch, dtype_name)
    new = build(epscale, shape, dtype, "fused")
    base = build(base_pkg, shape, dtype, "fused", new.state_dict())
    epscale.parallelize(new, epscale.ParallelDims(dp=1, ep=nproc), dispatcher=dispatcher)
    base_pkg.parallelize(base, base_pkg.ParallelDims(dp=1, ep=nproc), dispatcher=dispatcher)
    x, gy = _inputs(shape, 1 + rank, "cpu", dtype)
    diff, same = compare(new, base, x, gy)
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    best = best_times((("base", base), ("new", new)), x, gy, rounds, reps, clock, lambda: None,
                      dist.barrier)
    return {"diff": diff, "bitwise": same, **best}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True,
                   help="git revision to compare the working tree against, or a directory "
                        "holding that revision's src/epscale")
    p.add_argument("--configs", default="coarse,fine",
                   help="comma list of: " + ", ".join(CONFIGS) + ", or custom shapes E/K/D/F/T")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--path", default="fused", choices=("fused", "rows", "ep"),
                   help="fused: the layer's default no-EP kernel; rows: generic dispatch -> "
                        "experts -> combine, as under expert parallelism; ep: expert-parallel "
                        "over --nproc gloo processes")
    p.add_argument("--nproc", type=int, default=2, help="--path ep: processes (default 2)")
    p.add_argument("--dispatcher", default="dedup", help="--path ep: backend (default dedup)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=2, help="timed steps per side per round")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: process CPU time (needs --threads 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device")
    if device.type == "cuda" and args.clock == "cpu":
        p.error("--clock cpu measures host CPU time; use the wall clock with --device cuda")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    shapes = {}
    for c in args.configs.split(","):
        if c in CONFIGS:
            shapes[c] = CONFIGS[c]
        elif len(c.split("/")) == 5 and all(v.isdigit() for v in c.split("/")):
            shapes[c] = dict(zip("EKDFT", map(int, c.split("/"))))
        else:
            p.error(f"unknown config {c!r}; known: {', '.join(CONFIGS)}, or E/K/D/F/T")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        p.error("--clock cpu needs --threads 1")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    dtype = getattr(torch, args.dtype)
    if args.path == "ep" and device.type != "cpu":
        p.error("--path ep runs gloo processes on the CPU")
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = revision_dir(args.base, tmp)
        base_pkg = _import_as_base(base_dir)
        print(f"base {args.base} vs working tree; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {args.clock} clock, {args.dtype}, "
              f"{args.path} path" + (f" ({args.nproc} ranks, {args.dispatcher})"
                                     if args.path == "ep" else "") + f", {device}")
        print(f"{'config':8s} {'base ms':>8s} {'new ms':>8s} {'speedup':>8s}  out diff  bitwise")
        results = []
        limit = 5e-2 if dtype != torch.float32 else 1e-4
        for name, shape in shapes.items():
            if args.path == "ep":
                from epscale.tune.calibrate import spawn_local

                per_rank = spawn_local(_ep_worker, args.nproc,
                                       (base_dir, shape, args.dtype, args.dispatcher, args.rounds,
                                        args.reps, args.clock),
                                       threads=args.threads or 1)
                diff = max(r["diff"] for r in per_rank)
                same = all(r["bitwise"] for r in per_rank)
                best = {"base": per_rank[0]["base"], "new": per_rank[0]["new"]}
            else:
                new = build(epscale, shape, dtype, args.path).to(device)
                base = build(base_pkg, shape, dtype, args.path, new.state_dict()).to(device)
                x, gy = _inputs(shape, 1, device, dtype)
                diff, same = compare(new, base, x, gy)
                best = None
            if not diff < limit:
                raise SystemExit(f"{name}: outputs differ by {diff:.3g} (relative norm, limit "
                                 f"{limit}); the two revisions do not compute the same layer")
            if best is None:
                best = best_times((("base", base), ("new", new)), x, gy, args.rounds, args.reps,
                                  clock, sync)
            speedup = best["base"] / best["new"]
            print(f"{name:8s} {best['base'] * 1e3:8.1f} {best['new'] * 1e3:8.1f} {speedup:8.3f}  "
                  f"{diff:.1e}  {'yes' if same else 'NO'}")
            sys.stdout.flush()
            results.append(dict(config=name, shape=shape, base_ms=best["base"] * 1e3,
                                new_ms=best["new"] * 1e3, speedup=speedup, out_rel_diff=diff,
                                bitwise=same))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="ab_revisions", base=args.base, path=args.path,
                           device=str(device), torch=torch.__version__,
                           threads=torch.get_num_threads(), clock=args.clock, dtype=args.dtype,
                           command=" ".join(sys.argv), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
