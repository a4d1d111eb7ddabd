"""Load balancing side by side, in one run (not a test).

    python benchmarks/balance.py                       # both parts (spawns its own processes)
    python benchmarks/balance.py --part synthetic      # part 1 only
    python benchmarks/balance.py --part train          # part 2 only (runs `epscale train` 8x)

Part 1 (synthetic skew): EP ranks run the real MoE layer (real dispatch, grouped experts,
combine, forward and backward) on routing drawn from a Zipf law over the experts whose
ranking drifts every step (a random walk of each expert's popularity score), for Zipf
exponents 0.8 and 1.2. What is synthetic: the router's preference (Zipf log-popularity
plus Gumbel noise, so the top-k is a draw without replacement from the Zipf law, plus a
small real gate). What is real: everything from the top-k on, and the balancing:
  none       contiguous EP, routing left alone
  aux        the Switch aux loss (coefficient --aux-coeff) through the real layer, trained
             into the router (gate + a per-expert logit offset) by SGD (--aux-lr); there is
             no language-model loss pulling the other way, so this is its best case
  loss-free  epscale.moe.balance.update_expert_biases after every step (u = --u), sign rule
  adaptive   the same with moe.bias_update_rule=adaptive
  +N slots   redundant experts: parallelize(placement=...) + Rebalancer re-planning every --every
             steps from the last --every steps' loads (weights move between ranks)
  spill      apply_spill (threshold 1.3, min 32 rows per piece)
Per step and rank it records the rows each rank's experts compute, the CPU time of its
expert forward (thread time, so it is not distorted by processes sharing cores), the CPU
time of the whole step, and the wall time of the step; worst-rank idle = max over ranks
of 1 - t_r / max_r t_r, averaged over the measured steps.

Part 2 (real training): ``epscale train --config configs/tiny.yaml`` with no balancing,
the aux loss (0.01), loss-free balancing with the sign rule (u = 1e-3, the DeepSeek-V3
value, and the faster 3e-3 and 1e-2) and with the adaptive rule (u = 1e-3, 3e-3), and
no balancing plus 2 redundant expert slots re-planned every 10 steps; same seed and data:
MaxVio_batch per step (from metrics.jsonl), MaxVio_global, the swing (lag-1
autocorrelation of the expert loads: negative when they alternate step to step), the
worst-rank idle fraction and the final validation loss.

Outputs: tables on stdout, benchmarks/out/balance_*.json and balance_*.png.
Legend: T tokens per rank, D model dim, F expert hidden dim, E experts, K top-k.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from epscale.metrics.balance import RunningMaxVio

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["all", "synthetic", "train"], default="all")
    p.add_argument("--tag", default="", help="suffix of the output files (json, png)")
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=30, help="measured steps per strategy")
    p.add_argument("--warmup", type=int, default=5,
                   help="unmeasured steps (>= --every, so placement is measured after its first re-plan)")
    p.add_argument("--zipf", default="0.8,1.2")
    p.add_argument("--drift", type=float, default=0.03,
                   help="std of the popularity walk per step (scores start N(0, 1))")
    p.add_argument("--dispatcher", default="alltoall")
    p.add_argument("--u", type=float, default=0.1,
                   help="loss-free step; this router's bias is in logit units, where the Zipf "
                        "log-popularity spans ~s*ln(E), so u is larger than the 1e-3 used on "
                        "softmax/sigmoid scores")
    p.add_argument("--aux-coeff", type=float, default=0.01)
    p.add_argument("--aux-lr", type=float, default=20.0)
    p.add_argument("--every", type=int, default=5, help="re-placement period (steps)")
    p.add_argument("--extra-slots", default="1,2", help="redundant slots per rank")
    p.add_argument("--strategies", default="none,aux,loss-free,adaptive,placement,spill,spill@1.1",
                   help="spill@X: spill-over with threshold X (plain spill: the default 1.3)")
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--reuse-runs", action="store_true",
                   help="part 2: read finished runs in benchmarks/out instead of training again")
    p.add_argument("--train-runs", default=",".join(DEFAULT_TRAIN_RUNS))
    p.add_argument("--json", default=None,
                   help="also write the headline figures of the parts run to this file")
    p.add_argument("--seeds", type=int, default=1,
                   help="part 2: runs per strategy (train.seed and data.seed moved by 1..N-1)")
    return p.parse_args()


# ====================================================================== part 1
class DriftingZipfRouter(nn.Module):
    """Router whose preference follows a drifting Zipf law (see the module docstring).

    Selection: top-k of (log p_zipf(step) + gate(x) + offset + Gumbel) + expert_bias.
    Gate weights: softmax of (log p + gate(x) + offset), renormalised over the k chosen.
    ``offset`` is what the aux loss trains; ``expert_bias`` is what loss-free moves.
    """

    def __init__(self, cfg, zipf_s: float, drift: float, rank: int, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        E = cfg.num_experts
        self.gate = nn.Linear(cfg.dim, E, bias=False)
        nn.init.normal_(self.gate.weight, std=0.02)
        self.offset = nn.Parameter(torch.zeros(E))
        self.register_buffer("expert_bias", torch.zeros(E))
        if cfg.bias_update_rule == "adaptive":
            self.register_buffer("expert_bias_step", torch.zeros(E))
            self.register_buffer("expert_bias_sign", torch.zeros(E))
        self.zipf_s, self.drift, self.rank, self.seed = zipf_s, drift, rank, seed
        self.step = 0
        g = torch.Generator().manual_seed(seed)          # same walk on every rank
        self._walk = g
        self._score = torch.randn(E, generator=g)

    def advance(self) -> None:
        self.step += 1
        self._score += self.drift * torch.randn(self._score.shape, generator=self._walk)

    def log_popularity(self) -> torch.Tensor:
        E = self._score.numel()
        ranks = torch.empty(E)
        ranks[torch.argsort(-self._score)] = torch.arange(1, E + 1, dtype=torch.float32)
        p = 1.0 / ranks ** self.zipf_s
        return torch.log(p / p.sum())

    def forward(self, x_TD):
        from epscale.moe.router import RouterOutput

        T, E, K = x_TD.shape[0], self.cfg.num_experts, self.cfg.top_k
        logits = self.gate(x_TD.float()) + self.log_popularity() + self.offset
        scores = logits.softmax(-1)
        g = torch.Generator().manual_seed(hash((self.seed, self.rank, self.step)) % 2**31)
        u = torch.rand(T, E, generator=g).clamp(1e-9, 1 - 1e-9)
        chosen = (logits.detach() - torch.log(-torch.log(u)) + self.expert_bias).topk(K, -1).indices
        w = scores.gather(1, chosen)
        w = w / w.sum(-1, keepdim=True)
        return RouterOutput(chosen, w, scores, logits, chosen, 0)


class ExpertMeter:
    """Forward hooks on the experts module: rows and thread CPU time of every call (the
    layer's own call and, under spill-over, the helper call)."""

    def __init__(self, experts: nn.Module):
        self.rows, self.cpu = 0, 0.0
        self._t0 = 0.0
        experts.register_forward_pre_hook(self._pre)
        experts.register_forward_hook(self._post)

    def _pre(self, mod, args):
        self._t0 = time.thread_time()

    def _post(self, mod, args, out):
        self.cpu += time.thread_time() - self._t0
        self.rows += int(args[0].shape[0])

    def take(self):
        out = (self.rows, self.cpu)
        self.rows, self.cpu = 0, 0.0
        return out


def _build_layer(a, strategy, zipf_s, dims, rank):
    import epscale
    from epscale.placement import apply_spill, plan_placement

    E = a.experts
    cfg = epscale.MoEConfig(dim=a.dim, hidden_dim=a.hidden, num_experts=E, top_k=a.top_k,
                            aux_loss_coeff=a.aux_coeff if strategy == "aux" else 0.0,
                            bias_update_rule="adaptive" if strategy == "adaptive" else "sign")
    torch.manual_seed(0)
    moe = epscale.MoE(cfg)
    moe.router = DriftingZipfRouter(cfg, zipf_s, a.drift, rank)
    extra = 0
    if strategy.startswith("+"):
        extra = int(strategy[1:].split()[0]) // dims.ep
        pl = plan_placement(torch.ones(E), E + extra * dims.ep, 1, dims.ep)  # no knowledge yet
        epscale.parallelize(moe, dims, dispatcher=a.dispatcher, placement=pl)
    else:
        epscale.parallelize(moe, dims, dispatcher=a.dispatcher)
        if strategy.startswith("spill"):
            threshold = float(strategy.split("@")[1]) if "@" in strategy else 1.3
            apply_spill(moe, dims, threshold=threshold, min_rows=32)
    return moe


def _run_strategy(a, strategy, zipf_s, dims, rank, world):
    from epscale.metrics.balance import max_vio
    from epscale.moe.balance import update_expert_biases
    from epscale.placement import Rebalancer, sync_replica_gradients

    moe = _build_layer(a, strategy, zipf_s, dims, rank)
    meter = ExpertMeter(moe.experts)
    reb = Rebalancer(moe, dims, every=a.every) if strategy.startswith("+") else None
    router_params = [moe.router.gate.weight, moe.router.offset]
    g = torch.Generator().manual_seed(1234 + rank)
    rows_hist = []
    for step in range(a.warmup + a.steps):
        x = torch.randn(a.tokens, a.dim, generator=g)
        dist.barrier()
        t_wall, t_cpu = time.perf_counter(), time.thread_time()
        moe.zero_grad(set_to_none=True)
        y = moe(x)
        loss = y.float().pow(2).mean() + moe.aux_loss
        loss.backward()
        if strategy == "aux":
            grads = torch.cat([p.grad.reshape(-1) for p in router_params])
            dist.all_reduce(grads)
            grads /= world
            with torch.no_grad():
                off = 0
                for p in router_params:
                    n = p.numel()
                    p -= a.aux_lr * grads[off:off + n].view_as(p)
                    off += n
        counts = moe.tokens_per_expert.detach().to(torch.float64).clone()
        dist.all_reduce(counts)  # the step's logical loads (what the metrics record holds)
        if strategy in ("loss-free", "adaptive"):
            update_expert_biases(moe, dims, a.u, counts[None])
        if reb is not None:
            sync_replica_gradients(moe, dims)
            reb.observe(counts[None])
            reb.maybe_replace(step + 1)
        moe.reset_token_counts()
        moe.router.advance()
        cpu = time.thread_time() - t_cpu
        wall = time.perf_counter() - t_wall
        rows, exp_cpu = meter.take()
        stats = torch.tensor([rows, exp_cpu, cpu, wall], dtype=torch.float64)
        allst = [torch.zeros(4, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(allst, stats)
        if step >= a.warmup:
            st = torch.stack(allst).tolist()
            rows_hist.append({"step": step - a.warmup, "rank_rows": [s[0] for s in st],
                              "rank_expert_cpu": [s[1] for s in st],
                              "rank_step_cpu": [s[2] for s in st],
                              "step_wall": max(s[3] for s in st),
                              "max_vio": max_vio(counts.tolist())})
    return rows_hist


def _worst_idle(vals):
    peak = max(vals)
    return max(1.0 - v / peak for v in vals) if peak > 0 else 0.0


def _summary(hist):
    return {
        "idle_rows": statistics.mean(_worst_idle(h["rank_rows"]) for h in hist),
        "idle_expert_cpu": statistics.mean(_worst_idle(h["rank_expert_cpu"]) for h in hist),
        "idle_step_cpu": statistics.mean(_worst_idle(h["rank_step_cpu"]) for h in hist),
        "max_rank_rows": statistics.mean(max(h["rank_rows"]) for h in hist),
        "max_expert_cpu_ms": 1e3 * statistics.mean(max(h["rank_expert_cpu"]) for h in hist),
        "max_step_cpu_ms": 1e3 * statistics.mean(max(h["rank_step_cpu"]) for h in hist),
        "step_wall_ms": 1e3 * statistics.median(h["step_wall"] for h in hist),
        "max_vio": statistics.mean(h["max_vio"] for h in hist),
    }


def _synthetic_worker(rank, world, a):
    import epscale

    dims = epscale.ParallelDims(dp=1, ep=world)
    strategies = []
    for s in a.strategies.split(","):
        if s == "placement":
            strategies += [f"+{int(n) * world} slots" for n in a.extra_slots.split(",")]
        else:
            strategies.append(s)
    results = {}
    for zipf_s in [float(z) for z in a.zipf.split(",")]:
        for strategy in strategies:
            t0 = time.perf_counter()
            hist = _run_strategy(a, strategy, zipf_s, dims, rank, world)
            results[f"{zipf_s}|{strategy}"] = {"history": hist, "summary": _summary(hist)}
            if rank == 0:
                sm = results[f"{zipf_s}|{strategy}"]["summary"]
                print(f"  zipf {zipf_s} {strategy:>10}: idle(rows) {sm['idle_rows']:.3f} "
                      f"idle(expert cpu) {sm['idle_expert_cpu']:.3f} "
                      f"[{time.perf_counter() - t0:.0f}s]", flush=True)
    return results


def _entry(rank, world, port, a, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if os.environ.get("BALANCE_DEBUG"):
        import faulthandler
        faulthandler.dump_traceback_later(int(os.environ["BALANCE_DEBUG"]), exit=True)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    try:
        out = _synthetic_worker(rank, world, a)
        if rank == 0:
            q.put(out)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def part_synthetic(a) -> dict:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT / "tests"))
    from dist_utils import free_port

    print(f"Part 1: synthetic drifting-Zipf routing, EP={a.ep}, E={a.experts}, top-{a.top_k}, "
          f"T={a.tokens}/rank, D={a.dim}, F={a.hidden}, {a.steps} measured steps "
          f"(+{a.warmup} warm-up), dispatcher {a.dispatcher}", flush=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, a.ep, port, a, q)) for r in range(a.ep)]
    for p in procs:
        p.start()
    results = q.get()
    for p in procs:
        p.join()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"balance_synthetic{a.tag}.json").write_text(json.dumps({"args": vars(a), "results": results}))
    _print_synthetic(results)
    _plot_synthetic(results, a)
    return results


def _print_synthetic(results):
    print("\nworst-rank idle fraction (mean over steps) and step cost; ratios vs 'none'.\n"
          "step cpu ms = the slowest rank's CPU time per step (the step time if every rank had\n"
          "its own core); wall ms = median wall time (distorted when ranks share cores)")
    hdr = (f"{'zipf':>4} {'strategy':>12} {'idle rows':>9} {'idle exp-cpu':>12} "
           f"{'idle step-cpu':>13} {'max rows':>8} {'max exp ms':>10} {'step cpu ms':>11} "
           f"{'cpu/none':>8} {'wall ms':>8} {'wall/none':>9} {'MaxVio':>6}")
    print(hdr)
    for key, r in results.items():
        zipf_s, strategy = key.split("|")
        base = results[f"{zipf_s}|none"]["summary"]
        s = r["summary"]
        print(f"{zipf_s:>4} {strategy:>12} {s['idle_rows']:9.3f} {s['idle_expert_cpu']:12.3f} "
              f"{s['idle_step_cpu']:13.3f} {s['max_rank_rows']:8.0f} {s['max_expert_cpu_ms']:10.1f} "
              f"{s['max_step_cpu_ms']:11.1f} {s['max_step_cpu_ms'] / base['max_step_cpu_ms']:8.2f} "
              f"{s['step_wall_ms']:8.1f} {s['step_wall_ms'] / base['step_wall_ms']:9.2f} "
              f"{s['max_vio']:6.2f}")


def _plot_synthetic(results, a):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    zipfs = sorted({k.split("|")[0] for k in results})
    fig, axes = plt.subplots(1, len(zipfs), figsize=(6 * len(zipfs), 4), squeeze=False)
    for ax, z in zip(axes[0], zipfs):
        for key, r in results.items():
            zs, strategy = key.split("|")
            if zs != z:
                continue
            ys = [_worst_idle(h["rank_expert_cpu"]) for h in r["history"]]
            ax.plot(ys, label=strategy)
        ax.axhline(0.05, color="grey", ls=":", lw=1)
        ax.set_title(f"Zipf s={z}: worst-rank idle (expert CPU time)")
        ax.set_xlabel("step")
        ax.set_ylabel("1 - t_r / max t")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    fig.suptitle(f"EP={a.ep}, {a.experts} experts, top-{a.top_k}, drifting routing", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / f"balance_synthetic{a.tag}.png", dpi=110)
    plt.close(fig)


# ====================================================================== part 2
TRAIN_RUNS = {
    "none": ["moe.aux_loss_coeff=0.0", "moe.bias_update_speed=0.0"],
    "aux": ["moe.aux_loss_coeff=0.01", "moe.bias_update_speed=0.0"],
    "loss-free": ["moe.aux_loss_coeff=0.0", "moe.bias_update_speed=0.001",
                  "moe.bias_update_rule=sign"],
    "loss-free u=3e-3": ["moe.aux_loss_coeff=0.0", "moe.bias_update_speed=0.003",
                         "moe.bias_update_rule=sign"],
    "loss-free u=1e-2": ["moe.aux_loss_coeff=0.0", "moe.bias_update_speed=0.01",
                         "moe.bias_update_rule=sign"],
    "adaptive u=1e-3": ["moe.aux_loss_coeff=0.0", "moe.bias_update_speed=0.001",
                        "moe.bias_update_rule=adaptive"],
    "adaptive u=3e-3": ["moe.aux_loss_coeff=0.0", "moe.bias_update_speed=0.003",
                        "moe.bias_update_rule=adaptive"],
    "none +2 slots": ["moe.aux_loss_coeff=0.0", "moe.bias_update_speed=0.0",
                      "parallel.redundant_experts=2", "parallel.rebalance_every=10"],
    # Not in the default list: 4x the recipe's batch (4,096 tokens per step), to see how
    # much of MaxVio_batch is the batch's content.
    "adaptive u=1e-3 4x batch": ["moe.aux_loss_coeff=0.0", "moe.bias_update_speed=0.001",
                                 "moe.bias_update_rule=adaptive", "train.micro_batch_size=16"],
    "none 4x batch": ["moe.aux_loss_coeff=0.0", "moe.bias_update_speed=0.0",
                      "train.micro_batch_size=16"],
}
DEFAULT_TRAIN_RUNS = [n for n in TRAIN_RUNS if "4x batch" not in n]


def part_train(a) -> dict:
    print(f"\nPart 2: epscale train --config configs/tiny.yaml, {a.train_steps} steps per run",
          flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in a.train_runs.split(","):
        per_seed = []
        for seed in range(a.seeds):
            r = _train_run(a, name, seed)
            if r is not None:
                per_seed.append(r)
        if per_seed:
            results[name] = per_seed[0]
            results[name]["seeds"] = [_last100(r) for r in per_seed]
    (OUT / f"balance_train{a.tag}.json").write_text(json.dumps(results))
    _print_train(results)
    _print_frozen(results)
    if a.seeds > 1:
        _print_seeds(results)
    _plot_train(results, a.tag)
    return results


def _train_run(a, name: str, seed: int) -> dict | None:
    """One `epscale train` run of part 2 (seed 0: the recipe's seeds; seed i: train.seed
    and data.seed moved by i) and its balance figures; None when it failed."""
    suffix = f"_seed{seed}" if seed else ""
    run_dir = OUT / f"balance_train_{name.replace(' ', '_').replace('=', '')}{suffix}"
    label = f"{name} (seed {seed})" if seed else name
    done = run_dir / "metrics.jsonl"
    took = float("nan")
    if a.reuse_runs and done.exists() and '"event":"end"' in done.read_text():
        print(f"  {label}: reusing the finished run in {run_dir}", flush=True)
    else:
        if run_dir.exists():
            import shutil
            shutil.rmtree(run_dir)
        seeds = [f"train.seed={1234 + seed}", f"data.seed={seed}"] if seed else []
        cmd = [sys.executable, "-m", "epscale", "train", "--config",
               str(ROOT / "configs/tiny.yaml"), "--run-dir", str(run_dir),
               f"train.steps={a.train_steps}", f"train.eval_every={max(a.train_steps // 3, 1)}",
               "train.ckpt_every=0", *TRAIN_RUNS[name], *seeds]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        took = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"  {label}: epscale train failed (exit {proc.returncode}):\n"
                  f"{proc.stderr[-2000:]}")
            return None
    steps = [json.loads(line) for line in done.read_text().splitlines() if line.strip()]
    steps = [r for r in steps if "step" in r and "layers" in r]
    vio = [max(lay["max_vio"] for lay in r["layers"]) for r in steps]
    vio_mean = [statistics.mean(lay["max_vio"] for lay in r["layers"]) for r in steps]
    idle = [r.get("worst_rank_idle", float("nan")) for r in steps]
    vals = [(r["step"], r["val_loss"]) for r in steps if "val_loss" in r]
    # MaxVio_global: the loads summed over the last 100 steps, per layer
    window = RunningMaxVio(window=100)
    glob_hist, glob = [], []
    for r in steps:
        glob = window.update([lay["tokens_per_expert"] for lay in r["layers"]])
        glob_hist.append(max(glob))
    # Swing: lag-1 autocorrelation of each expert's load deviation (last 100 steps,
    # mean over experts and layers); negative = loads alternate step to step.
    swing = []
    for li in range(len(steps[-1]["layers"])):
        c = np.asarray([r["layers"][li]["tokens_per_expert"] for r in steps[-100:]], float)
        d = c / c.mean(axis=1, keepdims=True) - 1.0
        swing += [np.corrcoef(d[:-1, e], d[1:, e])[0, 1] for e in range(c.shape[1])
                  if d[:, e].std() > 0]
    frozen = _frozen_router_vio(run_dir) if seed == 0 else None
    timing = f" in {took:.0f}s" if took == took else ""
    print(f"  {label}: {len(steps)} steps{timing}, final val loss "
          f"{vals[-1][1] if vals else float('nan'):.4f}", flush=True)
    return {"steps": [r["step"] for r in steps], "max_vio": vio,
            "frozen_router_vio": frozen,
            "swing": float(np.mean(swing)) if swing else float("nan"),
            "mean_layer_max_vio": vio_mean, "worst_rank_idle": idle,
            "global_max_vio_last100": glob, "global_max_vio": glob_hist,
            "loss": [r["loss"] for r in steps], "val": vals, "seconds": took}


def _last100(r: dict) -> dict:
    n = len(r["max_vio"])
    last = slice(max(0, n - 100), n)
    return {"val": r["val"][-1][1] if r["val"] else float("nan"),
            "max_vio_batch": statistics.mean(r["mean_layer_max_vio"][last]),
            "max_vio_global": statistics.mean(r["global_max_vio_last100"]),
            "idle": statistics.mean(r["worst_rank_idle"][last])}


def _print_seeds(results):
    print("\nOver seeds (train.seed and data.seed moved together): mean [min, max] of the final "
          "validation loss,\nMaxVio_batch (mean layer, last 100 steps), MaxVio_global (mean "
          "layer) and worst-rank idle")
    for name, r in results.items():
        rows = r["seeds"]
        cells = []
        for key in ("val", "max_vio_batch", "max_vio_global", "idle"):
            v = [x[key] for x in rows]
            cells.append(f"{statistics.mean(v):.3f} [{min(v):.3f}, {max(v):.3f}]")
        print(f"{name:>16} ({len(rows)} seeds) val {cells[0]}  batch {cells[1]}  "
              f"global {cells[2]}  idle {cells[3]}")


FROZEN_BATCHES = (8, 32, 128)  # sequences per batch for the frozen-router check


def _frozen_router_vio(run_dir: Path, num_tokens: int = 32768) -> dict[int, float] | None:
    """MaxVio_batch (mean over layers and batches) of the run's final model with its router
    and bias frozen, on random training batches of 8, 32 and 128 sequences (num_tokens in
    all per size). Separates what a batch's content does (falls with the batch size) from
    where the bias left the balance (does not)."""
    from epscale.training import checkpoint as ckpt
    from epscale.config import load_config
    from epscale.training.data import load_splits
    from epscale.model import build_model
    from epscale.training.dist import SingleProcessDims

    found = ckpt.latest_valid(run_dir, report=lambda _m: None)
    if found is None:
        return None
    cfg = load_config(run_dir / "config.yaml", [])
    model = build_model(cfg)
    ckpt.load(found[0], model, None, SingleProcessDims(), restore_rng=False)
    model.eval()
    toks = load_splits(cfg.data, cfg.model.vocab_size).train
    S = cfg.model.seq_len
    rng = np.random.default_rng(0)
    out = {}
    for B in FROZEN_BATCHES:
        vio = []
        for _ in range(max(1, num_tokens // (B * S))):
            starts = rng.integers(0, len(toks) - S - 1, size=B)
            x = torch.from_numpy(np.stack([toks[i:i + S] for i in starts]).astype(np.int64))
            with torch.no_grad():
                model(x)
            for m in model.moe_layers():
                c = m.last_stats["tokens_per_expert"].double()
                vio.append(float(c.max() / c.mean() - 1))
        out[B] = statistics.mean(vio)
    return out


def _print_train(results):
    print("\nMaxVio_batch (worst layer and mean over layers; mean over the last 100 steps), "
          "MaxVio_global\n(loads summed over the last 100 steps; worst / mean layer), worst-rank "
          "idle (last 100), final validation loss")
    print(f"{'run':>16} {'MaxVio first10':>14} {'MaxVio last100':>14} {'mean-layer last100':>18} "
          f"{'global worst/mean':>17} {'swing':>6} {'idle last100':>12} {'final val':>9} "
          f"{'val - none':>10}")
    base = results.get("none", {}).get("val")
    for name, r in results.items():
        n = len(r["max_vio"])
        last = slice(max(0, n - 100), n)
        fv = r["val"][-1][1] if r["val"] else float("nan")
        dv = fv - base[-1][1] if base else float("nan")
        print(f"{name:>16} {statistics.mean(r['max_vio'][:10]):14.3f} "
              f"{statistics.mean(r['max_vio'][last]):14.3f} "
              f"{statistics.mean(r['mean_layer_max_vio'][last]):18.3f} "
              f"{max(r['global_max_vio_last100']):8.3f} /{statistics.mean(r['global_max_vio_last100']):7.3f} "
              f"{r.get('swing', float('nan')):+6.2f} "
              f"{statistics.mean(r['worst_rank_idle'][last]):12.3f} {fv:9.4f} {dv:+10.4f}")


def _print_frozen(results):
    print("\nFinal model, router and bias frozen: MaxVio_batch (mean over layers) on random "
          "training batches of\n" + ", ".join(f"{b} x 128 tokens" for b in FROZEN_BATCHES))
    for name, r in results.items():
        f = r.get("frozen_router_vio")
        if f:
            print(f"{name:>16} " + " ".join(f"{f[b] if b in f else f[str(b)]:8.3f}"
                                            for b in FROZEN_BATCHES))


def _plot_train(results, tag: str = ""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(v, k):
        v = np.asarray(v, dtype=float)
        return np.convolve(v, np.ones(k) / k, mode="valid") if len(v) >= k else v

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for name, r in results.items():
        steps = r["steps"]
        v = smooth(r["max_vio"], 10)
        line, = axes[0].plot(steps[len(steps) - len(v):], v, label=name)
        c = line.get_color()
        axes[1].plot(steps, r["global_max_vio"], label=name, color=c)
        idle = smooth(r["worst_rank_idle"], 10)
        axes[2].plot(steps[len(steps) - len(idle):], idle, label=name, color=c)
        loss = smooth(r["loss"], 25)
        axes[3].plot(steps[len(steps) - len(loss):], loss, label=name, color=c)
        if r["val"]:
            axes[3].plot(*zip(*r["val"]), "o", ms=4, color=c)
    for ax in axes[:2]:
        ax.axhline(0.2, color="grey", ls=":", lw=1)
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes[0].set_title("MaxVio_batch (worst layer, 10-step mean)")
    axes[1].set_title("MaxVio_global (worst layer, last 100 steps' loads)")
    axes[2].set_title("worst-rank idle fraction (10-step mean)")
    axes[3].set_title("training loss (25-step mean), validation (dots)")
    axes[3].set_ylim(1.85, 2.8)
    fig.tight_layout()
    fig.savefig(OUT / f"balance_train{tag}.png", dpi=100)
    plt.close(fig)


def main() -> None:
    a = parse()
    out = {"benchmark": "balance", "args": vars(a)}
    if a.part in ("all", "synthetic"):
        out["synthetic"] = part_synthetic(a)
    if a.part in ("all", "train"):
        out["train"] = part_train(a)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
