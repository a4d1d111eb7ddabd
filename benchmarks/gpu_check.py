"""The GPU check: everything that matters on CUDA, measured in one run of at most 10 minutes
on one GPU (benchmarks/gpu_check.sh calls this; RESULTS.md says how to run it offline).

Stages, each in a process of its own under its own time cap (a stage that fails, crashes or
runs out is recorded and the next one runs):

  grouped_gemm    the local dropless MoE layer on torch's grouped GEMM, forward + backward
                  under ``torch.cuda.set_sync_debug_mode("error")`` (on CPU: counted by
                  epscale.metrics.host_syncs on the device code path), its output against
                  an fp32 copy, and its step time against the per-group loop
  layer:NAME      the MoE layer against torchtitan's at a DeepSeek-like and a Mixtral-like
                  shape (benchmarks/moe_layer.py; torchtitan when it imports)
  train:VARIANT   a ~1B-total MoE (one-rank FSDP, bf16) trained for a few steps per
                  recompute mode (and compile on/off where ``train.compile`` exists):
                  tokens/s, MFU, time breakdown, host syncs per step, and
                  ``torch.cuda.max_memory_allocated`` against ``epscale describe``'s estimate
  dispatchers     every EP backend's device code on a one-rank group against the local path
  deepep          the DeepEP adapter on a one-rank group, when deep_ep imports
  overlap         benchmarks/overlap.py, when it exists

    python benchmarks/gpu_check.py                 # on a GPU machine (<= 10 min)
    python benchmarks/gpu_check.py --dry-run       # every stage on CPU in CI size (seconds)
    python benchmarks/gpu_check.py --only train --json out.json

It writes one JSON (--json; default $OUT/gpu_check.json) and prints one table. Exit code 0
when no stage failed or ran out (a stage skipped for a missing optional package is not a
failure).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))
if str(REPO / "benchmarks") not in sys.path:   # moe_layer.py; last, so that it shadows nothing
    sys.path.append(str(REPO / "benchmarks"))

import torch  # noqa: E402

# ------------------------------------------------------------------ sizes

# E experts, K top-k, D model dim, F expert hidden dim, T tokens
LAYER_SHAPES = {
    "gpu": {"deepseek-like": dict(E=64, K=6, D=2048, F=1408, T=16384),
            "mixtral-like": dict(E=8, K=2, D=4096, F=14336, T=8192)},
    "dry": {"deepseek-like": dict(E=8, K=2, D=32, F=16, T=64),
            "mixtral-like": dict(E=4, K=2, D=32, F=64, T=64)},
}
GROUPED_SHAPE = {"gpu": dict(E=64, K=8, D=2048, F=1024, T=16384),
                 "dry": dict(E=8, K=2, D=32, F=16, T=64)}

# The ~1B-total MoE (1.17B parameters, 0.21B active per token) and its CI-sized twin,
# as overrides on configs/tiny.yaml; one-rank FSDP in bf16 on random tokens.
TRAIN_MODEL = {
    "gpu": ["model.dim=1024", "model.num_layers=16", "model.num_heads=16",
            "model.num_kv_heads=4", "model.vocab_size=32768", "model.seq_len=2048",
            "model.tie_embeddings=false", "moe.num_experts=16", "moe.top_k=2",
            "moe.hidden_dim=1408", "train.micro_batch_size=8"],
    "dry": ["model.dim=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
            "model.vocab_size=64", "model.seq_len=32", "model.dense_hidden_dim=64",
            "moe.num_experts=4", "moe.top_k=2", "moe.hidden_dim=16", "train.micro_batch_size=2"],
}
TRAIN_COMMON = ["parallel.ep=1", "parallel.dp=1", "parallel.fsdp=true", "train.dtype=bfloat16",
                "train.eval_every=0", "train.ckpt_every=0", "train.preflight=false",
                "train.warmup_steps=2", "moe.bias_update_speed=0.0"]
TRAIN_STEPS = {"gpu": (3, 8), "dry": (1, 2)}     # (warm-up, measured) steps per variant


def train_variants(has_compile: bool, dry: bool = False) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each train variant: every recompute mode, and the compile axis
    (``train.compile``) as one more entry per mode it allows (not selective: refused
    before launch). A dry run leaves compile out: inductor on a 2-core CPU takes tens of
    seconds per variant, and tests/test_compile.py checks compiled training against eager
    on CPU already."""
    out = []
    for ac in ("none", "selective", "full"):
        out.append((f"ac={ac}", [f"train.activation_checkpointing={ac}"]))
        if has_compile and ac != "selective" and not dry:
            out.append((f"ac={ac},compile", [f"train.activation_checkpointing={ac}",
                                             "train.compile=true"]))
    # DeepSeek-V3's way without MLA: light recomputation, fp8 activation storage and one
    # multi-token-prediction module (its block, the shared chunked head once more)
    out.append(("light-fp8-mtp", ["train.activation_checkpointing=none",
                                  "train.recompute_modules=[norm,moe_act]",
                                  "train.activation_storage=fp8", "model.mtp_depth=1"]))
    return out


def has_train_compile() -> bool:
    from epscale.config.schema import TrainConfig

    return "compile" in {f.name for f in dataclasses.fields(TrainConfig)}


# ------------------------------------------------------------------ context of a stage

@dataclass
class Ctx:
    dry: bool
    device: torch.device
    out: Path
    args: dict = field(default_factory=dict)

    @property
    def size(self) -> str:
        return "dry" if self.dry else "gpu"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def timed(ctx: Ctx, fn: Callable[[], object], reps: int) -> float:
    """Best wall time of ``reps`` calls of ``fn`` after one warm-up (device synchronised)."""
    fn()
    ctx.sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """A one-rank process group (NCCL on CUDA, gloo on CPU) for the stage's process."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def make_moe(shape: dict, dtype: torch.dtype, device: torch.device, **over):
    import epscale

    cfg = dict(dim=shape["D"], hidden_dim=shape["F"], num_experts=shape["E"], top_k=shape["K"],
               score_func="softmax", route_norm=True, experts_impl="grouped_mm")
    cfg.update(over)
    torch.manual_seed(0)
    return epscale.MoE(epscale.MoEConfig(**cfg)).to(device=device, dtype=dtype)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm().clamp_min(1e-30))


def verdict(result: dict, checks: dict[str, bool]) -> dict:
    """``result`` with status 'ok', or 'failed' naming the checks that did not hold."""
    bad = [name for name, ok in checks.items() if not ok]
    result["checks"] = {name: bool(ok) for name, ok in checks.items()}
    result["status"] = "failed" if bad else "ok"
    if bad:
        result["error"] = "check(s) failed: " + ", ".join(bad)
    return result


# ------------------------------------------------------------------ stage: grouped GEMM

def _fwd_bwd(module, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    module.zero_grad(set_to_none=True)
    x.grad = None
    y = module(x)
    y.backward(gy)
    return y


def count_syncs(ctx: Ctx, fn: Callable[[], object]) -> list[tuple[str, str]]:
    """Host syncs of one call of ``fn`` (on CPU: on the code path CUDA takes, every CPU
    tensor standing in for a device one; on a GPU: calls that involve a device tensor)."""
    from epscale.metrics.host_syncs import HostSyncCounter
    from epscale.ops import device_code_path

    ctx.sync()
    cpu = ctx.device.type == "cpu"
    with device_code_path() if cpu else contextlib.nullcontext(), \
            HostSyncCounter(count_cpu=cpu) as counter:
        fn()
    ctx.sync()
    return counter.events


def stage_grouped_gemm(ctx: Ctx) -> dict:
    """The local dropless layer on grouped GEMM: no host sync (CUDA's sync debug mode
    'error' on a GPU, the counter everywhere), its output against an fp32 copy, its step
    time against the per-group loop with host offsets."""
    import warnings

    from moe_layer import near_ties

    shape = GROUPED_SHAPE[ctx.size]
    fast = make_moe(shape, ctx.dtype, ctx.device)
    loop = make_moe(shape, ctx.dtype, ctx.device, use_grouped_mm="never")
    loop.load_state_dict(fast.state_dict())
    exact = copy.deepcopy(fast).float()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape["T"], shape["D"], generator=g).to(ctx.device, ctx.dtype)
    x.requires_grad_(True)
    gy = torch.randn(shape["T"], shape["D"], generator=g).to(ctx.device, ctx.dtype)
    _fwd_bwd(fast, x, gy)   # warm-up: first-call set-up is not the steady state
    events = count_syncs(ctx, lambda: _fwd_bwd(fast, x, gy))
    debug = "n/a on CPU (counted instead)"
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                _fwd_bwd(fast, x, gy)
            debug = "passed"
        except RuntimeError as e:
            debug = f"raised: {str(e).splitlines()[0]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the fp32 copy takes the (warned-about) loop
        ties = near_ties(exact, x.float())
        keep = ~ties if ties is not None else slice(None)
        err = rel_diff(exact(x.float())[keep], fast(x)[keep])
    reps = 1 if ctx.dry else 5
    t_fast = timed(ctx, lambda: _fwd_bwd(fast, x, gy), reps)
    t_loop = timed(ctx, lambda: _fwd_bwd(loop, x, gy), reps)
    res = dict(shape=shape, dtype="bfloat16", host_syncs=len(events),
               sync_places=[f"{w} at {p}" for w, p in events][:8], sync_debug_mode=debug,
               rel_diff_vs_fp32=err, grouped_ms=1e3 * t_fast, loop_ms=1e3 * t_loop,
               speedup_vs_loop=t_loop / t_fast)
    res["headline"] = (f"syncs {len(events)}, sync debug {debug.split(':')[0]}, "
                       f"err {err:.1e}, grouped GEMM at {t_loop / t_fast:.2f}x the loop's speed")
    return verdict(res, {"no host sync": not events,
                         "sync debug mode": debug.startswith(("passed", "n/a")),
                         "output within 5e-2 of fp32": err < 5e-2})


# ------------------------------------------------------------------ stage: layer vs torchtitan

def stage_layer(ctx: Ctx, name: str) -> dict:
    """Ours (grouped GEMM) against torchtitan's MoE at one shape, forward + backward,
    timed in interleaved rounds; their outputs checked to do the same work first."""
    import moe_layer as ml

    ml.DEVICE = ctx.device
    shape = LAYER_SHAPES[ctx.size][name]
    ours = ml.build_epscale(shape, ctx.dtype, impl="grouped_mm")
    titan = ml.build_torchtitan(ours.module, shape, ctx.dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape["T"], shape["D"], generator=g).to(ctx.device, ctx.dtype)
    x.requires_grad_(True)
    gy = torch.randn(shape["T"], shape["D"], generator=g).to(ctx.device, ctx.dtype)
    impls = {"epscale": ours}
    res: dict = dict(shape=shape, dtype="bfloat16", target="epscale >= 1.2x torchtitan")
    if isinstance(titan, str):
        res["torchtitan"] = f"unavailable: {titan}"
    else:
        with torch.no_grad():
            ties = ml.near_ties(ours.module, x)
            res["rel_diff_vs_torchtitan"] = ml.check_same_work(ours.run(x), titan.run(x),
                                                               titan.name, True, ties)
        impls["torchtitan"] = titan
    steps = {k: ml.make_step(i, x, gy) for k, i in impls.items()}
    best = {k: float("inf") for k in steps}
    rounds, reps = (1, 1) if ctx.dry else (3, 3)
    for _ in range(rounds):
        for k, step in steps.items():
            best[k] = min(best[k], timed(ctx, step, reps))
    for k in steps:
        res[f"{k}_ms"] = 1e3 * best[k]
        res[f"{k}_tokens_per_s"] = shape["T"] / best[k]
        if ctx.device.type == "cuda":
            res[f"{k}_peak_mib"] = ml.peak_step_memory(steps[k], impls[k].module, x) / 2 ** 20
    if "torchtitan" in steps:
        ratio = best["torchtitan"] / best["epscale"]
        res.update(vs_torchtitan=ratio, target_met=ratio >= 1.2)
        res["headline"] = f"{ratio:.2f}x torchtitan (target 1.2x)"
    else:
        res["headline"] = (f"epscale {res['epscale_tokens_per_s']:,.0f} tok/s; torchtitan "
                           "unavailable")
    res["status"] = "ok"
    return res


# ------------------------------------------------------------------ stage: a training step

def random_tokens(path: Path, vocab: int, n: int) -> Path:
    """A .bin of ``n`` uniform random token ids (uint16): data that needs no download."""
    import numpy as np

    np.random.default_rng(0).integers(0, vocab, n, dtype=np.uint16).tofile(path)
    return path


def train_config(ctx: Ctx, variant: list[str], data: Path) -> list[str]:
    """The overrides of one train variant (on configs/tiny.yaml); ``--set`` ones last."""
    return (TRAIN_MODEL[ctx.size] + TRAIN_COMMON + [f"data.source={data}"] + variant
            + list(ctx.args.get("set") or []))


def _median_breakdown(recs: list[dict]) -> dict[str, float]:
    keys = {k for r in recs for k in (r.get("time_breakdown") or {})}
    return {k: statistics.median((r.get("time_breakdown") or {}).get(k, 0.0) for r in recs)
            for k in sorted(keys)}


def stage_train(ctx: Ctx, variant: list[str]) -> dict:
    """A few steps of the ~1B MoE on one rank (FSDP, bf16) through the real trainer:
    tokens/s, MFU and the time breakdown (medians of the measured steps), the host syncs
    of one more step, and the peak of allocated memory against describe's estimate."""
    from epscale.commands.describe import describe
    from epscale.config import load_config
    from epscale.metrics.host_syncs import by_place
    from epscale.training.dist import LaunchEnv
    from epscale.training.loop import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-train-"))
    vocab = int(next(o for o in TRAIN_MODEL[ctx.size] if "vocab_size" in o).split("=")[1])
    over = train_config(ctx, variant, random_tokens(tmp / "tokens.bin", vocab,
                                                             1 << (16 if ctx.dry else 22)))
    warm, measured = TRAIN_STEPS[ctx.size]
    over += ["train.steps=1000"]  # no end-of-run evaluation or checkpoint in the steps run
    cfg = load_config(REPO / "configs" / "tiny.yaml", over)
    estimate = describe(str(REPO / "configs" / "tiny.yaml"), over, world=1)["memory"]
    # plain characters only: the device tool leaves out files with odd names
    log = ctx.out / re.sub(r"[^A-Za-z0-9_.-]", "",
                           f"train_{'_'.join(v.split('=')[-1] for v in variant)}.log")
    res: dict = dict(overrides=over, log=str(log))
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    with open(log, "w") as f, contextlib.redirect_stdout(f):
        trainer = Trainer(cfg, tmp / "run", LaunchEnv("none"))
        clean = False
        try:
            trainer.setup()
            t0 = time.perf_counter()
            first = [trainer.train_step() for _ in range(warm)]
            res["warmup_s"] = time.perf_counter() - t0
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            recs = [trainer.train_step() for _ in range(measured)]
            if ctx.device.type == "cuda":
                res["peak_allocated"] = torch.cuda.max_memory_allocated()
            try:  # counted apart: a failure here keeps the figures above
                events = count_syncs(ctx, trainer.train_step)
            except Exception as e:  # noqa: BLE001 - e.g. a compiled graph under the mode
                events, res["sync_count_error"] = None, f"{type(e).__name__}: {e}"[:500]
            clean = True
        finally:
            trainer.close(clean)
    res.update(first_step_s=first[0]["step_time_s"],
               tokens_per_s=statistics.median(r["tokens_per_s"] for r in recs),
               mfu=statistics.median(r["mfu"] for r in recs),
               step_s=statistics.median(r["step_time_s"] for r in recs),
               time_breakdown_s=_median_breakdown(recs), final_loss=recs[-1]["loss"],
               final_mtp_loss=recs[-1].get("mtp_loss"),
               host_syncs_per_step=None if events is None else len(events),
               sync_places=dict(list(by_place(events or []).items())[:10]),
               describe_memory=estimate, target="MFU >= 40%; memory within 5% of describe",
               # graphs torch.compile built over the run: one per block structure (two under
               # full recomputation: the recomputed forward); more means recompilations
               compiled_graphs=counters["stats"]["unique_graphs"] - graphs_before)
    mem = ""
    if "peak_allocated" in res:
        ratio = res["peak_allocated"] / estimate["total"]
        res.update(memory_measured_over_estimate=ratio, memory_target_met=abs(ratio - 1) <= 0.05,
                   mfu_target_met=res["mfu"] >= 0.40)
        mem = f", memory {ratio:.3f}x describe"
    graphs = f", {res['compiled_graphs']} compiled graphs" if "train.compile=true" in variant else ""
    res["headline"] = (f"{res['tokens_per_s']:,.0f} tok/s, MFU {100 * res['mfu']:.1f}%, "
                       f"{'?' if events is None else len(events)} syncs/step{mem}{graphs}")
    res["status"] = "ok"
    return res



# ------------------------------------------------------------------ stage: EP dispatchers

def _run_layer(ctx: Ctx, moe, x: torch.Tensor, gy: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, input gradient and parameter gradients of one forward + backward."""
    from epscale.ops import device_code_path

    path = device_code_path() if ctx.device.type == "cpu" else contextlib.nullcontext()
    with path:
        y = _fwd_bwd(moe, x, gy)
    out = {"y": y.detach(), "dx": x.grad.detach().clone()}
    out.update({n: p.grad.detach().clone() for n, p in moe.named_parameters()
                if p.grad is not None})
    return out


def compare_backends(ctx: Ctx, backends: dict[str, Callable], shape: dict) -> dict:
    """Each backend in a copy of one layer (a shared expert too, overlapped by some
    backends) against the local path: the largest relative difference over the output and
    every gradient, and the host syncs of one forward + backward."""
    base = make_moe(shape, ctx.dtype, ctx.device, num_shared_experts=1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape["T"], shape["D"], generator=g).to(ctx.device, ctx.dtype)
    x.requires_grad_(True)
    gy = torch.randn(shape["T"], shape["D"], generator=g).to(ctx.device, ctx.dtype)
    want = _run_layer(ctx, base, x, gy)
    rows, checks = {}, {}
    for name, make in backends.items():
        moe = copy.deepcopy(base)
        moe.dispatcher = make(shape["E"])
        got = _run_layer(ctx, moe, x, gy)
        worst = max(rel_diff(want[k], got[k]) for k in want)
        events = count_syncs(ctx, lambda: _run_layer(ctx, moe, x, gy))
        limit = 0.1 if "fp8" in name else 2e-2
        rows[name] = dict(max_rel_diff=worst, limit=limit, host_syncs_fwd_bwd=len(events))
        checks[f"{name} within {limit}"] = worst < limit and set(got) == set(want)
    return verdict(dict(backends=rows, shape=shape), checks)


def stage_dispatchers(ctx: Ctx) -> dict:
    """Every EP backend built over a real one-rank group (its collectives run) against the
    local path, output and gradients."""
    from epscale.dispatch.allgather import AllGatherDispatcher
    from epscale.dispatch.alltoall import AllToAllDispatcher
    from epscale.dispatch.comm import CommCounter, GroupInfo
    from epscale.dispatch.dedup import DedupDispatcher
    from epscale.dispatch.hierarchical import HierarchicalDispatcher

    shape = GROUPED_SHAPE[ctx.size] if ctx.dry else dict(E=16, K=4, D=1024, F=512, T=4096)
    with one_rank_group(ctx.device) as world:
        def info():
            return GroupInfo.of(world, 1, CommCounter())
        backends = {
            "allgather": lambda E: AllGatherDispatcher(E, info()),
            "alltoall": lambda E: AllToAllDispatcher(E, info()),
            "dedup": lambda E: DedupDispatcher(E, info()),
            "dedup overlap_chunks=2": lambda E: DedupDispatcher(E, info(), "auto", 2),
            "dedup fp8": lambda E: DedupDispatcher(E, info(), "fp8"),
            "hierarchical": lambda E: HierarchicalDispatcher(E, info(), info(), info()),
            "hierarchical overlap_chunks=2": lambda E: HierarchicalDispatcher(
                E, info(), info(), info(), "auto", 2),
        }
        res = compare_backends(ctx, backends, shape)
    worst = max(r["max_rel_diff"] for r in res["backends"].values())
    res["headline"] = f"{len(backends)} backends, worst rel diff {worst:.1e}"
    return res


def stage_deepep(ctx: Ctx) -> dict:
    """The DeepEP adapter over a one-rank group against the local path (when deep_ep
    imports and CUDA is there)."""
    from types import SimpleNamespace

    from epscale.dispatch.deepep import (DeepEPBuffer, DeepEPDispatcher, deepep_available,
                                         hidden_bytes_of)

    ok, why = deepep_available()
    if not ok:
        return dict(status="skipped", reason=why, headline=f"skipped: {why}")
    shape = dict(E=16, K=4, D=1024, F=512, T=4096)
    with one_rank_group(ctx.device) as world:
        dims = SimpleNamespace(ep_group=world, ep=1, ep_num_nodes=1, ranks_per_node=1)
        buffer = DeepEPBuffer(dims, hidden_bytes_of(shape["D"]))
        res = compare_backends(ctx, {"deepep": lambda E: DeepEPDispatcher(E, dims, buffer)},
                               shape)
    res["headline"] = f"rel diff {res['backends']['deepep']['max_rel_diff']:.1e}"
    return res


# ------------------------------------------------------------------ stage: overlap

OVERLAP = REPO / "benchmarks" / "overlap.py"


def stage_overlap(ctx: Ctx) -> dict:
    """benchmarks/overlap.py: exposed communication with ``parallel.overlap`` auto against
    none. It needs two ranks (ep = 2), so on a one-GPU machine it is skipped (run it on a
    machine with two or more GPUs); a dry run runs its smallest case on gloo CPU processes
    (ep = 2, dedup, 2 steps each way), so the script cannot rot."""
    if not ctx.dry:
        return dict(status="skipped", reason="needs two ranks (ep = 2): one GPU here",
                    headline="skipped: one GPU (run benchmarks/overlap.py on >= 2 GPUs)")
    out = ctx.out / "overlap.json"
    cmd = [sys.executable, str(OVERLAP), "--cases", "ep2-dedup", "--steps", "2",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    res = dict(command=" ".join(cmd), rc=proc.returncode, output_tail=proc.stdout[-3000:],
               stderr_tail=proc.stderr[-3000:])
    if out.exists():
        res["result"] = json.loads(out.read_text())
    res["headline"] = f"rc {proc.returncode}"
    return verdict(res, {"exit code 0": proc.returncode == 0,
                         "a ratio for the case": "ep2-dedup" in res.get("result", {})})


# ------------------------------------------------------------------ running the stages

@dataclass
class Stage:
    name: str
    cap_s: float               # on a GPU; a dry run caps every stage at DRY_CAP_S
    fn: Callable[..., dict]
    args: tuple = ()


# a dry run's cap per stage: the overlap stage (two 2-process trainer launches) takes
# 65-84 s alone on a 2-core VM and passed 120 s in a test run at load average 12
DRY_CAP_S = 240.0
GPU_BUDGET_S = 540.0   # the whole run stays under 10 minutes with the wheels' install


def stages(has_compile: bool, dry: bool = False) -> list[Stage]:
    """Every stage in the order they run, with its cap on a GPU."""
    out = [Stage("grouped_gemm", 60, stage_grouped_gemm)]
    out += [Stage(f"layer:{name}", 80, stage_layer, (name,)) for name in LAYER_SHAPES["gpu"]]
    train = [Stage(f"train:{name}", 90 if "compile" in name else 55, stage_train, (over,))
             for name, over in train_variants(has_compile, dry)]
    out += [t for t in train if "compile" not in t.name]
    out += [Stage("dispatchers", 45, stage_dispatchers), Stage("deepep", 45, stage_deepep),
            Stage("overlap", 60, stage_overlap)]
    # the compile variants last: where the budget runs short, they are what is left out
    return out + [t for t in train if "compile" in t.name]


def _child(stage: Stage, ctx: Ctx, conn) -> None:
    """Runs one stage in its own process and sends back its result (never raises)."""
    try:
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        result = stage.fn(ctx, *stage.args)
    except BaseException as e:  # noqa: BLE001 - a stage's failure is its result
        lines = traceback.format_exc().strip().splitlines()
        result = dict(status="failed", error=f"{type(e).__name__}: {e}"[:2000],
                      traceback=lines[-30:], headline=f"{type(e).__name__}: {e}"[:120])
    try:
        conn.send(json.loads(json.dumps(result, default=str)))
    finally:
        conn.close()


def preload_for_fork() -> None:
    """On CPU the stages are forked: import what they import once, here, rather than in
    every stage's process (seconds each on a small machine). An import that fails is left
    to the stages that need it, which then fail with it (the others still run)."""
    for name in ("epscale.training.loop", "epscale.commands.describe", "epscale.dispatch",
                 "epscale.metrics.host_syncs", "moe_layer"):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - reported by the stage that imports it
            pass


def run_stage(stage: Stage, ctx: Ctx, cap_s: float) -> dict:
    """``stage`` in a child process (fork on CPU, a fresh interpreter on CUDA, whose
    context must not be inherited), stopped at ``cap_s`` seconds."""
    mpc = mp.get_context("spawn" if ctx.device.type == "cuda" else "fork")
    recv, send = mpc.Pipe(duplex=False)
    t0 = time.perf_counter()
    proc = mpc.Process(target=_child, args=(stage, ctx, send), daemon=False)
    proc.start()
    send.close()
    result = None
    if recv.poll(cap_s):
        with contextlib.suppress(EOFError):
            result = recv.recv()
    if result is None:
        if proc.is_alive():
            result = dict(status="timeout", error=f"stopped at its cap of {cap_s:.0f} s",
                          headline=f"timeout after {cap_s:.0f} s")
        else:
            proc.join(5)
            result = dict(status="failed", error=f"the stage's process died (exit code "
                                                 f"{proc.exitcode})",
                          headline=f"process died (exit code {proc.exitcode})")
    proc.join(10)
    if proc.is_alive():
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    result.update(seconds=round(time.perf_counter() - t0, 2), cap_s=cap_s)
    return result


def environment(device: torch.device) -> dict:
    """Versions and the device, for the JSON's header."""
    from importlib import metadata

    pkgs = {}
    for name in ("torchtitan", "transformers", "deep_ep"):
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = None
    env = dict(torch=torch.__version__, python=platform.python_version(), device=str(device),
               packages=pkgs, grouped_mm=hasattr(torch.nn.functional, "grouped_mm"))
    if device.type == "cuda":
        env.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(device),
                   capability=list(torch.cuda.get_device_capability(device)),
                   gpus=torch.cuda.device_count())
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def print_table(report: dict) -> None:
    env = report["environment"]
    where = env.get("gpu") or env.get("cpu")
    print(f"\n== gpu_check{' --dry-run' if report['dry_run'] else ''}: torch {env['torch']}, "
          f"{env['device']} ({where}), {report['wall_s']:.0f} s")
    print(f"{'stage':30s} {'status':8s} {'s':>6s} {'cap':>5s}  result")
    for name, r in report["stages"].items():
        print(f"{name:30s} {r['status']:8s} {r.get('seconds', 0):6.1f} {r.get('cap_s', 0):5.0f}"
              f"  {r.get('headline', r.get('error', ''))}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="every stage on CPU in CI size (tiny shapes, gloo): seconds")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "benchmarks" / "out"),
                    help="folder for the JSON and the logs (default $OUT or benchmarks/out)")
    ap.add_argument("--json", type=Path, default=None, help="default OUT/gpu_check.json")
    ap.add_argument("--only", default=None,
                    help="comma list of stage names or prefixes (e.g. train,layer:mixtral-like)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole run (default {GPU_BUDGET_S:.0f} on a GPU, none "
                         "in a dry run); a stage that would not fit is skipped")
    ap.add_argument("--set", action="append", default=[],
                    help="an extra override for the train stages (key=value; repeatable)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device visible to torch; --dry-run runs every stage on CPU")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args.dry_run, device, args.out, {"set": args.set})
    budget = args.budget if args.budget is not None else (None if args.dry_run else GPU_BUDGET_S)
    todo = stages(has_train_compile(), args.dry_run)
    if device.type == "cpu":
        preload_for_fork()
    if args.only:
        keys = args.only.split(",")
        todo = [s for s in todo if any(s.name == k or s.name.startswith(k + ":") for k in keys)]
    report = dict(benchmark="gpu_check", dry_run=args.dry_run, command=" ".join(sys.argv),
                  budget_s=budget, environment=environment(device), stages={})
    for stage in todo:
        cap = DRY_CAP_S if args.dry_run else stage.cap_s
        if budget is not None:
            left = budget - (time.perf_counter() - t_start)
            if left < min(cap, 20):
                report["stages"][stage.name] = dict(
                    status="skipped", reason=f"the run's budget of {budget:.0f} s ran out",
                    headline="skipped: out of time")
                continue
            cap = min(cap, left)
        print(f"== {stage.name} (cap {cap:.0f} s)", flush=True)
        report["stages"][stage.name] = r = run_stage(stage, ctx, cap)
        print(f"== {stage.name}: {r['status']} in {r['seconds']:.1f} s: "
              f"{r.get('headline', '')}", flush=True)
    report["wall_s"] = time.perf_counter() - t_start
    path = args.json or args.out / "gpu_check.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print_table(report)
    print(f"wrote {path}")
    bad = [n for n, r in report["stages"].items() if r["status"] in ("failed", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
