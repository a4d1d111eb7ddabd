"""``epscale`` command line. Each subcommand lives in its own module of
:mod:`epscale.commands` that exposes ``configure_parser(parser)`` and ``run(args) -> int``;
the module is imported only when its command runs, so ``epscale --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

from .config import ConfigError

# name -> (module, one-line help). Add a line here to add a command.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("epscale.commands.demo", "route a batch through an MoE layer and print what happened"),
    "describe": ("epscale.commands.describe", "parameters, FLOPs per token and memory per rank of a recipe"),
    "simulate": ("epscale.commands.simulate", "cluster-scale model of a training step per balancing strategy and dispatcher"),
    "calibrate": ("epscale.commands.calibrate", "measure this machine (GEMM rate, all-to-all) and write a cluster file"),
    "sweep": ("epscale.commands.sweep", "measure a grid of experts x capacity x top-k (x dispatcher) around a recipe and recommend one"),
    "monitor": ("epscale.commands.monitor", "HTML report, live view (--follow) and alert check (--check) of a run"),
    "train": ("epscale.commands.train", "train an MoE transformer (EP x DP, checkpoints, resume)"),
    "launch": ("epscale.commands.launch", "train on this machine through torchrun (restarts after a rank dies)"),
    "slurm": ("epscale.commands.slurm", "render or submit an sbatch script (srun torchrun, requeue, pre-emption)"),
    "preflight": ("epscale.commands.preflight", "timed all-reduce/all-to-all check of every rank (run under torchrun)"),
    "checkpoint": ("epscale.commands.checkpoint", "export a sharded checkpoint to one state dict, or import one; import-hf / export-hf for Hugging Face"),
    "upcycle": ("epscale.commands.upcycle", "turn a dense Hugging Face model into an MoE run (sparse upcycling)"),
    "generate": ("epscale.commands.generate", "continue a prompt with a run's newest checkpoint (KV cache)"),
    "data": ("epscale.commands.data", "train a tokenizer, prepare token shards from text (parallel, resumable), verify them"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epscale",
        description="Pretrain Mixture-of-Experts models with expert parallelism.",
        epilog="Run 'epscale COMMAND --help' for the options of one command.")
    parser.add_argument("--version", action="version",
                        version=f"epscale {importlib.import_module('epscale').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        args = parser.parse_args(argv)  # prints help / version / an unknown-command error
        parser.print_help()
        return 0 if not argv else 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    sub = argparse.ArgumentParser(prog=f"epscale {name}", description=COMMANDS[name][1])
    module.configure_parser(sub)
    args = sub.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except ConfigError as e:
        if not getattr(e, "quiet", False):  # quiet: reported by another rank already
            print(f"epscale {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
