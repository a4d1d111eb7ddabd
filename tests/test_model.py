"""The decoder-only MoE transformer: layer pattern, causality, RoPE (and its YaRN variant),
GQA/MLA, QK-norm, head tying, the KV cache, sizes matching epscale.plan.sizing, and input
errors. (Each feature against transformers' own model: tests/test_hf_models.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from epscale.config import ConfigError, load_config
from epscale.model import (Attention, KVCache, Transformer, apply_rope, build_model,
                           rope_softmax_scale, rope_tables)
from epscale.moe.experts import FeedForward
from epscale.moe.layer import MoE
from epscale.plan.sizing import model_size


def cfg(*over: str):
    base = ["model.dim=32", "model.num_layers=4", "model.num_heads=4", "model.seq_len=16",
            "model.dense_hidden_dim=48", "moe.hidden_dim=16", "moe.num_experts=4", "moe.top_k=2"]
    return load_config(None, base + list(over))


def test_glam_layer_pattern():
    c = cfg("model.num_dense_layers=1", "model.moe_every=2")
    m = Transformer(c.model, c.moe)
    kinds = [type(b.ffn) for b in m.layers.values()]
    assert kinds == [FeedForward, MoE, FeedForward, MoE]
    assert [b.layer_id for b in m.layers.values() if b.is_moe] == [1, 3]
    assert len(m.moe_layers()) == 2


@pytest.mark.parametrize("over", [
    (),
    ("model.num_kv_heads=2",),
    ("model.tie_embeddings=false", "model.num_dense_layers=2"),
    ("model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16",
     "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=8"),
    ("model.attention=mla", "model.q_lora_rank=0", "model.kv_lora_rank=16",
     "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=12"),
    ("moe.num_shared_experts=1", "moe.activation=gelu"),
])
def test_forward_backward_and_sizes(over):
    c = cfg(*over)
    m = build_model(c)
    tokens = torch.randint(0, 256, (2, 16))
    logits = m(tokens)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    loss = m.loss(tokens, torch.roll(tokens, -1, 1)) + m.aux_loss()
    loss.backward()
    assert all(p.grad is not None for n, p in m.named_parameters() if "router" not in n)
    size = model_size(c)
    assert size.total_params == sum(p.numel() for p in m.parameters())
    E, K, mats = c.moe.num_experts, c.moe.top_k, 3 if c.moe.activation == "swiglu" else 2
    inactive = len(m.moe_layers()) * (E - K) * mats * c.moe.dim * c.moe.hidden_dim
    assert size.active_params == size.total_params - inactive
    assert size.flops_per_token > 6 * (size.active_params - c.model.vocab_size * c.model.dim)


def test_untied_head_has_its_own_weight():
    tied = Transformer(cfg().model, cfg().moe)
    untied_cfg = cfg("model.tie_embeddings=false")
    untied = Transformer(untied_cfg.model, untied_cfg.moe)
    assert tied.output is None and untied.output is not None
    n = sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters())
    assert n == 256 * 32


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_attention_is_causal(attention):
    c = cfg(f"model.attention={attention}", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
            "model.qk_rope_head_dim=4", "model.v_head_dim=8")
    m = build_model(c).eval()
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 7) % 256
    with torch.no_grad():
        la, lb = m(a), m(b)
    torch.testing.assert_close(la[:, :10], lb[:, :10])
    assert not torch.allclose(la[:, 10:], lb[:, 10:])


def test_rope_rotates_relative_positions():
    cos, sin = rope_tables(32, 8, 10000.0)
    q = torch.randn(1, 1, 1, 8)
    k = torch.randn(1, 1, 1, 8)
    # <rope(q, m), rope(k, n)> depends only on m - n
    def at(x, pos):
        seq = x.expand(1, 1, 32, 8)
        return apply_rope(seq, cos, sin)[0, 0, pos]
    d1 = at(q, 5) @ at(k, 3)
    d2 = at(q, 12) @ at(k, 10)
    torch.testing.assert_close(d1, d2, rtol=1e-5, atol=1e-5)
    # position 0 is the identity, norms are preserved
    torch.testing.assert_close(at(q, 0), q[0, 0, 0])
    torch.testing.assert_close(at(q, 7).norm(), q.norm())


def test_gqa_matches_repeated_kv_heads():
    c = cfg("model.num_kv_heads=2")
    attn = Attention(c.model)
    x = torch.randn(2, 16, 32)
    out = attn(x)
    # same result computed by hand with kv heads repeated
    B, S, h = 2, 16, 8
    q = apply_rope(attn.wq(x).view(B, S, 4, h).transpose(1, 2), attn.rope_cos, attn.rope_sin)
    k = apply_rope(attn.wk(x).view(B, S, 2, h).transpose(1, 2), attn.rope_cos, attn.rope_sin)
    v = attn.wv(x).view(B, S, 2, h).transpose(1, 2)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / h ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(S, S, dtype=torch.bool), 1), float("-inf"))
    ref = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, 32))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_same_seed_same_weights():
    a, b = build_model(cfg(), seed=3), build_model(cfg(), seed=3)
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n


def test_bad_inputs_raise_clear_errors():
    m = build_model(cfg())
    with pytest.raises(ValueError, match="token ids"):
        m(torch.randint(0, 256, (16,)))
    with pytest.raises(ValueError, match="seq_len=16"):
        m(torch.randint(0, 256, (1, 17)))


def test_small_model_learns_a_repeating_text():
    torch.manual_seed(0)
    c = cfg("model.num_layers=2")
    m = build_model(c)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    text = torch.tensor(list(b"def f(x):\n    return x\n" * 4))[:17]
    x, y = text[:-1].unsqueeze(0), text[1:].unsqueeze(0)
    first = None
    for _ in range(40):
        loss = m.loss(x, y) + m.aux_loss()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert m.loss(x, y).item() < 0.3 * first


CACHE_BASE = ["model.dim=32", "model.num_layers=3", "model.num_heads=4", "model.seq_len=32",
        "model.dense_hidden_dim=48", "model.num_dense_layers=1", "moe.hidden_dim=16",
        "moe.num_experts=4", "moe.top_k=2", "model.vocab_size=64"]


@pytest.mark.parametrize("over", [
    ("model.num_kv_heads=2",),
    ("model.qk_norm=true", "model.head_dim=16", "model.rope_scaling={type: yarn, factor: 4, "
     "original_seq_len: 8}"),
    ("model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16",
     "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=8",
     "model.rope_scaling={type: yarn, factor: 4, original_seq_len: 8, mscale: 1, "
     "mscale_all_dim: 1}", "moe.score_func=sigmoid", "moe.num_shared_experts=1"),
])
def test_cached_forward_equals_the_full_forward(over):
    m = build_model(load_config(None, CACHE_BASE + list(over))).eval()
    toks = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m(toks)
        cache = KVCache(len(m.layers))
        parts = [m(toks[:, :7], cache=cache)]                 # prefill
        parts += [m(toks[:, i:i + 1], cache=cache) for i in range(7, 12)]  # one by one
        parts.append(m(toks[:, 12:20], cache=cache))          # a chunk after a cache
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="20 cached \\+ 13 exceeds model.seq_len=32"):
        m(toks[:, :13], cache=cache)


def test_qk_norm_normalises_each_head_before_rope():
    c = cfg("model.qk_norm=true", "model.num_kv_heads=2")
    attn = Transformer(c.model, c.moe).layers["0"].attention
    assert attn.q_norm.weight.shape == (8,) and attn.k_norm.weight.shape == (8,)
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        q, k, _ = attn._qkv(x)
        # rotation keeps each head's norm: every head of q and k has RMS 1 (weights are ones)
        torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(1, 4, 5), atol=1e-4, rtol=0)
        torch.testing.assert_close(k.pow(2).mean(-1), torch.ones(1, 2, 5), atol=1e-4, rtol=0)
        attn.q_norm.weight.fill_(2.0)
        q2, _, _ = attn._qkv(x)
    torch.testing.assert_close(q2, 2 * q)


def test_rope_scaling_keys_are_validated_and_change_the_tables():
    c = cfg("model.rope_scaling={type: yarn, factor: 4, original_seq_len: 8, mscale: 1, "
            "mscale_all_dim: 1}")
    cos, sin = rope_tables(16, 8, 10000.0, c.model.rope_scaling)
    plain_cos, _ = rope_tables(16, 8, 10000.0)
    assert not torch.allclose(cos, plain_cos)
    torch.testing.assert_close(cos[:, 0], plain_cos[:, 0])  # the fastest frequency is kept
    assert rope_softmax_scale(c.model.rope_scaling) == pytest.approx((0.1 * math.log(4) + 1) ** 2)
    assert rope_softmax_scale(None) == 1.0
    for over, match in [
        ("model.rope_scaling={type: ntk}", "model.rope_scaling.type"),
        ("model.rope_scaling={type: yarn, factor: 0.5}", "model.rope_scaling.factor"),
        ("model.rope_scaling={type: yarn, fcator: 2}", "Did you mean 'factor'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            cfg(over)
    with pytest.raises(ConfigError, match="model.qk_norm.*'mha' only"):
        cfg("model.qk_norm=true", "model.attention=mla")
    with pytest.raises(ConfigError, match="model.latent_norm_eps"):
        cfg("model.latent_norm_eps=0")
