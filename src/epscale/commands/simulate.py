"""``epscale simulate CONFIG --cluster NAME|FILE``: one training step of a recipe on a
described cluster, for each balancing strategy and dispatcher, as a table and a plot.
``--precision``/``--tp``/``--recompute-modules``/``--comm-sms``/``--p2p-overlap`` set the
run's features the recipe does not carry (:class:`epscale.plan.shapes.Work`);
``--overlap-from RUN_DIR --overlap-cluster CLUSTER`` scales the model's hidden
communication by what that run measured (:mod:`epscale.plan.overlap`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..config import ConfigError, load_recipe
from ..plan.balance import STRATEGIES, BalanceParams
from ..plan.cluster import PRESETS, load_cluster
from ..plan.overlap import assumption, calibration_from, simulate_pair
from ..plan.routing import RoutingSpec
from ..plan.shapes import CONFIG_RECOMPUTE, PRECISIONS, RECOMPUTE_MODULES, Work
from ..plan.step_model import DISPATCHERS, OVERLAPS, SimResult, simulate
from .args import add_overlap_calibration


def configure_parser(p) -> None:
    p.add_argument("config", help="recipe name (e.g. ref-1t-64e) or YAML path")
    p.add_argument("--cluster", default="field-report",
                   help=f"preset ({', '.join(PRESETS)}) or cluster YAML (from epscale calibrate)")
    p.add_argument("--set", dest="cluster_overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="override a cluster field, e.g. --set nodes=16")
    p.add_argument("--routing", action="append", default=None,
                   help="uniform | zipf[:s] | trace:RUN_DIR (repeatable; default zipf:1.0)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma list of none, aux, loss_free, redundant, spill or '+' combos")
    p.add_argument("--dispatchers", default=",".join(DISPATCHERS), help="comma list")
    p.add_argument("--overlap", choices=OVERLAPS, default=None,
                   help="none | chunks | full (default: what the trainer runs: none under "
                   "parallel.overlap: none, full with parallel.overlap_micro_batches, chunks "
                   "when parallel.overlap_chunks > 1, else none)")
    p.add_argument("--ep", type=int, default=None, help="EP group size (default: the recipe's)")
    p.add_argument("--aux-residual", type=float, default=BalanceParams.aux_residual,
                   help="exponent the aux loss leaves on the router weights (model assumption)")
    p.add_argument("--loss-free-residual", type=float, default=BalanceParams.loss_free_residual)
    p.add_argument("--redundant-per-rank", type=int, default=BalanceParams.redundant_per_rank)
    work = p.add_argument_group("work: the run's features the recipe does not carry "
                                "(epscale.plan.shapes.Work)")
    work.add_argument("--precision", choices=PRECISIONS, default=Work.precision,
                      help="GEMM precision of the linear layers (fp8 needs the cluster's fp8_tflops)")
    work.add_argument("--tp", type=int, default=Work.tp,
                      help="tensor-parallel ranks of the non-expert blocks (sequence parallel)")
    work.add_argument("--recompute-modules", default=None, metavar="A,B",
                      help=f"comma list of train.recompute_modules' names "
                           f"({', '.join(CONFIG_RECOMPUTE)}) or Megatron's "
                           f"({', '.join(RECOMPUTE_MODULES)}) recomputed in "
                           "backward (default: the recipe's train.activation_checkpointing; "
                           "'' recomputes nothing)")
    work.add_argument("--comm-sms", type=int, default=Work.comm_sms,
                      help="SMs the overlapped dispatch kernels hold (GPU clusters)")
    work.add_argument("--p2p-overlap", action="store_true",
                      help="a looped or V pipeline hides its p2p even without overlap")
    add_overlap_calibration(p, "overlap calibration (epscale.plan.overlap)")
    p.add_argument("--layers", action="store_true",
                   help="also print the per-MoE-layer breakdown of the fastest configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="PNG path (default simulate-RECIPE-CLUSTER.png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", default=None, help="also write all results (with per-layer detail) here")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    # key=value overrides may follow options (CONFIG --opt X key=value): plain parse_args
    # stops filling positionals after the first option.
    p.parse_args = p.parse_intermixed_args


def work_of(args) -> Work:
    """The :class:`Work` the options give (checked by the step model, which names them)."""
    mods = args.recompute_modules
    if mods is not None:  # train.recompute_modules' names or Megatron's, as the help says
        mods = tuple(CONFIG_RECOMPUTE.get(m.strip(), m.strip())
                     for m in mods.split(",") if m.strip())
    return Work(precision=args.precision, tp=args.tp, recompute_modules=mods,
                comm_sms=args.comm_sms, p2p_overlap=args.p2p_overlap)


def run(args) -> int:
    from rich.console import Console

    console = Console(width=max(Console().width, 150))
    cfg = load_recipe(args.config, args.overrides)
    cluster = load_cluster(args.cluster, args.cluster_overrides)
    params = BalanceParams(aux_residual=args.aux_residual,
                           loss_free_residual=args.loss_free_residual,
                           redundant_per_rank=args.redundant_per_rank)
    routings = [RoutingSpec.parse(r) for r in (args.routing or ["zipf:1.0"])]
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    dispatchers = tuple(d.strip() for d in args.dispatchers.split(",") if d.strip())
    work = work_of(args)
    cal = (calibration_from(args.overlap_from, args.overlap_cluster, work=work, seed=args.seed)
           if args.overlap_from else None)
    all_rows = []
    t0 = time.perf_counter()
    for routing in routings:
        kw = dict(strategies=strategies, dispatchers=dispatchers, ep=args.ep, params=params,
                  seed=args.seed, work=work, routing=routing)
        if cal is None:
            res = simulate(cfg, cluster, overlap=args.overlap, **kw)
        else:
            res = [cal.apply(r, none) for r, none in simulate_pair(cfg, cluster, args.overlap, **kw)]
        all_rows.append((routing, res))
    elapsed = time.perf_counter() - t0
    ep = args.ep or cfg.parallel.ep
    pp_text = f"pp={cfg.parallel.pp} ({cfg.parallel.pp_schedule}), " if cfg.parallel.pp > 1 else ""
    console.print(f"[bold]{cfg.name}[/] on [bold]{cluster.name}[/]: {cluster.world} GPUs "
                  f"({cluster.nodes} x {cluster.gpus_per_node}), {pp_text}ep={ep}, "
                  f"dp={cluster.world // cfg.parallel.pp // ep}, "
                  f"{cfg.moe.num_experts} experts top-{cfg.moe.top_k}, "
                  f"{cfg.train.micro_batch_size * cfg.model.seq_len} tokens/GPU/micro-batch x "
                  f"{cfg.train.grad_accum}; simulated in {elapsed:.2f} s")
    if cal is None:
        console.print(f"[dim]overlap: {assumption(cfg, args.overlap)['source']}[/]")
    else:
        console.print("\n".join(cal.lines()))
    for routing, res in all_rows:
        console.print(results_table(res, f"routing {routing.label()}"))
        best = max(res, key=lambda r: r.tokens_per_s_per_gpu)
        console.print(f"fastest: [bold]{best.strategy} + {best.dispatcher}[/] "
                      f"{best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, worst-GPU idle "
                      f"{best.worst_idle_share:.1%}, expert communication {best.comm_share:.1%}")
        if args.layers:
            console.print(layers_table(best))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"recipe": cfg.name, "cluster": cluster.as_dict(),
             "overlap": assumption(cfg, args.overlap) if cal is None else cal.as_dict(),
             "runs": [{"routing": r.label(), "results": [x.as_dict() for x in res]}
                      for r, res in all_rows]}, indent=1))
    if not args.no_plot:
        path = args.plot or f"simulate-{cfg.name}-{cluster.name}.png"
        plot_results(all_rows, path, f"{cfg.name} on {cluster.name}")
        console.print(f"plot: {path}")
    return 0


def results_table(results: list[SimResult], title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in ("strategy", "dispatcher", "overlap", "step s", "tok/s/GPU", "expert comm",
                "DP comm", "worst idle", "mean idle", "MaxVio", "IB GB/GPU", "NVL GB/GPU"):
        t.add_column(col, justify="left" if col in ("strategy", "dispatcher", "overlap") else "right")
    for r in results:
        t.add_row(r.strategy, r.dispatcher, r.overlap, f"{r.step_time_s:.3f}",
                  f"{r.tokens_per_s_per_gpu:,.0f}", f"{r.comm_share:.1%}", f"{r.dp_share:.1%}",
                  f"{r.worst_idle_share:.1%}", f"{r.mean_idle_share:.1%}", f"{r.max_vio:.2f}",
                  f"{r.inter_bytes_per_gpu / 1e9:.2f}", f"{r.intra_bytes_per_gpu / 1e9:.2f}")
    return t


def layers_table(r: SimResult):
    """Per-MoE-layer times and bytes of one result (one row per distinct layer routing)."""
    from rich.table import Table

    t = Table(title=f"per MoE layer: {r.strategy} + {r.dispatcher} (one micro-batch, fwd+bwd)")
    for col in ("routing #", "MoE layers", "experts slowest ms", "experts mean ms",
                "one transfer ms", "layer ms", "IB MB/GPU", "NVLink MB/GPU"):
        t.add_column(col, justify="right")
    for lay in r.layers:
        t.add_row(str(lay["dist"]), str(lay["num_layers"]), f"{lay['expert_compute_max_ms']:.2f}",
                  f"{lay['expert_compute_mean_ms']:.2f}", f"{lay['transfer_ms']:.2f}",
                  f"{lay['layer_time_ms']:.2f}", f"{lay['inter_bytes_per_gpu'] / 1e6:.1f}",
                  f"{lay['intra_bytes_per_gpu'] / 1e6:.1f}")
    return t


def plot_results(all_rows, path: str, title: str) -> None:
    """Tokens/s per GPU (bars) and where each step's time goes (stacked shares)."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - matplotlib is in the monitor extra
        raise ConfigError("plotting needs matplotlib (pip install 'epscale[monitor]'); "
                          "pass --no-plot to skip it") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(all_rows), 2, figsize=(14, 4.2 * len(all_rows)), squeeze=False)
    for row, (routing, res) in enumerate(all_rows):
        labels = [f"{r.strategy}\n{r.dispatcher}" for r in res]
        x = range(len(res))
        ax = axes[row][0]
        ax.bar(x, [r.tokens_per_s_per_gpu for r in res], color="tab:blue")
        ax.set_xticks(list(x), labels, fontsize=7, rotation=90)
        ax.set_ylabel("tokens/s per GPU")
        ax.set_title(f"{title}: throughput, routing {routing.label()}")
        ax = axes[row][1]
        comp = [1 - r.comm_share - r.dp_share - r.worst_idle_share for r in res]
        parts = [("compute (worst GPU busy)", comp, "tab:green"),
                 ("worst-GPU idle", [r.worst_idle_share for r in res], "tab:red"),
                 ("expert comm", [r.comm_share for r in res], "tab:orange"),
                 ("DP grad comm", [r.dp_share for r in res], "tab:purple")]
        bottom = [0.0] * len(res)
        for name, vals, color in parts:
            ax.bar(x, vals, bottom=bottom, label=name, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(list(x), labels, fontsize=7, rotation=90)
        ax.set_ylabel("share of step time")
        ax.set_ylim(0, 1)
        ax.set_title("where the step goes")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
