"""``epscale sweep BASE``: measure a grid of experts x capacity x top-k (x dispatcher)
around a recipe on this machine and recommend one (see :mod:`epscale.tune.sweep`)."""

from __future__ import annotations

import json
from pathlib import Path

from ..tune.sweep import pareto_front, recommend, run_sweep


def results_table(results: list[dict], pick: dict | None, front_ids: set[str]):
    from rich.table import Table

    t = Table(title="sweep results")
    for col in ("point", "experts", "capacity", "top-k", "dispatcher", "tokens/s", "dropped",
                "MaxVio", "loss", "peak MB", ""):
        t.add_column(col, justify="left" if col in ("point", "dispatcher", "") else "right")
    for r in sorted(results, key=lambda r: r["id"]):
        mark = ("recommended" if pick is not None and r["id"] == pick["id"]
                else "pareto" if r["id"] in front_ids else "")
        if r["status"] != "ok":
            t.add_row(r["id"], str(r["num_experts"]), str(r["capacity_factor"]), str(r["top_k"]),
                      r["dispatcher"], "-", "-", "-", "-", "-", f"failed: {r['error'][:40]}")
            continue
        t.add_row(r["id"], str(r["num_experts"]), str(r["capacity_factor"]), str(r["top_k"]),
                  r["dispatcher"], f"{r['tokens_per_s']:,.0f}", f"{r['dropped_frac']:.2%}",
                  f"{r['max_vio']:.2f}", f"{r['loss']:.4f}", f"{r['peak_mem_mb']:,.0f}", mark)
    return t


def plot_pareto(results: list[dict], pick: dict | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["status"] == "ok"]
    front = pareto_front(ok)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter([r["tokens_per_s"] for r in ok], [r["loss"] for r in ok], color="tab:blue",
               label="measured points")
    for r in ok:
        ax.annotate(r["id"], (r["tokens_per_s"], r["loss"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    if front:
        ax.plot([r["tokens_per_s"] for r in front], [r["loss"] for r in front], "-o",
                color="tab:orange", label="Pareto front")
    if pick is not None:
        ax.scatter([pick["tokens_per_s"]], [pick["loss"]], s=200, facecolors="none",
                   edgecolors="tab:red", linewidths=2, label="recommended")
    ax.set_xlabel("tokens/s (all processes)")
    ax.set_ylabel("loss after N steps")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def configure_parser(p) -> None:
    p.add_argument("base", help="base recipe name or YAML path")
    p.add_argument("--dir", required=True, help="sweep directory (created; resumed when it exists)")
    p.add_argument("--experts", default=None, help="comma list of num_experts (default: the base's)")
    p.add_argument("--capacity", default=None,
                   help="comma list of capacity factors, 'none' for dropless (default: the base's)")
    p.add_argument("--top-k", default=None, help="comma list of top_k (default: the base's)")
    p.add_argument("--dispatchers", default=None, help="comma list (default: the base's)")
    p.add_argument("--mode", default="train", help="train (short real runs, default) or layer")
    p.add_argument("--steps", type=int, default=20, help="steps per point (default 20)")
    p.add_argument("--nproc", type=int, default=1, help="processes per point (EP over all of them)")
    p.add_argument("--seed", type=int, default=0, help="layer mode: data and teacher seed")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a point is failed")
    p.add_argument("--loss-tolerance", type=float, default=0.02,
                   help="relative loss the recommendation may give up for speed (default 0.02)")
    p.add_argument("--retry-failed", action="store_true", help="run failed points again")
    p.add_argument("--plot", default=None, help="Pareto plot path (default DIR/pareto.png)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="base recipe overrides, e.g. scale=tiny train.micro_batch_size=2")
    # key=value overrides may follow options (CONFIG --opt X key=value): plain parse_args
    # stops filling positionals after the first option.
    p.parse_args = p.parse_intermixed_args


def run(args) -> int:
    from rich.console import Console

    console = Console(width=max(Console().width, 120))
    results, _ = run_sweep(args, console)
    pick, reasons = recommend(results, args.loss_tolerance)
    front = {r["id"] for r in pareto_front(results)}
    console.print(results_table(results, pick, front))
    if any(r["status"] == "ok" for r in results):
        path = Path(args.plot) if args.plot else Path(args.dir) / "pareto.png"
        plot_pareto(results, pick, path, f"sweep around {Path(args.base).stem} ({args.mode}, "
                                         f"{args.steps} steps)")
        console.print(f"plot: {path}")
    console.print("[bold]recommendation[/]: " + (pick["id"] if pick else "none"))
    for line in reasons:
        console.print(f"  - {line}")
    (Path(args.dir) / "recommendation.json").write_text(json.dumps(
        {"recommended": pick, "reasons": reasons}, indent=1))
    return 0 if pick is not None else 1
