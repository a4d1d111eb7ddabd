"""``epscale upcycle DENSE_HF_DIR --experts E --top-k K --out RUN_DIR``: sparse upcycling
of a dense Llama- or Qwen3-style Hugging Face checkpoint into an epscale MoE run
directory: every expert starts as the dense FFN (``--drop-ratio``: drop-upcycling's
partial re-initialisation), the router small; ``epscale train --run-dir RUN_DIR`` trains
it at any layout (:mod:`epscale.interop.upcycle`)."""

from __future__ import annotations

from ..interop.upcycle import upcycle
from ..training import checkpoint as ckpt
from .args import allow_intermixed


def configure_parser(p) -> None:
    p.add_argument("dense_dir", help="Hugging Face directory of a dense model (llama, qwen3): "
                   "config.json and *.safetensors")
    p.add_argument("--experts", type=int, required=True, help="routed experts per layer (E)")
    p.add_argument("--top-k", type=int, required=True, help="experts per token (K)")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory to create")
    p.add_argument("--drop-ratio", type=float, default=0.0,
                   help="drop-upcycling: re-initialise this fraction of each expert's hidden "
                   "units (default 0: every expert an exact copy, step-0 logits = dense)")
    p.add_argument("--router-std", type=float, default=None,
                   help="std of the new router's weights (default 0.1/sqrt(dim))")
    p.add_argument("--seed", type=int, default=0, help="seed of the router and re-initialisation")
    p.add_argument("--seq-len", type=int, default=None,
                   help="model.seq_len (default: min(max_position_embeddings, 4096))")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="changes to the MoE recipe (moe.aux_loss_coeff=0.01 parallel.ep=4 ...)")
    allow_intermixed(p)


def run(args) -> int:
    path = upcycle(args.dense_dir, args.out, args.experts, args.top_k, args.overrides,
                   args.router_std, args.drop_ratio, args.seed, args.seq_len)
    meta = ckpt.read_meta(path)
    m = meta["config"]["model"]
    print(f"upcycled {args.dense_dir} ({meta.get('upcycled_from')}: {m['num_layers']} layers, "
          f"dim {m['dim']}) into {args.experts} experts top-{args.top_k} per layer"
          f"{f', drop ratio {args.drop_ratio}' if args.drop_ratio else ''}: {path}")
    print(f"train with: epscale train --run-dir {args.out} [key=value ...]")
    return 0
