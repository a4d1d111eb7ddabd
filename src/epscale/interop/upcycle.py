"""Sparse upcycling (Komatsuzaki et al., 2023): a dense Llama- or Qwen3-style Hugging Face
checkpoint becomes an epscale MoE whose every expert starts as the dense FFN, with a new
router initialised small. With softmax scores renormalised over the top k (the default),
the upcycled model computes the dense model's function at step 0 (its K chosen experts are
the same FFN, weighted to sum to one); training then drives the experts apart.

Drop-upcycling (Nakamura et al., 2025, ``drop_ratio`` > 0): in each expert a random
``drop_ratio`` of the hidden units are re-initialised (their gate/up columns and down rows,
drawn from a normal with the dense weight's mean and std), so the experts differ from the
start; the step-0 equality then no longer holds.

Legend: E experts, D model dim, F FFN hidden dim.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..config import RunConfig, apply_overrides, from_dict
from .files import HFError, read_json
from .hf import check_new_run_dir, model_shapes, state_from_hf, write_run
from .hf_config import DENSE_FAMILIES, Mapped, recipe_from_hf


def upcycled_config(dense_dir: str | Path, experts: int, top_k: int,
                    overrides: list[str] | None = None,
                    seq_len: int | None = None) -> tuple[Mapped, RunConfig, RunConfig]:
    """(the dense mapping, the dense model's recipe, the MoE recipe): every layer MoE
    with ``experts`` experts of the dense FFN's width, top ``top_k``, softmax scores
    renormalised over the top k; ``overrides`` apply to the MoE recipe."""
    dense_dir = Path(dense_dir)
    source = dense_dir / "config.json"
    mapped = recipe_from_hf(read_json(source), source, seq_len, families=DENSE_FAMILIES)
    dense = from_dict(RunConfig, mapped.data)
    data = mapped.data
    data["name"] = f"upcycled-{mapped.family}"
    data["model"] = {**data["model"], "num_dense_layers": 0}
    data["moe"] = {**data["moe"], "num_experts": experts, "top_k": top_k,
                   "score_func": "softmax", "route_norm": True}
    cfg = from_dict(RunConfig, apply_overrides(data, list(overrides or [])))
    if cfg.moe.hidden_dim != dense.model.dense_hidden_dim:
        raise HFError(f"moe.hidden_dim = {cfg.moe.hidden_dim} must equal the dense FFN width "
                      f"{dense.model.dense_hidden_dim} (intermediate_size in '{source}'): "
                      "every expert starts as a copy of it")
    for key in ("dim", "num_layers", "num_heads", "vocab_size"):
        if getattr(cfg.model, key) != getattr(dense.model, key):
            raise HFError(f"model.{key} = {getattr(cfg.model, key)} must stay "
                          f"{getattr(dense.model, key)} (the dense model's, '{source}')")
    return mapped, dense, cfg


def upcycle_state(dense_state: dict[str, torch.Tensor], cfg: RunConfig,
                  router_std: float | None = None, drop_ratio: float = 0.0,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """The MoE state dict of ``cfg`` from the dense model's: attention, norms and
    embeddings copied; in each MoE layer every expert a copy of the dense FFN (with
    ``drop_ratio`` of its hidden units re-initialised), the router N(0, router_std)
    (default 0.1/sqrt(D): near-uniform routing), the expert bias zero."""
    if not 0.0 <= drop_ratio <= 1.0:
        raise HFError(f"drop ratio {drop_ratio} must be in [0, 1]")
    D, E, F = cfg.model.dim, cfg.moe.num_experts, cfg.moe.hidden_dim
    std = 0.1 * D ** -0.5 if router_std is None else router_std
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in model_shapes(cfg).items():
        if name in dense_state:
            out[name] = dense_state[name]
            continue
        prefix, _, leaf = name.partition(".ffn.")
        if leaf == "router.gate.weight":
            out[name] = torch.randn(shape, generator=gen) * std
        elif leaf.startswith("router."):
            out[name] = torch.zeros(shape)
        elif leaf in ("experts.w1", "experts.w3", "experts.w2"):
            proj = leaf.split(".")[1]
            w = dense_state[f"{prefix}.ffn.{proj}.weight"]             # [F, D] or [D, F]
            stacked = w.t().unsqueeze(0).repeat(E, 1, 1).contiguous()  # [E, D, F] / [E, F, D]
            layer_seed = seed * 1_000_003 + int(prefix.split(".")[1]) * 10_007
            out[name] = _drop(stacked, w, drop_ratio, layer_seed, ("w1", "w3", "w2").index(proj),
                              proj == "w2", F)
        else:
            raise HFError(f"upcycled tensor '{name}' has no source in the dense model")
    return out


def _drop(stacked: torch.Tensor, dense_w: torch.Tensor, ratio: float, seed: int, proj: int,
          rows: bool, F: int) -> torch.Tensor:
    """Re-initialise ``ratio`` of the hidden units of each expert: columns of w1/w3 [D, F],
    rows of w2 [F, D]. The units of expert e come from seed ``seed`` (the same in the
    layer's three projections), their new values from a stream of their own per ``proj``."""
    n = round(ratio * F)
    if n == 0:
        return stacked
    mean, std = float(dense_w.mean()), float(dense_w.std())
    for e in range(stacked.shape[0]):
        idx = torch.randperm(F, generator=torch.Generator().manual_seed(seed + e))[:n]
        g = torch.Generator().manual_seed(seed + e + 7919 * (proj + 1))
        if rows:
            stacked[e, idx] = torch.randn(n, stacked.shape[2], generator=g) * std + mean
        else:
            stacked[e][:, idx] = torch.randn(stacked.shape[1], n, generator=g) * std + mean
    return stacked


def upcycle(dense_dir: str | Path, run_dir: str | Path, experts: int, top_k: int,
            overrides: list[str] | None = None, router_std: float | None = None,
            drop_ratio: float = 0.0, seed: int = 0, seq_len: int | None = None,
            report: Callable[[str], None] = print) -> Path:
    """Write the upcycled MoE of the dense Hugging Face model ``dense_dir`` as run
    directory ``run_dir`` (config.yaml, a step-0 checkpoint, hf_source/ with the
    tokenizer), which ``epscale train --run-dir`` trains on at any layout."""
    dense_dir, run_dir = Path(dense_dir), Path(run_dir)
    mapped, dense, cfg = upcycled_config(dense_dir, experts, top_k, overrides, seq_len)
    check_new_run_dir(run_dir)
    dense_state = state_from_hf(dense_dir, mapped, dense, report)
    state = upcycle_state(dense_state, cfg, router_std, drop_ratio, seed)
    return write_run(run_dir, cfg, state, dense_dir,
                     {"upcycled_from": mapped.family, "drop_ratio": drop_ratio})
