"""``epscale describe CONFIG``: parameters, FLOPs per token and memory per rank of a recipe,
computed analytically (nothing is built), next to the published figures where known."""

from __future__ import annotations

import json

from ..config import PUBLISHED, load_recipe, recipe_path
from ..config.recipes import requested_scale
from ..sim.sizing import model_size


def configure_parser(p) -> None:
    p.add_argument("config", help="recipe name (e.g. deepseek-v3) or path to a YAML file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks (default: the recipe's)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (default: the recipe's)")
    p.add_argument("--param-dtype", default=None,
                   help="parameter dtype (default: bfloat16 when train.dtype is bfloat16, else float32)")
    p.add_argument("--optim-dtype", default="float32", help="AdamW moment dtype (default float32)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. moe.num_experts=64 scale=tiny")
    # key=value overrides may follow options (CONFIG --opt X key=value): plain parse_args
    # stops filling positionals after the first option.
    p.parse_args = p.parse_intermixed_args


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _fmt_bytes(n: float) -> str:
    for unit, div in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def describe(config: str, overrides: list[str] | None = None, **layout) -> dict:
    """The describe report as a plain dict (what ``--json`` prints). ``scale`` is the scale
    asked for (by the recipe or a ``scale=`` override): the shrunk config itself says 'full'."""
    cfg = load_recipe(config, overrides)
    size = model_size(cfg, **layout)
    out = {"name": cfg.name, "config": str(recipe_path(config)),
           "scale": requested_scale(config, overrides),
           **size.as_dict()}
    out["layout"] = {"dp": layout.get("dp") or cfg.parallel.dp,
                     "ep": layout.get("ep") or cfg.parallel.ep,
                     "world": (layout.get("dp") or cfg.parallel.dp) * (layout.get("ep") or cfg.parallel.ep)}
    if out["layout"]["ep"] > 1:
        out["layout"]["redundant_experts"] = cfg.parallel.redundant_experts
    if size.num_moe_layers:
        # What an expert's GEMMs see per micro-batch and MoE layer with balanced routing:
        # the EP group's tokens times top-k, spread over the experts. It sets how close the
        # expert GEMMs come to the dense rate (benchmarks/RESULTS.md, rows per expert).
        tokens = cfg.train.micro_batch_size * cfg.model.seq_len * out["layout"]["ep"]
        out["rows_per_expert"] = tokens * cfg.moe.top_k / cfg.moe.num_experts
    pub = PUBLISHED.get(cfg.name)
    if pub is not None:
        out["published"] = dict(pub)
        for key in ("total", "active"):
            if pub[key]:
                out["published"][f"{key}_rel_err"] = size.as_dict()[f"{key}_params"] / pub[key] - 1
    return out


def run(args) -> int:
    layout = {"dp": args.dp, "ep": args.ep, "param_dtype": args.param_dtype,
              "optim_dtype": args.optim_dtype}
    info = describe(args.config, args.overrides, **layout)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    pub = info.get("published", {})
    t = Table(title=f"{info['name']} ({info['config']})")
    t.add_column("quantity")
    t.add_column("epscale", justify="right")
    t.add_column("published", justify="right")
    for key in ("total", "active"):
        ref = pub.get(key)
        rel = pub.get(f"{key}_rel_err")
        t.add_row(f"{key} parameters", _fmt_count(info[f"{key}_params"]),
                  f"{_fmt_count(ref)} ({rel:+.2%})" if ref else "-")
    for key in ("embedding_params", "attention_params", "expert_params", "shared_expert_params",
                "dense_ffn_params", "router_params", "norm_params"):
        t.add_row(key.replace("_params", "").replace("_", " "), _fmt_count(info[key]), "")
    t.add_row("MoE layers", str(info["num_moe_layers"]), "")
    t.add_row("training FLOPs / token", f"{info['flops_per_token'] / 1e9:.1f} GFLOP", "")
    console.print(t)
    mem, lay = info["memory"], info["layout"]
    copies = (f" plus {lay['redundant_experts']} redundant expert copies"
              if lay.get("redundant_experts") else "")
    m = Table(title=f"memory per rank, dp={lay['dp']} x ep={lay['ep']} ({lay['world']} ranks; "
                    f"experts sharded over ep{copies}, everything else replicated)")
    m.add_column("part")
    m.add_column("bytes", justify="right")
    m.add_row("parameters held", _fmt_count(mem["params_per_rank"]))
    for key in ("params", "grads", "optimizer", "activations", "total"):
        m.add_row(key, _fmt_bytes(mem[key]))
    console.print(m)
    rows = info.get("rows_per_expert")
    if rows is not None:
        hint = (" [yellow]Below ~256 the expert GEMMs ran at 0.58-0.74 of the dense rate on "
                "CPU (benchmarks/RESULTS.md); a larger micro-batch or more EP ranks raise it.[/]"
                if rows < 256 else "")
        console.print(f"expert GEMM rows per micro-batch and layer: {rows:,.0f} on average "
                      f"(micro-batch tokens x ep x top_k / experts).{hint}")
    if pub.get("source"):
        console.print(f"[dim]published: {pub['source']}[/]")
    return 0
