"""Model FLOPs per token and peak device FLOP/s, for model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per process / peak FLOP/s of one device, with the model FLOPs
counted the PaLM way: 6 x active matmul parameters per token (forward + backward), plus
the attention score and value products, 6 x seq_len x heads x (qk_dim + v_dim) / 2 per
layer (halved: a causal mask computes half of the score matrix).
Only the routed experts a token actually uses count (top_k of them), plus shared experts
and the router.
"""

from __future__ import annotations

import os

import torch

from ..config import RunConfig

# Dense bf16 tensor-core peak FLOP/s (no sparsity) by device-name fragment; fp32 runs use
# the TF32 column. Unknown GPUs fall back to EPSCALE_PEAK_FLOPS or the A100 figures.
_GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    # name fragment, bf16, tf32
    ("H200", 989e12, 494e12),
    ("H100", 989e12, 494e12),
    ("H800", 989e12, 494e12),
    ("B200", 2250e12, 1100e12),
    ("A100", 312e12, 156e12),
    ("A800", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("A10", 125e12, 62.5e12),
)

# Nominal CPU peak: 32 fp32 FLOPs per cycle per core (two 8-wide FMA units) at 2.5 GHz.
CPU_FLOPS_PER_CORE = 32 * 2.5e9


def flops_per_token(cfg: RunConfig) -> float:
    """Training FLOPs (forward + backward) per token of the decoder-only MoE model in ``cfg``."""
    m, moe = cfg.model, cfg.moe
    D, H, L, S = m.dim, m.num_heads, m.num_layers, m.seq_len
    if m.attention == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        v = m.v_head_dim
        q_params = (D * m.q_lora_rank + m.q_lora_rank * H * qk) if m.q_lora_rank else D * H * qk
        kv_params = D * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * H * (
            m.qk_nope_head_dim + v)
        attn_params = q_params + kv_params + H * v * D
    else:
        hd = m.head_dim or D // H
        kv_heads = m.num_kv_heads or H
        qk = v = hd
        attn_params = D * H * hd + 2 * D * kv_heads * hd + H * hd * D
    mult = 3 if moe.activation == "swiglu" else 2
    moe_params = (D * moe.num_experts + moe.top_k * mult * D * moe.hidden_dim
                  + mult * D * moe.shared_width)
    dense_params = 3 * D * m.dense_hidden_dim
    num_moe = sum(1 for i in range(L) if m.is_moe_layer(i))
    params = L * attn_params + num_moe * moe_params + (L - num_moe) * dense_params + D * m.vocab_size
    attention = 6 * L * S * H * (qk + v) / 2  # causal: half the score matrix is computed
    return float(6 * params + attention)


def peak_flops(device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16) -> float:
    """Peak FLOP/s of one device: ``EPSCALE_PEAK_FLOPS`` if set, a table of GPUs, or the
    nominal CPU figure ``cores x CPU_FLOPS_PER_CORE`` (cores = torch threads)."""
    env = os.environ.get("EPSCALE_PEAK_FLOPS")
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"EPSCALE_PEAK_FLOPS={env!r} is not a number (FLOP/s, e.g. 989e12)")
        if value > 0:
            return value
        raise ValueError(f"EPSCALE_PEAK_FLOPS={env!r} must be > 0")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev)
        for fragment, bf16, tf32 in _GPU_PEAKS:
            if fragment in name:
                return bf16 if dtype in (torch.bfloat16, torch.float16) else tf32
        return 312e12 if dtype in (torch.bfloat16, torch.float16) else 156e12
    return torch.get_num_threads() * CPU_FLOPS_PER_CORE


def mfu(tokens_per_s_per_proc: float, flops_per_token_: float, peak_flops_: float) -> float:
    """Model FLOPs utilisation in [0, 1+] (0.0 when either FLOP figure is unknown)."""
    if not (flops_per_token_ > 0 and peak_flops_ > 0):
        return 0.0
    return tokens_per_s_per_proc * flops_per_token_ / peak_flops_
