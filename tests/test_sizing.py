"""sizing.model_size against the model epscale actually builds: parameter counts equal
sum(p.numel()) and the matmul FLOPs equal what torch's FLOP counter sees."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from epscale.config import CpuKernelConfig, ModelConfig, MoEConfig, RunConfig
from epscale.model import Transformer
from epscale.plan.sizing import model_size

CASES = {
    "mha-tied": (dict(num_heads=4), dict()),
    "gqa-untied": (dict(num_heads=4, num_kv_heads=2, tie_embeddings=False), dict()),
    "gqa-qk-norm": (dict(num_heads=4, num_kv_heads=2, qk_norm=True), dict()),
    "head-dim-wider": (dict(num_heads=4, num_kv_heads=1, head_dim=16), dict(top_k=1)),
    "dense-first+every-2": (dict(num_layers=5, num_dense_layers=2, moe_every=2), dict()),
    "shared+gelu": (dict(), dict(num_shared_experts=2, shared_hidden_dim=40, activation="gelu")),
    "shared-default-width": (dict(num_dense_layers=1), dict(num_shared_experts=1)),
    "mla-qlora": (dict(attention="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=8, tie_embeddings=False),
                  dict(score_func="sigmoid", num_groups=2, topk_groups=1)),
    "mla-no-qlora": (dict(attention="mla", q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=8), dict()),
}


def _cfg(model_kw: dict, moe_kw: dict) -> RunConfig:
    m = dict(vocab_size=64, dim=32, num_layers=3, seq_len=16, dense_hidden_dim=48)
    m.update(model_kw)
    e = dict(dim=32, hidden_dim=24, num_experts=4, top_k=2, use_grouped_mm="never")
    e.update(moe_kw)
    return RunConfig(model=ModelConfig(**m), moe=MoEConfig(**e))


@pytest.mark.parametrize("case", sorted(CASES))
def test_params_match_built_model(case):
    cfg = _cfg(*CASES[case])
    net = Transformer(cfg.model, cfg.moe)
    size = model_size(cfg)
    assert size.total_params == sum(p.numel() for p in net.parameters())
    experts = sum(p.numel() for n, p in net.named_parameters() if ".experts." in n)
    assert size.expert_params == experts
    attn = sum(p.numel() for n, p in net.named_parameters() if ".attention." in n)
    assert size.attention_params == attn
    embed = net.tok_embeddings.weight.numel() + (0 if net.output is None else net.output.weight.numel())
    assert size.embedding_params == embed
    per_expert = experts // (size.num_moe_layers * cfg.moe.num_experts)
    unused = size.num_moe_layers * (cfg.moe.num_experts - cfg.moe.top_k) * per_expert
    assert size.active_params == size.total_params - unused


@pytest.mark.parametrize("case", ["gqa-untied", "shared+gelu", "mla-qlora", "dense-first+every-2"])
def test_matmul_flops_match_flop_counter(case):
    """Forward matmul FLOPs per token x 3 (+ attention) is the training figure; the matmul
    part is checked exactly against torch's counter (dropless: every token uses K experts)."""
    cfg = _cfg(*CASES[case])
    cfg.moe.cpu = CpuKernelConfig(batch_pad_waste=None)  # the per-expert loop: batched chunks
    net = Transformer(cfg.model, cfg.moe)                 # add pad rows and run as bmm
    B, S = 2, cfg.model.seq_len
    with FlopCounterMode(display=False) as fc:
        net(torch.randint(0, cfg.model.vocab_size, (B, S)))
    mm = fc.get_flop_counts()["Global"][torch.ops.aten.mm]
    size = model_size(cfg)
    from epscale.plan.sizing import attention_flops_per_token
    attn = cfg.model.num_layers * attention_flops_per_token(cfg.model)
    assert size.flops_per_token / 3 - attn == pytest.approx(mm / (B * S), rel=1e-9)
