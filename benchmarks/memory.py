"""The memory estimate (``epscale describe``, ``epscale.plan.memory``) against measurement,
side by side in one run, on this machine's CPU.

1. Activations: one process builds each model, runs a forward under each recomputation
   mode, each dtype rule of the trainer (fp32; bf16 autocast over fp32 weights, the
   rule without FSDP; bf16 parameters, FSDP's MixedPrecisionPolicy, emulated by casting
   the parameters) and, in fp32, light recomputation (``train.recompute_modules``: each
   module alone and all at once); the profiler's allocation record gives the bytes the
   forward leaves for backward (``epscale.metrics.held.forward_kept_bytes``); next to it
   the estimate.
2. Weights, gradients, AdamW state: the real trainer at replicated and FSDP layouts on
   gloo processes runs a step; the largest rank's storages next to the estimate.
3. At scale (estimate only): the 1T recipe replicated and sharded.
4. Paired micro-batches (``--part pairs``, ``parallel.overlap_micro_batches``): the real
   trainer at ep=2 on 2 gloo processes, 4 micro-batches a step, with and without the
   pairs and under each recomputation mode; a thread samples the process's in-use heap
   (glibc's ``mallinfo2``, every thread's allocations: the profiler's record misses the
   pair's helper thread) through each step's forwards and backwards; the peak above the
   step's start, the largest rank, steps 2-3; next to it the estimate's kept activations,
   recomputation working set and exchange buffers, which the pairs double.

    python benchmarks/memory.py [--nproc 4] [--json out.json] [--rules fp32,autocast,fsdp]
    python benchmarks/memory.py --part activations --storage fp8   # fp8 storage rows only
    python benchmarks/memory.py --device cuda     # part 1 in bf16 on one GPU
    python benchmarks/memory.py --part pairs      # part 4 only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

MODELS = {
    "mha swiglu": [],
    "gqa + qk-norm + shared expert": ["model.num_kv_heads=2", "model.qk_norm=true",
                                      "moe.num_shared_experts=1"],
    "gelu": ["moe.activation=gelu"],
    "mla": ["model.attention=mla", "model.q_lora_rank=64", "model.kv_lora_rank=64",
            "model.qk_nope_head_dim=24", "model.qk_rope_head_dim=8", "model.v_head_dim=32"],
}
BASE = ["model.dim=128", "model.num_layers=4", "model.num_heads=4", "model.seq_len=256",
        "model.dense_hidden_dim=256", "model.num_dense_layers=1", "model.vocab_size=512",
        "moe.hidden_dim=192", "moe.num_experts=8", "moe.top_k=2", "train.micro_batch_size=2",
        "parallel.ep=1", "parallel.dp=1"]
LAYOUTS = {  # name -> overrides (the world is --nproc)
    "replicated ep=2": ["parallel.ep=2"],
    "FSDP ep=2": ["parallel.fsdp=true", "parallel.ep=2"],
    "HSDP 2 x 2, ep=2": ["parallel.fsdp=true", "parallel.ep=2", "parallel.dp_replicate=2"],
    "FSDP ep=2, bf16 AdamW moments": ["parallel.fsdp=true", "parallel.ep=2",
                                      "train.optimizer_state_dtype=bfloat16"],
}
# light recomputation rows of part 1 (train.recompute_modules; MLA's only on the MLA model)
MODULES = ["norm", "router", "shared_experts", "mlp", "moe_act", "attention_core", "mla_up_proj"]


RULES = {"fp32": "fp32", "autocast": "bf16 autocast", "fsdp": "bf16 FSDP (params cast)"}


def measure_activations(over: list[str], impl: str, ac: str, device: str = "cpu",
                        rule: str = "fp32", modules: tuple[str, ...] = (),
                        storage: str = "compute") -> tuple[int, float]:
    """(bytes the forward leaves for backward, the estimate) under ``rule`` (a key of
    RULES). CPU: the profiler's record; CUDA: ``torch.cuda.memory_allocated`` before and
    after. ``modules``: train.recompute_modules (with ``ac`` 'none'); ``storage``:
    train.activation_storage."""
    import torch

    from epscale.config import load_config
    from epscale.metrics.held import forward_kept_bytes, measured_model
    from epscale.plan.layout import Layout
    from epscale.plan.memory import Activations, estimate

    cfg = load_config(None, BASE + over + [f"moe.experts_impl={impl}"])
    net = measured_model(cfg, rule == "fsdp", ac, modules, storage, device)
    B, S, V = cfg.train.micro_batch_size, cfg.model.seq_len, cfg.model.vocab_size
    x, y = (torch.randint(0, V, (B, S), device=device) for _ in range(2))
    cuda = device.startswith("cuda")

    def forward():
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                            enabled=rule == "autocast"):
            return net.loss(x, y) + net.aux_loss()

    for _ in range(2):
        forward().backward()
        net.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = forward()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
    else:
        kept, loss = forward_kept_bytes(forward)
    loss.backward()
    # RMSNorm runs decomposed on the CPU, fused on an accelerator (plan.memory.NORM_KERNELS)
    acts = Activations(ac, "float32" if rule == "fp32" else "bfloat16", impl, modules, storage,
                       "composite" if device == "cpu" else "fused")
    lay = Layout.from_config(cfg, 1, ep=1, fsdp=rule == "fsdp")
    return kept, estimate(cfg, lay, acts).activations


def _state_worker(rank, world, over, run_dir):
    import torch
    import torch.distributed as dist

    from epscale.config import load_config
    from epscale.metrics.held import state_bytes
    from epscale.training.dist import LaunchEnv
    from epscale.training.loop import Trainer

    cfg = load_config(None, BASE + over + ["train.steps=1", "train.eval_every=0",
                                           "train.ckpt_every=0", "train.preflight=false",
                                           "parallel.dp=1" if "parallel.fsdp=true" in over
                                           else f"parallel.dp={world // 2}"])
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        t = Trainer(cfg, Path(run_dir), LaunchEnv("torchrun", world_size=world), checked=True)
        clean = False
        try:
            t.setup()
            t.run()
            got = state_bytes(t.model, t.opt)
            clean = True
        finally:
            t.close(clean)
    v = torch.tensor([float(got[k]) for k in ("params", "grads", "optimizer")])
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return dict(zip(("params", "grads", "optimizer"), v.tolist()))


PAIR_RUNS = ["parallel.ep=2", "parallel.dp=1", "train.grad_accum=4", "train.micro_batch_size=1",
             "parallel.dispatcher=alltoall"]


class HeapPeak:
    """The process's in-use heap bytes (glibc ``mallinfo2``: every arena, so every
    thread, plus mmapped blocks), sampled by a thread while open; ``peak`` above the
    bytes in use when it opened."""

    def __init__(self, every_s: float = 2e-4):
        import ctypes
        import threading

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]

        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = MallInfo2
        self.every_s, self.peak = every_s, 0
        self._stop = threading.Event()
        self._thread = None

    def in_use(self) -> int:
        m = self._libc.mallinfo2()
        return m.uordblks + m.hblkhd

    def __enter__(self):
        import threading
        import time

        start = self.in_use()
        self._stop.clear()

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, self.in_use() - start)
                time.sleep(self.every_s)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


def _pairs_worker(rank, world, over, run_dir):
    import torch
    import torch.distributed as dist

    from epscale.config import load_config
    from epscale.training.dist import LaunchEnv
    from epscale.training.loop import Trainer

    cfg = load_config(None, BASE + PAIR_RUNS + over + [
        "train.steps=3", "train.eval_every=0", "train.ckpt_every=0", "train.preflight=false"])
    peaks: list[int] = []
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        t = Trainer(cfg, Path(run_dir), LaunchEnv("torchrun", world_size=world), checked=True)
        clean = False
        try:
            t.setup()
            train = t.stepper.train

            def measured(loader, accum):
                with HeapPeak() as heap:
                    out = train(loader, accum)
                peaks.append(heap.peak)
                return out

            t.stepper.train = measured
            t.run()
            clean = True
        finally:
            t.close(clean)
    v = torch.tensor([float(max(peaks[1:]))])
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return v.item()


def pairs_part(console, figures: dict) -> None:
    """Part 4: the trainer's peak heap through a step with and without the pairs, against
    the estimate's activations, recomputation working set and exchange buffers."""
    from rich.progress import Progress
    from rich.table import Table

    from epscale.config import load_config
    from epscale.plan.layout import Layout
    from epscale.plan.memory import Activations, estimate
    from epscale.tune.calibrate import spawn_local

    t = Table(title="Paired micro-batches at ep=2 (2 gloo processes, 4 micro-batches of "
                    "1 x 256 tokens): peak heap above the step's start, largest rank, vs "
                    "the estimate's activations + recomputation + exchange buffers")
    for col in ("recompute", "pairs", "measured peak", "estimate", "pairs - plain, measured",
                "pairs - plain, estimate"):
        t.add_column(col, justify="left" if col in ("recompute", "pairs") else "right")
    mib = lambda b: f"{b / 2 ** 20:.2f} MiB"  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="epscale-bench-pairs-") as tmp, \
            Progress(console=console, transient=True) as bar:
        task = bar.add_task("pairs", total=6)
        for ac in ("none", "selective", "full"):
            got = {}
            for paired in (False, True):
                over = [f"train.activation_checkpointing={ac}",
                        f"parallel.overlap_micro_batches={str(paired).lower()}"]
                peak = spawn_local(_pairs_worker, 2, args=(
                    over, str(Path(tmp) / f"{ac}-{paired}")))[0]
                cfg = load_config(None, BASE + PAIR_RUNS + over)
                est = estimate(cfg, Layout.from_config(cfg, 2),
                               Activations.of(cfg, norm_kernel="composite"))   # CPU RMSNorm
                got[paired] = (peak, est.activations + est.recompute + est.comm)
                bar.advance(task)
            for paired in (False, True):
                peak, est = got[paired]
                extra = ((mib(got[True][0] - got[False][0]), mib(got[True][1] - got[False][1]))
                         if paired else ("", ""))
                t.add_row(ac, "yes" if paired else "no", mib(peak), mib(est), *extra)
            figures["pairs"].append({"ac": ac, "measured": {"plain": got[False][0],
                                                            "pairs": got[True][0]},
                                     "estimate": {"plain": got[False][1],
                                                  "pairs": got[True][1]}})
    console.print(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4, help="processes for the layouts (default 4)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--device", default="cpu",
                    help="cpu (default), or cuda: activations in bf16 on one GPU (the "
                         "gloo layouts part is skipped)")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                    help="the models of part 1 (default: all)")
    ap.add_argument("--part", choices=("all", "activations", "state", "pairs"), default="all",
                    help="run one part only (default: the first three; 'pairs': part 4, "
                         "paired micro-batches)")
    ap.add_argument("--storage", choices=("all", "compute", "fp8"), default="all",
                    help="part 1's rows by train.activation_storage (default: both)")
    ap.add_argument("--rules", default="fp32,autocast,fsdp",
                    help="dtype rules of part 1, comma-separated: " + ", ".join(RULES))
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from epscale.config import load_config, load_recipe
    from epscale.tune.calibrate import spawn_local
    from simulate import machine   # benchmarks/simulate.py: the machine line
    from epscale.plan.memory import memory_per_rank

    console = Console(width=150)
    console.print(f"machine: {machine()}")
    figures: dict = {"activations": [], "state": [], "scale": [], "pairs": []}
    if args.part == "pairs":
        pairs_part(console, figures)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
        return 0
    cuda = args.device.startswith("cuda")
    rules = args.rules.split(",")
    t = Table(title=f"Saved activations of one micro-batch (2 x 256 tokens, on "
                    f"{args.device}): measured vs estimate")
    for col in ("model", "experts", "dtype rule", "recompute", "storage", "measured", "estimate",
                "estimate / measured"):
        t.add_column(col, justify="right" if col.startswith(("measured", "estimate")) else "left")
    impls = ("grouped_mm",) if cuda else ("cpu_fused", "grouped_mm")
    models = args.models if args.part in ("all", "activations") else []
    runs = [(m, impl, rule, ac, (), "compute") for m in models for impl in impls
            for rule in rules for ac in ("none", "selective", "full")]
    for m in models:  # light recomputation, fp32
        mods = [x for x in MODULES if x != "mla_up_proj" or "mla" in m]
        runs += [(m, impl, "fp32", "none", tuple(c), "compute") for impl in impls
                 for c in [[x] for x in mods] + [mods]]
    # fp8 storage of the routed experts' saved rows (grouped GEMMs), alone and with the
    # norms and the experts' activation recomputed
    runs += [(m, "grouped_mm", rule, "none", mods, "fp8") for m in models for rule in rules
             for mods in ((), ("norm", "moe_act"))]
    runs = [r for r in runs if args.storage in ("all", r[-1])]
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("activations", total=len(runs))
        for m, impl, rule, ac, mods, storage in runs:
            kept, est = measure_activations(MODELS[m], impl, ac, args.device, rule, mods,
                                            storage)
            label = ("modules " + ",".join(mods) if len(mods) < 3 else "all modules") if mods else ac
            t.add_row(m, impl, RULES[rule], label, storage, f"{kept / 2 ** 20:.2f} MiB",
                      f"{est / 2 ** 20:.2f} MiB", f"{est / kept:.3f}")
            figures["activations"].append({"model": m, "experts_impl": impl, "rule": rule,
                                           "ac": ac, "recompute_modules": list(mods),
                                           "activation_storage": storage,
                                           "measured": kept, "estimate": est})
            bar.advance(task)
    if runs:
        console.print(t)

    if cuda or args.part == "activations":
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
        return 0
    s = Table(title=f"Weights, gradients and AdamW state of the largest rank after a step, "
                    f"{args.nproc} gloo processes: measured / estimate")
    for col in ("layout", "weights", "gradients", "AdamW", "estimate / measured"):
        s.add_column(col, justify="left" if col == "layout" else "right")
    with tempfile.TemporaryDirectory(prefix="epscale-bench-memory-") as tmp, \
            Progress(console=console, transient=True) as bar:
        task = bar.add_task("layouts", total=len(LAYOUTS))
        for name, over in LAYOUTS.items():
            got = spawn_local(_state_worker, args.nproc,
                              args=(over, str(Path(tmp) / name.replace(" ", "_"))))[0]
            cfg = load_config(None, BASE + over + (["parallel.dp=1"] if "parallel.fsdp=true" in over
                                                   else [f"parallel.dp={args.nproc // 2}"]))
            est = memory_per_rank(cfg, world=args.nproc)
            ratio = (est.params + est.grads + est.optimizer) / sum(got.values())
            s.add_row(name, *(f"{got[k] / 2 ** 20:.2f} / {getattr(est, k) / 2 ** 20:.2f} MiB"
                              for k in ("params", "grads", "optimizer")), f"{ratio:.3f}")
            figures["state"].append({"layout": name, "measured": got,
                                     "estimate": {k: getattr(est, k) for k in got}})
            bar.advance(task)
    console.print(s)

    cfg = load_recipe("ref-1t-64e")
    a = Table(title="ref-1t-64e per rank on 1,024 GPUs, bf16 compute (estimate)")
    for col in ("layout", "recompute", "weights+grads+AdamW", "activations", "gathered", "total"):
        a.add_column(col, justify="left" if col in ("layout", "recompute") else "right")
    for label, kw in (("replicated dp=16 x ep=64", dict(fsdp=False)),
                      ("FSDP 1024, ep=64", dict(fsdp=True, dp_replicate=1)),
                      ("HSDP 2 x 512, ep=64", dict(fsdp=True, dp_replicate=2))):
        for ac in ("none", "full"):
            m = memory_per_rank(cfg, world=1024, ep=64, activation_checkpointing=ac, **kw)
            gib = lambda b: f"{b / 2 ** 30:.1f} GiB"  # noqa: E731
            a.add_row(label, ac, gib(m.params + m.grads + m.optimizer),
                      gib(m.activations + m.recompute), gib(m.gathered), gib(m.total))
            figures["scale"].append({"layout": label, "ac": ac, **m.as_dict()})
    console.print(a)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
