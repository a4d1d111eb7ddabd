"""``epscale checkpoint``: convert between sharded checkpoints and one full state dict.

    epscale checkpoint export RUN_DIR|CHECKPOINT_DIR out.pt
    epscale checkpoint import in.pt RUN_DIR [--step N]
    epscale checkpoint list RUN_DIR

The exported file is ``torch.save({"model": {...}, "optim": {...}, "meta": {...}})`` with
plain full tensors (``Transformer.load_state_dict(blob["model"])`` works). ``import``
accepts such a file or a bare model state dict and writes a checkpoint that
``epscale train --run-dir RUN_DIR`` resumes from at any dp x ep.
"""

from __future__ import annotations

from ..training import checkpoint as ckpt


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


def run(args) -> int:
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
