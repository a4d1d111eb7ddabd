"""Document masking through FlexAttention block masks (issue #31): the block mask built
from the document ids (causal AND same document) gives the dense masked path's outputs,
in float64 on CPU (FlexAttention's eager form: forward only there), for grouped-query and
latent (MLA) attention and for the whole model; it skips the tiles whole documents leave
empty; and 'auto' picks it on accelerators only."""

from __future__ import annotations

import pytest
import torch

import epscale
import epscale.model
from epscale.config import ModelConfig
from epscale.model import (Attention, LatentAttention, Transformer, document_block_mask,
                           document_mask, uses_flex)

pytestmark = pytest.mark.skipif(epscale.model.flex_attention is None,
                                reason="this torch has no FlexAttention")

EOS = 0


def _tokens(B=2, S=64, seed=0) -> torch.Tensor:
    """Token ids with EOS at irregular places (documents of 1 to ~30 tokens, one ending
    exactly at a sequence end)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(1, 50, (B, S), generator=g)
    t[0, [0, 5, 6, 31, 63]] = EOS
    t[1, [17, 40]] = EOS
    return t


def _cfg(**over) -> ModelConfig:
    base = dict(vocab_size=50, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=64,
                dense_hidden_dim=64)
    base.update(over)
    return ModelConfig(**base)


MLA = dict(attention="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=12, num_kv_heads=None)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_block_mask_attention_equals_the_dense_mask(kind):
    torch.manual_seed(0)
    cfg = _cfg(**(MLA if kind == "mla" else {}))
    attn = (LatentAttention(cfg) if kind == "mla" else Attention(cfg)).double()
    tokens = _tokens()
    x = torch.randn(2, 64, 32, dtype=torch.float64)
    with torch.no_grad():
        dense = attn(x, None, document_mask(tokens, EOS))
        flex = attn(x, None, document_block_mask(tokens, EOS))
        causal = attn(x)
    torch.testing.assert_close(flex, dense, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(dense, causal)  # the mask does mask something


def test_the_model_with_block_masks_equals_the_dense_masked_model():
    torch.manual_seed(0)
    moe = epscale.MoEConfig(dim=32, hidden_dim=16, num_experts=4, top_k=2)
    model = Transformer(_cfg(), moe).double()
    tokens = _tokens(seed=1)
    with torch.no_grad():
        model.set_document_masking(EOS, kind="dense")
        dense = model(tokens)
        model.set_document_masking(EOS, kind="flex")
        assert type(model.attention_mask(tokens)).__name__ == "BlockMask"
        flex = model(tokens)
        model.set_document_masking(None)
        plain = model(tokens)
    torch.testing.assert_close(flex, dense, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(dense, plain)
    with pytest.raises(ValueError, match="document mask kind 'sparse'"):
        model.set_document_masking(EOS, kind="sparse")


def test_block_mask_skips_the_tiles_between_documents():
    """Two documents of 128 tokens in a 256-token sequence (128-token tiles): each query
    tile reads one key tile, where the causal mask alone reads 1 and 2."""
    tokens = torch.ones(1, 256, dtype=torch.long)
    tokens[0, 127] = EOS
    mask = document_block_mask(tokens, EOS)
    assert mask.BLOCK_SIZE == (128, 128)
    read = mask.kv_num_blocks + (mask.full_kv_num_blocks if mask.full_kv_num_blocks is not None
                                 else 0)
    assert read.flatten().tolist() == [1, 1]
    one_doc = document_block_mask(torch.ones(1, 256, dtype=torch.long), EOS)
    read = one_doc.kv_num_blocks + (one_doc.full_kv_num_blocks
                                    if one_doc.full_kv_num_blocks is not None else 0)
    assert read.flatten().tolist() == [1, 2]


def test_auto_uses_flex_on_accelerators_only():
    assert not uses_flex("auto", torch.device("cpu"))
    assert uses_flex("auto", torch.device("cuda", 0))
    assert uses_flex("flex", torch.device("cpu")) and not uses_flex("dense", torch.device("cuda"))
