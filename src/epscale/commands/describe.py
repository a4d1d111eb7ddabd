"""``epscale describe CONFIG``: parameters, FLOPs per token and memory per rank of a recipe
at a layout, computed analytically (nothing is built), next to the published figures
where known; ``--fit 80GiB`` lists the layouts of a cluster that fit, fastest first.
Under a pipeline (``--pp`` or ``parallel.pp``) it also gives the stage split (each stage's
layers, the rank holding it, its share of the FLOPs), the schedule's bubble at the step's
micro-batches, the p2p traffic and each pipeline rank's memory, the largest marked. It says
which overlap the step model assumes and where that comes from, or with ``--overlap-from
RUN_DIR --overlap-cluster CLUSTER`` that assumption held against what the run measured
(:mod:`epscale.plan.overlap`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

from ..config import PUBLISHED, ConfigError, RunConfig, load_recipe, recipe_path
from ..config.recipes import requested_scale
from ..config.schema import PP_SCHEDULES
from ..interop.hf_families import describe_export
from ..plan.fit import AC_MODES
from ..plan.layout import Layout
from ..plan.memory import DTYPE_BYTES, Activations, estimate, pipeline_memory, resolve
from ..plan.overlap import assumption, calibration_from
from ..plan.pipeline import bubble_fraction, layers_label, stage_flops, with_mtp
from ..plan.sizing import model_size, published_size
from .args import add_overlap_calibration, parse_size


def configure_parser(p) -> None:
    p.add_argument("config", help="recipe name (e.g. deepseek-v3) or path to a YAML file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    lay = p.add_argument_group("layout (default: the recipe's)")
    lay.add_argument("--world", "--gpus", type=int, default=None,
                     help="ranks (default: dp x ep, or dp_replicate x dp_shard with FSDP)")
    lay.add_argument("--dp", type=int, default=None, help="replicated data-parallel ranks (world = dp x ep)")
    lay.add_argument("--ep", type=int, default=None, help="expert-parallel ranks")
    lay.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                     help="shard the non-expert weights, gradients and AdamW state (FSDP2)")
    lay.add_argument("--dp-replicate", type=int, default=None,
                     help="FSDP: replicas of each shard (HSDP); dp_shard = world / dp_replicate")
    lay.add_argument("--ac", choices=AC_MODES, default=None,
                     help="activation checkpointing (train.activation_checkpointing)")
    lay.add_argument("--micro-batch", type=int, default=None, help="train.micro_batch_size")
    lay.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                     help="compute dtype (default: train.dtype; master weights stay fp32)")
    lay.add_argument("--pp", type=int, default=None,
                     help="pipeline ranks (parallel.pp; the world is pp x the ranks of one stage)")
    lay.add_argument("--pp-schedule", choices=tuple(PP_SCHEDULES), default=None,
                     help="parallel.pp_schedule (default: the recipe's, 1f1b)")
    lay.add_argument("--pp-virtual-stages", type=int, default=None,
                     help="stages per rank of interleaved_1f1b / zero_bubble (parallel.pp_virtual_stages)")
    fit = p.add_argument_group("fit: layouts that fit a GPU, fastest first (step model)")
    fit.add_argument("--fit", metavar="SIZE", default=None,
                     help="GPU memory, e.g. 80GiB: list the layouts of the cluster's world that fit")
    fit.add_argument("--cluster", default="field-report",
                     help="simulator cluster preset or YAML (default field-report: 128 nodes x 8 H100)")
    fit.add_argument("--nodes", type=int, default=None,
                     help="nodes (default: the cluster's; --gpus N also sets them)")
    fit.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    add_overlap_calibration(p, "overlap: the step model's assumption, calibrated from a run")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. moe.num_experts=64 scale=tiny")
    # key=value overrides may follow options (CONFIG --opt X key=value): plain parse_args
    # stops filling positionals after the first option. A negative size after --fit is
    # glued to it, so that it reaches the size check instead of reading as an option.
    intermixed = p.parse_intermixed_args
    p.parse_args = lambda args=None, namespace=None: intermixed(
        _glue_negative("--fit", args), namespace)


# the integer options that must be >= 1 (0 used to be ignored or blamed on another option)
POSITIVE_OPTIONS = (("--world", "world"), ("--dp", "dp"), ("--ep", "ep"),
                    ("--dp-replicate", "dp_replicate"), ("--micro-batch", "micro_batch"),
                    ("--pp", "pp"), ("--pp-virtual-stages", "pp_virtual_stages"),
                    ("--nodes", "nodes"), ("--top", "top"))


def _glue_negative(option: str, argv: list[str] | None) -> list[str] | None:
    """``[option, '-5GiB']`` -> ``[option + '=-5GiB']`` (argparse reads '-5GiB' as an option)."""
    if argv is None:
        return None
    out, i = [], 0
    while i < len(argv):
        if argv[i] == option and i + 1 < len(argv) and re.match(r"-\d", argv[i + 1]):
            out.append(f"{option}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def check_args(args) -> None:
    """One ConfigError naming the option for a count below 1 (exit 2)."""
    for flag, name in POSITIVE_OPTIONS:
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"{flag} {v} is invalid: must be a positive integer")


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _recompute_label(lay: dict) -> str:
    """'full', 'selective', 'none', or the recomputed modules (train.recompute_modules)."""
    mods = lay.get("recompute_modules")
    return "modules " + ", ".join(mods) if mods else lay["activation_checkpointing"]


def _fmt_bytes(n: float) -> str:
    for unit, div in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


LAYOUT_KEYS = ("world", "dp", "ep", "fsdp", "dp_replicate", "activation_checkpointing",
               "micro_batch_size", "compute_dtype", "pp", "pp_schedule", "pp_virtual_stages")


def describe(config: str, overrides: list[str] | None = None, *, overlap_from: str | None = None,
             overlap_cluster: str | None = None, **layout) -> dict:
    """The describe report as a plain dict (what ``--json`` prints). ``layout``: any of
    ``LAYOUT_KEYS`` replacing the recipe's (see :func:`epscale.plan.memory.resolve`).
    ``scale`` is the scale asked for (by the recipe or a ``scale=`` override): the shrunk
    config itself says 'full'. ``overlap``: the step model's overlap assumption and its
    source, or its calibration from the run ``overlap_from`` measured (on
    ``overlap_cluster``; :mod:`epscale.plan.overlap`)."""
    cfg = load_recipe(config, overrides)
    size = model_size(cfg)
    lay_args = {k: v for k, v in layout.items() if v is not None}
    cfg, lay, acts = resolve(cfg, **lay_args)
    mem = estimate(cfg, lay, acts)
    out = {"name": cfg.name, "config": str(recipe_path(config)),
           "scale": requested_scale(config, overrides),
           **size.as_dict(), "memory": mem.as_dict(), "hf_export": describe_export(cfg)}
    out["layout"] = {"world": lay.world, "ep": lay.ep, "fsdp": lay.fsdp,
                     "activation_checkpointing": acts.activation_checkpointing,
                     "micro_batch_size": lay.micro_batch_size, "compute_dtype": acts.compute_dtype,
                     "optimizer_state_dtype": cfg.train.optimizer_state_dtype,
                     "recompute_modules": list(acts.recompute_modules),
                     "activation_storage": acts.storage,
                     "description": lay.label(pipeline=True)}
    if lay.fsdp:
        out["layout"].update(dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, efsdp=lay.efsdp,
                             zero=lay.zero)
    else:
        out["layout"]["dp"] = lay.dp   # of one stage under a pipeline
    if lay.ep > 1:
        out["layout"]["redundant_experts"] = lay.redundant_experts
    if lay.pp > 1:
        out["layout"].update(pp=lay.pp, pp_schedule=lay.pp_schedule,
                             pp_virtual_stages=lay.pp_virtual_stages,
                             micro_batches=lay.micro_batches)
        out["pipeline"] = pipeline_report(cfg, lay, acts)
    if size.num_moe_layers:
        # What an expert's GEMMs see per micro-batch and MoE layer with balanced routing:
        # the EP group's tokens times top-k, spread over the experts. It sets how close the
        # expert GEMMs come to the dense rate (benchmarks/RESULTS.md, rows per expert).
        tokens = lay.micro_batch_size * cfg.model.seq_len * lay.ep
        out["rows_per_expert"] = tokens * cfg.moe.top_k / cfg.moe.num_experts
    out["overlap"] = _overlap_report(cfg, overlap_from, overlap_cluster)
    pub = PUBLISHED.get(cfg.name)
    if pub is not None:   # published counts leave multi-token-prediction modules out
        out["published"] = dict(pub)
        main = published_size(cfg).as_dict()
        for key in ("total", "active"):
            if pub[key]:
                out["published"][f"{key}_rel_err"] = main[f"{key}_params"] / pub[key] - 1
    return out


def _overlap_report(cfg: RunConfig, run_dir: str | None, cluster: str | None) -> dict:
    """describe's 'overlap': the assumption with its source, or the calibration (with
    ``lines``, what is printed)."""
    if run_dir is None:
        if cluster is not None:
            raise ConfigError(f"--overlap-cluster {cluster} is invalid alone: it names the "
                              "cluster of the run given by --overlap-from RUN_DIR")
        info = assumption(cfg)
        info["lines"] = [f"overlap assumed by the step model: '{info['mode']}': "
                         f"{info['assumes']}. Source: {info['source']}."]
        return info
    cal = calibration_from(run_dir, cluster)
    return {**cal.as_dict(), "lines": cal.lines()}


def pipeline_report(cfg: RunConfig, lay: Layout, acts: Activations) -> dict:
    """The pipeline part of :func:`describe` (``lay.pp`` > 1; ``cfg`` has its pipeline
    keys): stages, bubble, p2p traffic and each pipeline rank's memory (``largest_rank``:
    the one ``memory`` reports)."""
    ranks = pipeline_memory(cfg, lay, acts)
    depth = cfg.model.mtp_depth       # the MTP modules run on the last stage, after the head
    flops = stage_flops(with_mtp(cfg, depth), depth)
    owner = {s: r.rank for r in ranks for s in r.stages}
    stages, start = [], 0
    n = len(lay.layers_per_stage)
    for s, k in enumerate(lay.layers_per_stage):
        stages.append({"stage": s, "layers": [start, start + k], "rank": owner[s],
                       "mtp_modules": depth if s == n - 1 else 0,
                       "flops_share": flops[s] / sum(flops)})
        start += k
    largest = max(ranks, key=lambda r: r.memory.total)
    T = lay.micro_batch_size * cfg.model.seq_len
    return {"stages": stages, "num_stages": len(stages),
            "bubble": bubble_fraction(lay.pp_schedule, lay.pp, lay.micro_batches,
                                      lay.pp_virtual_stages),
            "p2p_bytes_per_boundary": lay.micro_batches * T * cfg.model.dim
            * DTYPE_BYTES[acts.compute_dtype],
            "largest_rank": largest.rank, "ranks": [r.as_dict() for r in ranks]}


def fit_report(config: str, overrides: list[str] | None, gpu_mem: str, cluster: str,
               nodes: int | None = None, top: int = 10, gpus: int | None = None) -> dict:
    """The layouts of ``cluster`` (``nodes``, or ``gpus`` over its GPUs per node, replacing
    its node count) under which one rank of ``config`` fits ``gpu_mem``, fastest first by
    the step model (what ``--fit`` prints)."""
    from ..plan import load_cluster
    from ..plan.fit import fit

    limit = parse_size("--fit", gpu_mem)
    cfg = load_recipe(config, overrides)
    spec = load_cluster(cluster)
    if gpus is not None:
        if gpus < 1 or gpus % spec.gpus_per_node:
            raise ConfigError(f"--gpus = {gpus} is invalid with --fit: give whole nodes of cluster "
                              f"'{spec.name}' ({spec.gpus_per_node} GPUs each), or --nodes")
        nodes = gpus // spec.gpus_per_node
    if nodes is not None:
        if nodes < 1:
            raise ConfigError(f"--nodes = {nodes} is invalid: must be a positive integer")
        spec = dataclasses.replace(spec, nodes=nodes)
    results, tried = fit(cfg, spec, limit)
    rows = [{"layout": r.layout, "overrides": r.overrides(), "memory": r.memory.as_dict(),
             "step_time_s": r.step_time_s, "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu}
            for r in results[:top]]
    return {"name": cfg.name, "gpu_mem": limit, "cluster": spec.name, "world": spec.world,
            "nodes": spec.nodes, "gpus_per_node": spec.gpus_per_node, "tried": tried,
            "fitting": len(results), "layouts": rows, "overlap": assumption(cfg)}


def _print_fit(info: dict, console) -> None:
    from rich.table import Table

    if not info["layouts"]:
        console.print(f"[red]none of the {info['tried']} layouts of {info['world']} GPUs "
                      f"({info['nodes']} x {info['gpus_per_node']}) fits {_fmt_bytes(info['gpu_mem'])} "
                      f"per rank.[/] More nodes (--nodes) shard FSDP's share further; a smaller "
                      "train.micro_batch_size or model.seq_len lowers the activations.")
        return
    t = Table(title=f"{info['name']}: {info['fitting']} of {info['tried']} layouts of "
                    f"{info['world']} GPUs fit {_fmt_bytes(info['gpu_mem'])}, fastest first "
                    f"(step model, cluster {info['cluster']})")
    for col in ("#", "pp", "ep", "data parallel", "recompute", "memory", "activations", "step",
                "tok/s/GPU"):
        t.add_column(col, justify="left" if col in ("pp", "data parallel", "recompute") else "right")
    for i, r in enumerate(info["layouts"], 1):
        lay = r["layout"]
        pp = lay.get("pp", 1)
        stage = info["world"] // pp                     # ranks of one stage
        rep = lay.get("dp_replicate", 1)
        dp = (f"replicated {lay['dp']}" if not lay["fsdp"] else
              f"HSDP {rep} x {stage // rep}" if rep > 1 else f"FSDP {stage}")
        pipe = (f"{pp} {lay['pp_schedule']}, m={lay['micro_batches']}" if pp > 1 else "1")
        t.add_row(str(i), pipe, str(lay["ep"]), dp, _recompute_label(lay),
                  _fmt_bytes(r["memory"]["total"]), _fmt_bytes(r["memory"]["activations"]),
                  f"{r['step_time_s']:.2f} s", f"{r['tokens_per_s_per_gpu']:,.0f}")
    console.print(t)
    # not markup (a list value, '[norm,moe_act]', is a rich tag) and one line, to paste
    console.print(f"#1 as overrides: {' '.join(info['layouts'][0]['overrides'])}",
                  markup=False, soft_wrap=True)
    console.print("[dim]memory: plan.memory.estimate (weights, gradients, AdamW, saved activations, "
                  "FSDP's gathered block, dispatch rows; under a pipeline its largest rank, with "
                  "the micro-batches in flight and p2p buffers); step: the simulator's step "
                  "model with loss-free balancing (epscale simulate for the detail). Every "
                  "layout keeps the recipe's global batch: a pipeline of pp ranks runs pp times "
                  "the micro-batches.[/]")
    ov = info["overlap"]
    console.print(f"[dim]overlap assumed: '{ov['mode']}'; source: {ov['source']}.[/]",
                  markup=True)


def _layout_args(args) -> dict:
    return {"world": args.world, "dp": args.dp, "ep": args.ep, "fsdp": args.fsdp,
            "dp_replicate": args.dp_replicate, "activation_checkpointing": args.ac,
            "micro_batch_size": args.micro_batch, "compute_dtype": args.dtype, "pp": args.pp,
            "pp_schedule": args.pp_schedule, "pp_virtual_stages": args.pp_virtual_stages}


def _print_pipeline(info: dict, console) -> None:
    """The stage split and each pipeline rank's memory (the largest in bold red)."""
    from rich.table import Table

    pipe, lay = info["pipeline"], info["layout"]
    split = Table(title=f"pipeline: {lay['pp_schedule']}, {pipe['num_stages']} stages over "
                        f"pp={lay['pp']} ranks; embedding on stage 0, norm and head on stage "
                        f"{pipe['num_stages'] - 1}")
    for col in ("stage", "layers", "rank", "FLOPs share"):
        split.add_column(col, justify="right")
    for st in pipe["stages"]:
        split.add_row(str(st["stage"]), layers_label(*st["layers"], st.get("mtp_modules", 0)),
                      str(st["rank"]), f"{st['flops_share']:.1%}")
    console.print(split)
    console.print(f"bubble: {pipe['bubble']:.1%} of the step for {lay['pp_schedule']} at "
                  f"{lay['micro_batches']} micro-batches per step and pp={lay['pp']} (equal "
                  f"stages; plan.pipeline.bubble_fraction). p2p per step across each stage "
                  f"boundary between ranks: {_fmt_bytes(pipe['p2p_bytes_per_boundary'])} of "
                  "activations forward and as much of gradients backward, per GPU.")
    t = Table(title="memory per pipeline rank (the largest in bold red: the memory table above)")
    for col in ("rank", "stages", "layers", "parameters", "weights+grads+AdamW",
                "activations (sets)", "p2p buffers", "FSDP block", "total"):
        t.add_column(col, justify="right")
    for r in pipe["ranks"]:
        mem = r["memory"]
        last = pipe["num_stages"] - 1
        layers = ", ".join(layers_label(a, b, pipe["stages"][s].get("mtp_modules", 0) if s == last
                                   else 0) for s, (a, b) in zip(r["stages"], r["layers"]))
        style = "bold red" if r["rank"] == pipe["largest_rank"] else None
        t.add_row(str(r["rank"]), ", ".join(map(str, r["stages"])), layers,
                  _fmt_count(mem["params_per_rank"]),
                  _fmt_bytes(mem["params"] + mem["grads"] + mem["optimizer"]
                             + mem.get("unsharded", 0)),
                  f"{_fmt_bytes(mem['activations'])} ({r['in_flight']})",
                  _fmt_bytes(mem.get("p2p_buffers", 0)), _fmt_bytes(mem["gathered"]),
                  _fmt_bytes(mem["total"]), style=style)
    console.print(t)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    check_args(args)
    # at least 150 columns, as simulate's: piped into a file, rich's default 80 cut the
    # layout and recomputation names of --fit's table ('dualpi…', 'mla_up…')
    console = Console(width=max(Console().width, 150))
    if args.fit is not None and (args.overlap_from or args.overlap_cluster):
        raise ConfigError("--overlap-from is invalid with --fit: --fit ranks layouts with the "
                          "step model's own overlap assumption (epscale.plan.fit takes no "
                          "calibration); use it without --fit, or epscale simulate")
    if args.fit is not None:
        info = fit_report(args.config, args.overrides, args.fit, args.cluster, args.nodes, args.top,
                          gpus=args.world)
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            _print_fit(info, console)
        return 0
    info = describe(args.config, args.overrides, overlap_from=args.overlap_from,
                    overlap_cluster=args.overlap_cluster, **_layout_args(args))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    pub = info.get("published", {})
    t = Table(title=f"{info['name']} ({info['config']})")
    t.add_column("quantity")
    t.add_column("epscale", justify="right")
    t.add_column("published", justify="right")
    for key in ("total", "active"):
        ref = pub.get(key)
        rel = pub.get(f"{key}_rel_err")
        t.add_row(f"{key} parameters", _fmt_count(info[f"{key}_params"]),
                  f"{_fmt_count(ref)} ({rel:+.2%}{' without MTP' if info.get('mtp_params') else ''})"
                  if ref else "-")
    for key in ("embedding_params", "attention_params", "expert_params", "shared_expert_params",
                "dense_ffn_params", "router_params", "norm_params"):
        t.add_row(key.replace("_params", "").replace("_", " "), _fmt_count(info[key]), "")
    t.add_row("MoE layers", str(info["num_moe_layers"]), "")
    if info.get("mtp_params"):   # counted in the rows above; published figures leave it out
        t.add_row("of which multi-token prediction", _fmt_count(info["mtp_params"]),
                  "(shared embedding and head)")
    t.add_row("training FLOPs / token", f"{info['flops_per_token'] / 1e9:.1f} GFLOP", "")
    console.print(t)
    mem, lay = info["memory"], info["layout"]
    copies = (f", {lay['redundant_experts']} redundant expert copies"
              if lay.get("redundant_experts") else "")
    which = (f" (pipeline rank {info['pipeline']['largest_rank']}, the largest)"
             if "pipeline" in info else "")
    m = Table(title=f"memory per rank{which}: {lay['world']} ranks, {lay['description']}{copies}; "
                    f"recompute {_recompute_label(lay)}, micro-batch "
                    f"{lay['micro_batch_size']}, compute {lay['compute_dtype']}"
                    + (", saved activations in fp8" if lay.get("activation_storage") == "fp8"
                       else ""))
    m.add_column("part")
    m.add_column("bytes", justify="right")
    m.add_row("parameters held", _fmt_count(mem["params_per_rank"]))
    labels = {"params": "weights (fp32)", "grads": "gradients (fp32)",
              "optimizer": f"AdamW moments ({lay['optimizer_state_dtype']})",
              "unsharded": "weights kept gathered (ZeRO-1/2, pipeline)",
              "activations": "saved activations",
              "gathered": "FSDP gathered block", "comm": "dispatch rows",
              "p2p_buffers": "p2p receive buffers",
              "head_chunk": "loss chunk (head logits, transient)", "total": "total"}
    for key, label in labels.items():
        optional = ("gathered", "comm", "p2p_buffers", "unsharded", "head_chunk")
        if key in optional and not mem.get(key):
            continue
        m.add_row(label, _fmt_bytes(mem[key]))
    console.print(m)
    if "pipeline" in info:
        _print_pipeline(info, console)
    rows = info.get("rows_per_expert")
    if rows is not None:
        hint = (" [yellow]Below ~256 the expert GEMMs ran at 0.58-0.74 of the dense rate on "
                "CPU (benchmarks/RESULTS.md); a larger micro-batch or more EP ranks raise it.[/]"
                if rows < 256 else "")
        console.print(f"expert GEMM rows per micro-batch and layer: {rows:,.0f} on average "
                      f"(micro-batch tokens x ep x top_k / experts).{hint}")
    for line in info["overlap"]["lines"]:
        console.print(line, markup=False)
    console.print(f"Hugging Face export (checkpoint export-hf): {info['hf_export']}")
    if pub.get("source"):
        console.print(f"[dim]published: {pub['source']}[/]")
    return 0
