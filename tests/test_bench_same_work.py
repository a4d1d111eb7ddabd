"""benchmarks/moe_layer.py's check that a comparison does the same work: in bf16 the
tokens at a routing near-tie are left out (another router may round the other way),
every other token must match.

Legend: T tokens, D model dim, E experts.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import epscale

ROOT = Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("moe_layer_bench", ROOT / "benchmarks" / "moe_layer.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


ml = _load_script()


def _tied_layer() -> tuple[epscale.MoE, torch.Tensor]:
    """Top-1 of 4 experts; token 0's two best logits are 1e-4 apart, the others' far apart."""
    moe = epscale.MoE(epscale.MoEConfig(dim=4, hidden_dim=8, num_experts=4, top_k=1))
    with torch.no_grad():
        moe.router.gate.weight.copy_(torch.eye(4))
    x_TD = torch.tensor([[1.0, 1.0 - 1e-4, 0.0, 0.0],
                         [1.0, 0.0, 0.0, 0.0],
                         [0.0, 0.0, 2.0, 0.0]])
    return moe, x_TD


def test_near_ties_are_the_tokens_whose_kth_and_next_logits_nearly_agree():
    moe, x_TD = _tied_layer()
    assert ml.near_ties(moe, x_TD).tolist() == [True, False, False]


def test_near_tie_tokens_are_left_out_in_bf16_only():
    moe, x_TD = _tied_layer()
    tie_T = ml.near_ties(moe, x_TD)
    ours = torch.randn(3, 4)
    theirs = ours.clone()
    theirs[0] = -ours[0]  # the tied token went to the other expert
    assert ml.check_same_work(ours, theirs, "other", lowp=True, near_tie_T=tie_T) == 0.0
    with pytest.raises(SystemExit, match="1 routing near-ties left out"):
        ml.check_same_work(ours, ours + torch.tensor([[0.0] * 4, [1.0] * 4, [0.0] * 4]),
                           "other", lowp=True, near_tie_T=tie_T)  # a clear-cut token differs
    with pytest.raises(SystemExit, match="differs"):
        ml.check_same_work(ours, theirs, "other", lowp=False, near_tie_T=tie_T)  # fp32: all
