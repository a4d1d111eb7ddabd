"""``epscale checkpoint``: convert between sharded checkpoints and one full state dict.

    epscale checkpoint export RUN_DIR|CHECKPOINT_DIR out.pt
    epscale checkpoint import in.pt RUN_DIR [--step N]
    epscale checkpoint list RUN_DIR
    epscale checkpoint import-hf HF_DIR --out RUN_DIR [--seq-len N] [key=value ...]
    epscale checkpoint export-hf RUN_DIR|CHECKPOINT_DIR OUT_DIR [--arch A] [--dtype D]
                                 [--lossy] [--overwrite]

The exported file is ``torch.save({"model": {...}, "optim": {...}, "meta": {...}})`` with
plain full tensors (``Transformer.load_state_dict(blob["model"])`` works). ``import``
accepts such a file or a bare model state dict and writes a checkpoint that
``epscale train --run-dir RUN_DIR`` resumes from at any dp x ep.

``import-hf`` reads a Hugging Face directory (Mixtral, Qwen3-MoE, Ernie 4.5 MoE, GLM-4 MoE,
DeepSeek-V3; config.json
and safetensors) into a new run directory (:mod:`epscale.interop.hf`); ``export-hf``
writes a checkpoint as the transformers family that represents it exactly, with its
tokenizer and generation settings, or refuses (exit 2) naming why
(:mod:`epscale.interop.hf_export`).
"""

from __future__ import annotations

from ..interop.files import DTYPES
from ..interop.hf import import_hf
from ..interop.hf_export import export_hf
from ..interop.hf_families import EXPORT_FAMILIES
from ..training import checkpoint as ckpt
from .args import allow_intermixed, parse_size


def configure_parser(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ex = sub.add_parser("export", help="sharded checkpoint -> one full state dict file")
    ex.add_argument("source", help="a run directory (its newest complete checkpoint) or a "
                    "checkpoint directory")
    ex.add_argument("out", help="output .pt file")
    im = sub.add_parser("import", help="full state dict file -> checkpoint of a run directory")
    im.add_argument("source", help="a file from 'epscale checkpoint export' or a model state dict")
    im.add_argument("run_dir", help="run directory to write RUN_DIR/checkpoints/step_N into")
    im.add_argument("--step", type=int, default=None,
                    help="step number to record (default: the file's, else 0)")
    ls = sub.add_parser("list", help="checkpoints of a run directory and whether they are sound")
    ls.add_argument("run_dir")
    ih = sub.add_parser("import-hf", help="Hugging Face model directory -> new run directory")
    ih.add_argument("hf_dir", help="directory with config.json and *.safetensors (Mixtral, "
                    "Qwen3-MoE, Ernie 4.5 MoE, GLM-4 MoE or DeepSeek-V3)")
    ih.add_argument("--out", required=True, metavar="RUN_DIR",
                    help="run directory to create (config.yaml, checkpoints/step_00000000)")
    ih.add_argument("--seq-len", type=int, default=None,
                    help="model.seq_len (default: min(max_position_embeddings, 4096))")
    ih.add_argument("overrides", nargs="*", metavar="key=value",
                    help="changes to the recipe (parallel.ep=8 train.lr=1e-4 data.source=...)")
    allow_intermixed(ih)
    eh = sub.add_parser("export-hf", help="checkpoint -> Hugging Face model directory")
    eh.add_argument("source", help="a run directory (its newest complete checkpoint) or a "
                    "checkpoint directory")
    eh.add_argument("out_dir", help="directory to write config.json and safetensors into")
    eh.add_argument("--arch", choices=EXPORT_FAMILIES, default=None,
                    help="transformers family (default: the first that represents the model "
                    "exactly, the imported one's first)")
    eh.add_argument("--lossy", action="store_true",
                    help="write even when no family represents the model exactly (a warning "
                    "names what is dropped: the router's expert bias, token dropping)")
    eh.add_argument("--overwrite", action="store_true",
                    help="replace the model files of a folder that epscale did not export into "
                    "(other files there are left alone)")
    eh.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                    help="tensor dtype (default: the imported model's, else float32)")
    eh.add_argument("--max-shard-size", default="5GiB",
                    help="largest safetensors shard (default 5GiB)")


def run(args) -> int:
    if args.action == "import-hf":
        path = import_hf(args.hf_dir, args.out, args.overrides, args.seq_len)
        return _imported(args, path)
    if args.action == "export-hf":
        export_hf(args.source, args.out_dir, args.arch, args.dtype,
                  parse_size("--max-shard-size", args.max_shard_size), lossy=args.lossy,
                  overwrite=args.overwrite)
        return 0
    if args.action == "export":
        meta = ckpt.export_full(args.source, args.out)
        print(f"exported step {meta.get('step')} (written at dp={meta.get('dp')} x "
              f"ep={meta.get('ep')}) to {args.out}")
        return 0
    if args.action == "import":
        path = ckpt.import_full(args.source, args.run_dir, args.step)
        print(f"imported {args.source} as {path}; resume with: epscale train --run-dir "
              f"{args.run_dir} [--config ...]")
        return 0
    return _list(args)


def _imported(args, path) -> int:
    meta = ckpt.read_meta(path)
    m, moe = meta["config"]["model"], meta["config"]["moe"]
    moe_layers = sum(1 for i in range(m["num_layers"]) if i >= m["num_dense_layers"]
                     and (i - m["num_dense_layers"]) % m["moe_every"] == 0)
    print(f"imported {args.hf_dir} ({meta.get('hf_family')}: {m['num_layers']} layers, "
          f"{moe_layers} MoE with {moe['num_experts']} experts top-{moe['top_k']}, dim "
          f"{m['dim']}, vocab {m['vocab_size']}) as {path}")
    t = meta["config"]["train"]
    print(f"training section: continued pretraining of a trained model: lr {t['lr']:g} "
          f"(decaying to {t['min_lr']:g}) after {t['warmup_steps']} warm-up steps, not the "
          "from-scratch defaults (lr 3e-3, 30 warm-up steps); change with train.lr=... "
          "train.warmup_steps=...")
    print(f"recipe: {args.out}/config.yaml; train on with: epscale train --run-dir {args.out} "
          "[key=value ...]")
    return 0


def _list(args) -> int:
    found = ckpt.list_checkpoints(args.run_dir)
    if not found:
        print(f"no checkpoints under {ckpt.checkpoints_root(args.run_dir)}")
        return 1
    for step, path in found:
        try:
            meta = ckpt.validate(path)
            print(f"{path}  step {step}  ok  (dp={meta.get('dp')} x ep={meta.get('ep')})")
        except ckpt.CheckpointError as e:
            print(f"{path}  step {step}  BAD: {e}")
    return 0
