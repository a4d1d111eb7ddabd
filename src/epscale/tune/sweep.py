"""``epscale sweep BASE``: measure a grid of MoE configurations around a recipe on this
machine and recommend one.

The grid is num_experts x capacity_factor x top_k x dispatcher. Every point runs in its own
process (``python -m epscale.tune.sweep --point FILE``), either as a short real training run
(``--mode train``: ``epscale train`` for ``--steps`` steps, read back from its
metrics.jsonl) or as a layer benchmark (``--mode layer``: one expert-parallel MoE layer,
trained for ``--steps`` steps to imitate a fixed random teacher FFN). Each point reports
tokens/s, dropped assignments, MaxVio, the loss after N steps and peak memory.

The sweep directory holds ``sweep.json`` (what is being swept, checked on resume),
``results.jsonl`` (one line per finished point; points already there are not run again)
and ``points/ID/`` (each point's log and run directory). The report is a table, a plot of
throughput against loss with its Pareto front (``pareto.png``) and a recommendation: the
fastest point whose loss is within ``--loss-tolerance`` of the best loss.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import ConfigError, MoEConfig, RunConfig, dump_yaml, load_recipe, recipe_path, to_dict
from ..moe.experts import FeedForward
from ..moe.layer import MoE
from ..parallel import ParallelDims, parallelize, sync_gradients
from .calibrate import spawn_local

MODES = ("train", "layer")


@dataclass(frozen=True)
class Point:
    num_experts: int
    capacity_factor: float | None
    top_k: int
    dispatcher: str

    @property
    def id(self) -> str:
        cf = "none" if self.capacity_factor is None else f"{self.capacity_factor:g}"
        return f"E{self.num_experts}-cf{cf}-k{self.top_k}-{self.dispatcher}"

    def overrides(self) -> list[str]:
        cf = "null" if self.capacity_factor is None else repr(self.capacity_factor)
        return [f"moe.num_experts={self.num_experts}", f"moe.top_k={self.top_k}",
                f"moe.capacity_factor={cf}", f"parallel.dispatcher={self.dispatcher}"]


# ----------------------------------------------------------------------------- grid


def _parse_list(text: str, kind, key: str) -> list:
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if kind is float and item.lower() in ("none", "null", "dropless"):
            out.append(None)
            continue
        try:
            out.append(kind(item))
        except ValueError:
            raise ConfigError(f"--{key} item '{item}' is invalid: expected a comma list of "
                              f"{'numbers or none' if kind is float else 'integers'}") from None
    if not out:
        raise ConfigError(f"--{key} is empty")
    return out


def expand_grid(base: RunConfig, experts: list[int], capacities: list[float | None],
                top_ks: list[int], dispatchers: list[str], nproc: int
                ) -> tuple[list[Point], list[tuple[Point, str]]]:
    """All grid points, and the ones skipped with the reason (invalid for this base)."""

    keep, skipped = [], []
    for E, cf, k, d in itertools.product(experts, capacities, top_ks, dispatchers):
        p = Point(E, cf, k, d)
        moe = to_dict(base.moe)
        moe.update(num_experts=E, top_k=k, capacity_factor=cf)
        if moe["num_groups"] and (E % moe["num_groups"]
                                  or moe["topk_groups"] * (E // moe["num_groups"]) < k):
            moe.update(num_groups=0, topk_groups=0)
        try:
            MoEConfig(**moe)
        except ConfigError as e:
            skipped.append((p, str(e)))
            continue
        if E % nproc:
            skipped.append((p, f"{E} experts do not divide over {nproc} EP processes"))
            continue
        if nproc == 1 and d not in ("local", "dedup", "alltoall"):
            skipped.append((p, f"dispatcher {d} needs more than one process"))
            continue
        keep.append(p)
    return keep, skipped


# ----------------------------------------------------------------------------- analysis


def pareto_front(results: list[dict]) -> list[dict]:
    """Points not dominated in (higher tokens/s, lower loss), sorted by tokens/s."""
    ok = [r for r in results if r.get("status") == "ok" and math.isfinite(r.get("loss", math.nan))]
    front = [r for r in ok if not any(
        o["tokens_per_s"] >= r["tokens_per_s"] and o["loss"] <= r["loss"]
        and (o["tokens_per_s"] > r["tokens_per_s"] or o["loss"] < r["loss"]) for o in ok)]
    return sorted(front, key=lambda r: r["tokens_per_s"])


def recommend(results: list[dict], loss_tolerance: float = 0.02) -> tuple[dict | None, list[str]]:
    """The fastest point whose loss is within ``loss_tolerance`` (relative) of the best,
    and the reasons, in sentences."""
    ok = [r for r in results if r.get("status") == "ok" and math.isfinite(r.get("loss", math.nan))]
    if not ok:
        return None, ["no point finished; see the points' logs"]
    best_loss = min(r["loss"] for r in ok)
    fastest = max(ok, key=lambda r: r["tokens_per_s"])
    good = [r for r in ok if r["loss"] <= best_loss * (1 + loss_tolerance)]
    pick = max(good, key=lambda r: r["tokens_per_s"])
    reasons = [f"{pick['id']}: loss {pick['loss']:.4f} is within {loss_tolerance:.0%} of the best "
               f"({best_loss:.4f}) and it is the fastest such point at "
               f"{pick['tokens_per_s']:,.0f} tokens/s"]
    if fastest is not pick:
        reasons.append(f"the fastest point overall, {fastest['id']} "
                       f"({fastest['tokens_per_s']:,.0f} tokens/s), reaches loss "
                       f"{fastest['loss']:.4f}, {fastest['loss'] / best_loss - 1:+.1%} from the best")
    else:
        reasons.append("it is also the fastest point measured")
    if pick.get("dropped_frac", 0) > 0.01:
        reasons.append(f"it drops {pick['dropped_frac']:.1%} of assignments (capacity "
                       f"{pick['capacity_factor']}); a larger capacity factor costs throughput")
    elif pick["capacity_factor"] is not None:
        reasons.append(f"capacity {pick['capacity_factor']} drops {pick.get('dropped_frac', 0):.2%} "
                       "of assignments")
    reasons.append(f"MaxVio {pick.get('max_vio', float('nan')):.2f}, peak memory "
                   f"{pick.get('peak_mem_mb', float('nan')):,.0f} MB per process")
    front = pareto_front(results)
    reasons.append(f"Pareto front (throughput vs loss): {', '.join(r['id'] for r in front)}")
    return pick, reasons


# ----------------------------------------------------------------------------- points


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024.0


def _train_point(spec: dict, point_dir: Path) -> dict:
    """A short real training run through ``epscale train``."""
    run_dir = point_dir / "run"
    cmd = [sys.executable, "-m", "epscale", "train", "--config", spec["config"],
           "--nproc", str(spec["nproc"]), "--run-dir", str(run_dir),
           *spec["base_overrides"], *spec["point_overrides"],
           f"train.steps={spec['steps']}", "train.eval_every=0", "train.ckpt_every=0",
           f"parallel.ep={spec['nproc']}", "parallel.dp=1", "parallel.fsdp=false",
           "parallel.dp_replicate=1", "parallel.dp_shard=null"]
    with (point_dir / "train.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"epscale train exited with {rc}; see {point_dir / 'train.log'}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    steps = [r for r in recs if "loss" in r and "step" in r and "event" not in r]
    if not steps:
        raise RuntimeError(f"no step records in {run_dir / 'metrics.jsonl'}")
    last = steps[-min(3, len(steps)):]
    timed = steps[2:] if len(steps) > 3 else steps     # first steps include warm-up
    return {"loss": statistics.fmean(r["loss"] for r in last),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "max_vio": statistics.fmean(r.get("max_vio", 0.0) for r in last),
            "dropped_frac": statistics.fmean(r.get("dropped_frac", 0.0) for r in last),
            "peak_mem_mb": max(max(r.get("rank_mem_mb", [r.get("mem_mb", 0.0)])) for r in steps),
            "steps": len(steps)}


def _layer_worker(rank, nproc, moe_kw, dispatcher, tokens, steps, seed):
    """One EP MoE layer learning a fixed random teacher FFN (same teacher at every point)."""
    import torch
    import torch.distributed as dist

    cfg = MoEConfig(**moe_kw)
    torch.manual_seed(seed)
    teacher = FeedForward(cfg.dim, 4 * cfg.hidden_dim, "gelu")
    torch.manual_seed(seed + 1)
    moe = MoE(cfg)
    dims = None
    if nproc > 1:
        dims = ParallelDims(dp=1, ep=nproc)
        parallelize(moe, dims, dispatcher=dispatcher)
    opt = torch.optim.AdamW(moe.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed + 2 + rank)
    data = torch.randn(steps, tokens, cfg.dim, generator=g)
    with torch.no_grad():
        target = teacher(data)
        target = target / target.std()
    times, losses, vio, dropped = [], [], [], 0.0
    for s in range(steps):
        t0 = time.perf_counter()
        y = moe(data[s])
        loss = (y - target[s]).square().mean()
        (loss + moe.aux_loss).backward()
        if dims is not None:
            sync_gradients(moe, dims)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        counts = moe.last_stats["tokens_per_expert"].to(torch.float64)
        stats = torch.tensor([dt, loss.item(), float(moe.last_stats["num_dropped"])],
                             dtype=torch.float64)
        if nproc > 1:
            dist.all_reduce(counts)
            t_max = stats[:1].clone()
            dist.all_reduce(t_max, op=dist.ReduceOp.MAX)
            dist.all_reduce(stats)
            stats[0] = t_max[0]
            stats[1] /= nproc
        times.append(float(stats[0]))
        losses.append(float(stats[1]))
        dropped += float(stats[2])
        vio.append(float(counts.max() / counts.mean() - 1))
    timed = times[1:] if len(times) > 1 else times
    return {"loss": statistics.fmean(losses[-min(3, steps):]),
            "tokens_per_s": tokens * nproc / statistics.median(timed),
            "max_vio": statistics.fmean(vio[-min(3, steps):]),
            "dropped_frac": dropped / (steps * tokens * nproc * cfg.top_k),
            "peak_mem_mb": _peak_rss_mb(), "steps": steps}


def _layer_point(spec: dict, point_dir: Path) -> dict:
    cfg = load_recipe(spec["config"], spec["base_overrides"] + spec["point_overrides"])
    moe_kw = to_dict(cfg.moe)
    tokens = cfg.train.micro_batch_size * cfg.model.seq_len
    args = (moe_kw, cfg.parallel.dispatcher, tokens, spec["steps"], spec["seed"])
    if spec["nproc"] == 1:      # no process group needed: run here
        res = [_layer_worker(0, 1, *args)]
    else:
        res = spawn_local(_layer_worker, spec["nproc"], args)
    out = res[0]
    out["peak_mem_mb"] = max(r["peak_mem_mb"] for r in res)
    return out


def run_point(spec_path: Path) -> int:
    """Entry of a point's own process: read the spec, measure, write result.json."""
    spec = json.loads(spec_path.read_text())
    point_dir = spec_path.parent
    t0 = time.perf_counter()
    try:
        fn = _train_point if spec["mode"] == "train" else _layer_point
        out = {"status": "ok", **fn(spec, point_dir)}
    except Exception as e:  # noqa: BLE001 - recorded as the point's result
        import traceback
        (point_dir / "error.log").write_text(traceback.format_exc())
        out = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    out["wall_s"] = time.perf_counter() - t0
    out["peak_mem_mb"] = max(out.get("peak_mem_mb", 0.0), _peak_rss_mb())
    (point_dir / "result.json").write_text(json.dumps(out))
    return 0 if out["status"] == "ok" else 1


# ----------------------------------------------------------------------------- the sweep


def _identity(args, base_path: str) -> dict:
    return {"config": base_path, "overrides": list(args.overrides), "mode": args.mode,
            "steps": args.steps, "nproc": args.nproc, "seed": args.seed}


def load_results(sweep_dir: Path) -> list[dict]:
    path = sweep_dir / "results.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_sweep(args, console) -> tuple[list[dict], list[dict]]:
    """Run the missing points; returns (results of this grid, all results in the dir)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    if args.mode not in MODES:
        raise ConfigError(f"--mode {args.mode!r} is invalid: must be one of {', '.join(MODES)}")
    if args.nproc < 1 or args.steps < 1:
        raise ConfigError("--nproc and --steps must be >= 1")
    base_path = str(recipe_path(args.base).resolve())
    base = load_recipe(base_path, args.overrides)
    sweep_dir = Path(args.dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    ident = _identity(args, base_path)
    spec_file = sweep_dir / "sweep.json"
    if spec_file.is_file():
        old = json.loads(spec_file.read_text())
        diff = [k for k in ident if old.get(k) != ident[k]]
        if diff:
            k = diff[0]
            raise ConfigError(f"sweep directory {sweep_dir} holds a different sweep ({k}: was "
                              f"{old.get(k)!r}, now {ident[k]!r}); use a new --dir or the same settings")
    else:
        spec_file.write_text(json.dumps(ident, indent=1))
        dump_yaml(base, sweep_dir / "base.yaml")
    experts = _parse_list(args.experts, int, "experts") if args.experts else [base.moe.num_experts]
    caps = (_parse_list(args.capacity, float, "capacity") if args.capacity
            else [base.moe.capacity_factor])
    top_ks = _parse_list(args.top_k, int, "top-k") if args.top_k else [base.moe.top_k]
    disps = ([d.strip() for d in args.dispatchers.split(",") if d.strip()] if args.dispatchers
             else [base.parallel.dispatcher])
    points, skipped = expand_grid(base, experts, caps, top_ks, disps, args.nproc)
    for p, why in skipped:
        console.print(f"[yellow]skip[/] {p.id}: {why}")
    done = {r["id"]: r for r in load_results(sweep_dir)}
    todo = [p for p in points if p.id not in done or (args.retry_failed and done[p.id]["status"] != "ok")]
    console.print(f"{len(points)} points: {len(points) - len(todo)} already measured in "
                  f"{sweep_dir}, {len(todo)} to run ({args.mode} mode, {args.steps} steps, "
                  f"{args.nproc} process{'es' if args.nproc > 1 else ''})")
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("sweep", total=len(todo))
        for p in todo:
            progress.update(task, description=f"running {p.id}")
            point_dir = sweep_dir / "points" / p.id
            point_dir.mkdir(parents=True, exist_ok=True)
            spec = {**ident, "base_overrides": list(args.overrides),
                    "point_overrides": p.overrides(), "point": asdict(p)}
            (point_dir / "spec.json").write_text(json.dumps(spec, indent=1))
            (point_dir / "result.json").unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "epscale.tune.sweep", "--point", str(point_dir / "spec.json")]
            env = dict(os.environ)
            try:
                with (point_dir / "point.log").open("w") as log:
                    subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   timeout=args.timeout)
                res = json.loads((point_dir / "result.json").read_text())
            except subprocess.TimeoutExpired:
                res = {"status": "failed", "error": f"timed out after {args.timeout} s"}
            except (OSError, json.JSONDecodeError) as e:
                res = {"status": "failed", "error": f"no result: {e}; see {point_dir / 'point.log'}"}
            res = {"id": p.id, **asdict(p), **res}
            with (sweep_dir / "results.jsonl").open("a") as f:
                f.write(json.dumps(res) + "\n")
            done[p.id] = res
            if res["status"] == "ok":
                progress.console.print(f"{p.id}: loss {res['loss']:.4f}, {res['tokens_per_s']:,.0f} tok/s, "
                                       f"dropped {res['dropped_frac']:.2%}, MaxVio {res['max_vio']:.2f}")
            else:
                progress.console.print(f"[red]{p.id} failed[/]: {res['error']}")
            progress.advance(task)
    return [done[p.id] for p in points if p.id in done], list(done.values())


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="run one sweep point (used by epscale sweep)")
    ap.add_argument("--point", required=True, help="the point's spec.json")
    raise SystemExit(run_point(Path(ap.parse_args().point)))
