"""A small decoder-only MoE transformer: the trainer's model.

Token embedding -> ``num_layers`` pre-norm blocks (causal attention with RoPE through
``scaled_dot_product_attention``; a dense SwiGLU/GELU FFN for the first
``num_dense_layers`` and then an :class:`epscale.MoE` every ``moe_every`` layers, GLaM
style) -> RMSNorm -> output head (tied to the embedding or not). With ``model.mtp_depth``
DeepSeek-V3's multi-token-prediction modules follow in training (:class:`MTPModule`),
sharing the embedding and the head.

Incremental decoding: ``forward(tokens_BS, cache=KVCache(...))`` attends over the keys
and values of the tokens seen before (kept in the cache) and appends the new ones.

Legend: B batch (sequences), S sequence length, D model dim, H query heads, G key/value
heads, h head dim, V vocabulary, T tokens (B*S).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, MoEConfig, RunConfig
from .config.schema import RopeScalingConfig
from .head_loss import head_loss
from .moe.experts import FeedForward
from .moe.layer import MoE
from .model_init import initialize_

try:  # FlexAttention: block-sparse masks (whole masked tiles skipped), torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # an older torch: document masking keeps the dense mask
    BlockMask = create_block_mask = flex_attention = None


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in fp32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScalingConfig | None = None
                     ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp64, [head_dim/2]) and the factor cos/sin are scaled by, for
    plain RoPE or a ``model.rope_scaling`` variant (the formulas of Hugging Face's
    ``modeling_rope_utils``: YaRN, Llama 3)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq, 1.0
    factor, orig = scaling.factor, scaling.original_seq_len
    if scaling.type == "llama3":
        low_wavelen = orig / scaling.low_freq_factor
        high_wavelen = orig / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = (_yarn_mscale(factor, scaling.mscale)
                                / _yarn_mscale(factor, scaling.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    return inv_freq, attention_factor


def rope_softmax_scale(scaling: RopeScalingConfig | None) -> float:
    """The factor MLA multiplies its softmax scale by under YaRN: mscale(factor,
    mscale_all_dim)^2 (DeepSeek-V2/V3), else 1."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return _yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rope_tables(seq_len: int, head_dim: int, theta: float,
                scaling: RopeScalingConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_SH, sin_SH (fp32, [S, head_dim/2]) for rotary position embeddings
    (``scaling``: a ``model.rope_scaling`` variant; cos/sin include its attention factor)."""
    if head_dim % 2:
        raise ValueError(f"rotary head dim {head_dim} must be even")
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling)
    angles_SH = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    if attention_factor == 1.0:
        return angles_SH.cos().float(), angles_SH.sin().float()
    cos, sin = angles_SH.cos() * attention_factor, angles_SH.sin() * attention_factor
    return cos.float(), sin.float()


def apply_rope(x_BHSh: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor,
               start: int = 0) -> torch.Tensor:
    """Rotate the two halves of the last dim of x [B, H, S, h] by position (fp32 math);
    the first row of x sits at position ``start``."""
    S = x_BHSh.shape[-2]
    x = x_BHSh.float()
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos_SH[start:start + S], sin_SH[start:start + S]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x_BHSh.dtype)


class LayerKV:
    """One attention layer's cached keys and values, k [B, G, S, hk] and v [B, G, S, hv]
    (None before the first call). ``length``: positions cached."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' k, v; return every cached position's."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k, self.v = torch.cat((self.k, k), dim=-2), torch.cat((self.v, v), dim=-2)
        return self.k, self.v


class KVCache:
    """Keys and values of the tokens a :class:`Transformer` has seen, per layer, for
    incremental decoding: ``model(prompt_BS, cache=c)`` then ``model(next_B1, cache=c)``
    gives the logits a full forward over the concatenation would (causal attention).
    ``length``: tokens cached (at most ``model.seq_len``: the rotary tables end there)."""

    def __init__(self, num_layers: int):
        self.layers = [LayerKV() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


def cached_attention(q_BHSh: torch.Tensor, k_BGTh: torch.Tensor, v_BGTh: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention of S new queries (the last S of T positions) over T keys."""
    S, T = q_BHSh.shape[-2], k_BGTh.shape[-2]
    gqa = k_BGTh.shape[1] != q_BHSh.shape[1]
    if S == T:
        return F.scaled_dot_product_attention(q_BHSh, k_BGTh, v_BGTh, is_causal=True,
                                              scale=scale, enable_gqa=gqa)
    mask_ST = None
    if S > 1:  # query i sits at position T - S + i and sees keys up to it
        pos = torch.arange(T, device=q_BHSh.device)
        mask_ST = pos.unsqueeze(0) <= (pos[T - S:].unsqueeze(1))
    return F.scaled_dot_product_attention(q_BHSh, k_BGTh, v_BGTh, attn_mask=mask_ST,
                                          scale=scale, enable_gqa=gqa)


_COMPILED_FLEX: list = []   # torch.compile(flex_attention), made on first use on a device


def _flex_kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """flex_attention compiled (its fused block-sparse kernel) on accelerators; on CPU its
    eager form (a reference: forward only, used by the tests)."""
    if device.type == "cpu":
        return flex_attention
    if not _COMPILED_FLEX:
        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED_FLEX[0]


def attend(q_BHSh: torch.Tensor, k_BGSh: torch.Tensor, v_BGSh: torch.Tensor, attn_mask=None,
           scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Attention over a whole sequence. ``attn_mask``: None (plain causal, SDPA's causal
    kernels), a dense bool [B, 1, S, S] mask (True where a query may attend, causal
    included; :func:`document_mask`), or a FlexAttention ``BlockMask``
    (:func:`document_block_mask`), whose kernel skips the tiles the mask empties."""
    if BlockMask is not None and isinstance(attn_mask, BlockMask):
        kernel = _flex_kernel(q_BHSh.device)
        if kernel is not flex_attention:  # compiled (no warnings context in its graph)
            return kernel(q_BHSh, k_BGSh, v_BGSh, block_mask=attn_mask, scale=scale,
                          enable_gqa=enable_gqa)
        with warnings.catch_warnings():  # the eager form warns that it is not compiled
            warnings.filterwarnings("ignore", message=".*flex_attention called without")
            return kernel(q_BHSh, k_BGSh, v_BGSh, block_mask=attn_mask, scale=scale,
                          enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q_BHSh, k_BGSh, v_BGSh, attn_mask=attn_mask,
                                          is_causal=attn_mask is None, scale=scale,
                                          enable_gqa=enable_gqa)


def hold_attention_output(attn: nn.Module, o_BHSh: torch.Tensor, o_BSD: torch.Tensor) -> None:
    """Under ``train.activation_storage: fp8`` (``attn.fp8_storage``, set by
    :func:`epscale.parallel.activation.apply_activation_storage`): offer the attention
    kernel's output ``o_BHSh`` (where the kernel keeps it for its backward: the fused
    kernels, flash, memory-efficient, cuDNN and flex, do; SDPA's math path does not) and
    the output projection's input ``o_BSD`` ([B, S, H*hv], the same memory where the
    kernel writes [B, S, H, hv]) to the store, which keeps those in fp8 until backward
    (:meth:`epscale.moe.saved_fp8.Fp8Storage.hold`)."""
    store = getattr(attn, "fp8_storage", None)
    if store is None:
        return
    node = o_BHSh.grad_fn
    kept = node is not None and "Attention" in type(node).__name__
    store.hold(**({"kernel_out": o_BHSh} if kept else {}), proj_input=o_BSD)


class Attention(nn.Module):
    """Causal multi-head attention (grouped-query when num_kv_heads < num_heads; with
    ``qk_norm`` each head's query and key RMS-normalised before RoPE, as Qwen3 does)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads or cfg.num_heads
        self.head_dim = cfg.head_dim or cfg.dim // cfg.num_heads
        h, H, G = self.head_dim, self.num_heads, self.num_kv_heads
        self.wq = nn.Linear(cfg.dim, H * h, bias=False)
        self.wk = nn.Linear(cfg.dim, G * h, bias=False)
        self.wv = nn.Linear(cfg.dim, G * h, bias=False)
        self.wo = nn.Linear(H * h, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.norm_eps)
            self.k_norm = RMSNorm(h, cfg.norm_eps)
        self._rope = (cfg.seq_len, h, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_tables(*self._rope)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_buffers(self) -> None:
        """The rotary tables again (after ``to_empty`` from the meta device)."""
        cos, sin = rope_tables(*self._rope)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def _qkv(self, x_BSD: torch.Tensor, start: int = 0):
        """q [B, H, S, h], k and v [B, G, S, h], rotated for positions start.. ."""
        B, S, _ = x_BSD.shape
        h, H, G = self.head_dim, self.num_heads, self.num_kv_heads
        q = self.wq(x_BSD).view(B, S, H, h)
        k = self.wk(x_BSD).view(B, S, G, h)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.wv(x_BSD).view(B, S, G, h).transpose(1, 2)
        q = apply_rope(q.transpose(1, 2), self.rope_cos, self.rope_sin, start)
        k = apply_rope(k.transpose(1, 2), self.rope_cos, self.rope_sin, start)
        return q, k, v

    def forward(self, x_BSD: torch.Tensor, kv: LayerKV | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``attn_mask``: None (plain causal) or a document mask (:func:`attend`)."""
        B, S, _ = x_BSD.shape
        h, H, G = self.head_dim, self.num_heads, self.num_kv_heads
        if kv is not None:  # incremental decoding
            q, k, v = self._qkv(x_BSD, kv.length)
            o_BHSh = cached_attention(q, *kv.append(k, v))
            return self.wo(o_BHSh.transpose(1, 2).reshape(B, S, H * h))
        q, k, v = self._qkv(x_BSD)
        o_BHSh = attend(q, k, v, attn_mask, enable_gqa=G != H)
        o_BSD = o_BHSh.transpose(1, 2).reshape(B, S, H * h)
        hold_attention_output(self, o_BHSh, o_BSD)
        return self.wo(o_BSD)


class LatentAttention(nn.Module):
    """DeepSeek multi-head latent attention (MLA): queries and keys/values go through
    low-rank latents; a small rotary part of the key is shared by all heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = H = cfg.num_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        eps = cfg.norm_eps if cfg.latent_norm_eps is None else cfg.latent_norm_eps
        if cfg.q_lora_rank > 0:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, H * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, eps)
        self.wkv_b = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, cfg.dim, bias=False)
        # softmax scale: 1/sqrt(qk head dim), times YaRN's mscale^2 where it asks
        self.scale = qk ** -0.5 * rope_softmax_scale(cfg.rope_scaling)
        self._rope = (cfg.seq_len, self.rope, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_tables(*self._rope)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    reset_buffers = Attention.reset_buffers

    def _qkv(self, x_BSD: torch.Tensor, start: int = 0):
        """q and k [B, H, S, nope + rope], v [B, H, S, v], rotated for positions start.. ."""
        B, S, _ = x_BSD.shape
        H, qk = self.num_heads, self.nope + self.rope
        q = self.wq_b(self.q_norm(self.wq_a(x_BSD))) if hasattr(self, "wq_a") else self.wq(x_BSD)
        q = q.view(B, S, H, qk).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv_lat, k_pe = self.wkv_a(x_BSD).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv_lat)).view(B, S, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_pe = apply_rope(q_pe, self.rope_cos, self.rope_sin, start)
        k_pe = apply_rope(k_pe.unsqueeze(1), self.rope_cos, self.rope_sin,
                          start).expand(B, H, S, self.rope)
        return torch.cat((q_nope, q_pe), dim=-1), torch.cat((k_nope, k_pe), dim=-1), v

    def forward(self, x_BSD: torch.Tensor, kv: LayerKV | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        if kv is not None:  # incremental decoding (keys and values cached expanded)
            q, k, v = self._qkv(x_BSD, kv.length)
            o_BHSh = cached_attention(q, *kv.append(k, v), scale=self.scale)
            return self.wo(o_BHSh.transpose(1, 2).reshape(B, S, self.num_heads * self.v_dim))
        q, k, v = self._qkv(x_BSD)
        o_BHSh = attend(q, k, v, attn_mask, scale=self.scale)
        o_BSD = o_BHSh.transpose(1, 2).reshape(B, S, self.num_heads * self.v_dim)
        hold_attention_output(self, o_BHSh, o_BSD)
        return self.wo(o_BSD)


def run_plainly(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``fn(*args)``: a block's forward without activation checkpointing."""
    return fn(*args)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = LatentAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.ffn = MoE(moe_cfg) if self.is_moe else FeedForward(cfg.dim, cfg.dense_hidden_dim,
                                                                moe_cfg.activation)
        self.timer: Callable[[str], ContextManager] = lambda name: contextlib.nullcontext()
        # how forward runs the block: plainly, or recomputed in backward (set by
        # epscale.parallel.activation for train.activation_checkpointing)
        self.run_forward: Callable[..., torch.Tensor] = run_plainly

    def forward(self, x_BSD: torch.Tensor, kv: LayerKV | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if kv is not None:  # incremental decoding: inference, nothing to recompute
            return self._forward(x_BSD, kv)
        if attn_mask is not None:
            return self.run_forward(self._forward, x_BSD, None, attn_mask)
        return self.run_forward(self._forward, x_BSD)

    def _forward(self, x_BSD: torch.Tensor, kv: LayerKV | None = None,
                 attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        with self.timer("attention"):
            x_BSD = x_BSD + self.attention(self.attention_norm(x_BSD), kv, attn_mask)
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))


class MTPModule(nn.Module):
    """One of DeepSeek-V3's multi-token-prediction modules (report section 2.2), the k-th
    (k = 1..``model.mtp_depth``): from the previous depth's hidden state h^{k-1} [B, S, D]
    (h^0: the main model's last block output, before the final norm) and the embedding
    e [B, S, D] of token i + k at position i it computes
    ``h^k = block(eh_proj([enorm(e); hnorm(h^{k-1})]))`` and the head's input
    ``norm(h^k)`` (its own final norm, Hugging Face's ``shared_head.norm``); the embedding
    and the output head are the main model's (:meth:`Transformer.mtp_loss_terms`).

    The concatenation is [normed embedding; normed hidden state], the order of DeepSeek's
    released checkpoints (and vLLM's / SGLang's readers of them; the report's equation 21
    writes the two the other way round), so ``eh_proj`` [D, 2D] loads from them as it is.
    ``block`` is a :class:`Block` with layer id ``num_layers + k - 1`` (where Hugging
    Face's DeepSeek-V3 layout stores module k): parallelized, recomputed and compiled as
    the main blocks are (``epscale.parallel.activation.transformer_blocks`` lists it)."""

    def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig, layer_id: int):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg, moe_cfg, layer_id)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h_BSD: torch.Tensor, e_BSD: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """h^k [B, S, D] (before ``norm``) from h^{k-1} and the shifted embeddings."""
        x_BSD = self.eh_proj(torch.cat((self.enorm(e_BSD), self.hnorm(h_BSD)), dim=-1))
        x_BSD = x_BSD.to(h_BSD.dtype)   # autocast's bf16 product: the stream stays fp32
        return self.block(x_BSD) if attn_mask is None else self.block(x_BSD, None, attn_mask)


def mtp_shift(t_BS: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``t_BS`` moved k positions to the left (position i holds t[i + k]); the last k
    positions hold ``fill``."""
    out = t_BS.roll(-k, dims=1)
    out[:, t_BS.shape[1] - k:] = fill
    return out


def document_ids(tokens_BS: torch.Tensor, eos_id: int) -> torch.Tensor:
    """int64 [B, S]: the document of each token within its sequence (0, 1, ...); a
    document ends with (and includes) an ``eos_id`` token."""
    is_eos_BS = tokens_BS == eos_id
    return torch.cumsum(is_eos_BS, dim=1) - is_eos_BS.long()


def document_mask(tokens_BS: torch.Tensor, eos_id: int) -> torch.Tensor:
    """bool [B, 1, S, S]: query i may attend key j when j <= i and both lie in the same
    document (:func:`document_ids`). Every query sees itself, so no row is empty."""
    doc_BS = document_ids(tokens_BS, eos_id)
    S = tokens_BS.shape[1]
    causal_SS = torch.ones(S, S, dtype=torch.bool, device=tokens_BS.device).tril()
    return ((doc_BS.unsqueeze(2) == doc_BS.unsqueeze(1)) & causal_SS).unsqueeze(1)


def document_block_mask(tokens_BS: torch.Tensor, eos_id: int):
    """The same mask as :func:`document_mask` as a FlexAttention ``BlockMask`` (causal AND
    same document, one for all heads): tiles of (query, key) blocks it empties are
    skipped, so attention costs O(S x document length), not O(S^2)."""
    if create_block_mask is None:
        raise RuntimeError(f"FlexAttention is not in this torch ({torch.__version__}); "
                           "document masking needs the dense mask (document_mask)")
    doc_BS = document_ids(tokens_BS, eos_id)
    B, S = tokens_BS.shape

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc_BS[b, q_idx] == doc_BS[b, kv_idx])

    return create_block_mask(causal_same_document, B, None, S, S, device=tokens_BS.device)


DOC_MASKS = ("auto", "flex", "dense")


def uses_flex(kind: str, device: torch.device) -> bool:
    """Whether document masking of ``kind`` (one of :data:`DOC_MASKS`) on ``device`` runs
    FlexAttention: 'auto' on accelerators where torch has it (its CPU form has no
    backward), 'flex' always, 'dense' never."""
    if kind not in DOC_MASKS:
        raise ValueError(f"document mask kind {kind!r}: must be one of {', '.join(DOC_MASKS)}")
    if kind == "auto":
        return device.type != "cpu" and flex_attention is not None
    return kind == "flex"


class Transformer(nn.Module):
    """Decoder-only language model. ``forward(tokens_BS)`` (int64 ids < vocab_size,
    S <= seq_len) returns fp32 logits [B, S, V]; ``loss(tokens_BS, targets_BS)`` the mean
    next-token cross-entropy (without the MoE auxiliary losses, see :meth:`aux_loss`),
    through the fused chunked head (:meth:`head_loss`: no [T, V] logits kept).
    ``forward(tokens_BS, cache=KVCache(num_layers))`` decodes incrementally: the tokens
    continue the ones cached before (cached + new <= seq_len). ``mtp`` (``model.mtp_depth``
    :class:`MTPModule` s, or None): trained through :meth:`loss` and :meth:`mtp_loss`;
    logits and decoding ignore them."""

    def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig):
        super().__init__()
        if moe_cfg.dim != cfg.dim:
            raise ValueError(f"moe.dim={moe_cfg.dim} must equal model.dim={cfg.dim}")
        self.cfg, self.moe_cfg = cfg, moe_cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # keyed by layer index (names layers.{i}. as a list would): a pipeline stage keeps
        # only its own blocks, under the same names (epscale.parallel.pipeline)
        self.layers = nn.ModuleDict({str(i): Block(cfg, moe_cfg, i) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # under a pipeline, the last stage's copy of tok_embeddings where that stage uses
        # the embedding (a tied head, the MTP modules); None in a whole model (see
        # epscale.parallel.stage_embedding)
        self.stage_embedding: nn.Embedding | None = None
        # model.mtp_depth multi-token-prediction modules, keyed by their block's layer id
        # (num_layers + k - 1); None without (the state dict is then the plain model's)
        L = cfg.num_layers
        self.mtp = (nn.ModuleDict({str(L + k): MTPModule(cfg, moe_cfg, L + k)
                                   for k in range(cfg.mtp_depth)}) if cfg.mtp_depth else None)
        # the modules' losses of the last training loss() (0-dim each)
        self.last_mtp_losses: list[torch.Tensor] = []
        self.doc_eos_id: int | None = None  # set_document_masking
        self.doc_mask_kind = "auto"

    def set_document_masking(self, eos_id: int | None, kind: str = "auto") -> None:
        """``data.doc_masking``: with ``eos_id`` set, a token attends only to the earlier
        tokens of its own document (a document ends with its ``eos_id``; see
        :func:`document_mask`) and :meth:`loss` skips the targets that follow an EOS
        (the first token of the next document, which the model cannot see coming).
        ``kind`` (:func:`uses_flex`): on accelerators ('auto') a FlexAttention block mask
        (:func:`document_block_mask`), whose compiled kernel skips the masked tiles, with
        GQA and MLA alike; on CPU the dense bool [B, 1, S, S] mask, which torch's CPU
        flash kernel takes (FlexAttention has no CPU backward). Incremental decoding
        (``cache=``) ignores it."""
        if kind not in DOC_MASKS:
            raise ValueError(f"document mask kind {kind!r}: must be one of {', '.join(DOC_MASKS)}")
        self.doc_eos_id, self.doc_mask_kind = eos_id, kind

    def attention_mask(self, tokens_BS: torch.Tensor):
        """The document mask of ``tokens_BS`` for every block (None without document
        masking): a BlockMask or the dense mask, by ``set_document_masking``'s kind."""
        if self.doc_eos_id is None:
            return None
        if uses_flex(self.doc_mask_kind, tokens_BS.device):
            return document_block_mask(tokens_BS, self.doc_eos_id)
        return document_mask(tokens_BS, self.doc_eos_id)

    def param_init(self, name: str) -> tuple[str, float | None]:
        """How parameter ``name`` starts: N(0, 0.02) for embeddings and dense projections,
        residual outputs (``wo``, ``w2``) scaled by 1/sqrt(2*layers) (GPT-2), the router
        N(0, 1/sqrt(D)), routed experts N(0, 1/sqrt(D)) in and N(0, 1/sqrt(F)) out, norms
        ones. The values come from :func:`epscale.model_init.initialize_`, the
        same at every layout."""
        std = 0.02
        if name.endswith("norm.weight"):
            return "ones", None
        if ".router." in name:
            return "normal", self.cfg.dim ** -0.5
        if ".experts." in name:
            F = self.moe_cfg.hidden_dim
            return "normal", (F ** -0.5 if name.endswith("w2") else self.cfg.dim ** -0.5)
        module = name.rsplit(".", 1)[0]
        if module.endswith(("wo", "w2")):
            return "normal", std / math.sqrt(2 * self.cfg.num_layers)
        return "normal", std

    def blocks(self) -> list[Block]:
        """Every transformer block, in depth order: the main ones, then the
        multi-token-prediction modules' (layer ids ``num_layers`` ..)."""
        mtp = [m.block for m in self.mtp.values()] if self.mtp is not None else []
        return list(self.layers.values()) + mtp

    def moe_layers(self) -> list[MoE]:
        """The MoE layers, in depth order (the multi-token-prediction blocks' last)."""
        return [b.ffn for b in self.blocks() if isinstance(b.ffn, MoE)]

    def set_timer(self, timer: Callable[[str], ContextManager]) -> None:
        """Route the 'attention' and MoE ('router', 'dispatch', ...) sections to ``timer``."""
        for block in self.blocks():
            block.timer = timer
        for moe in self.moe_layers():
            moe.timer = timer

    def forward(self, tokens_BS: torch.Tensor, cache: KVCache | None = None,
                targets_BS: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [B, S, V]; with ``targets_BS`` (int64 [B, S], -100 skipped) the mean
        next-token loss through the fused head instead (:meth:`head_loss`; what
        :meth:`loss` runs: through ``__call__``, so that FSDP's and other wrappers' forward
        hooks run), and in training mode with multi-token-prediction modules the tuple
        (that loss, L^1, .., L^D) (:meth:`mtp_loss_terms`)."""
        if tokens_BS.dim() != 2:
            raise ValueError(f"Transformer.forward expects token ids [B, S], got shape "
                             f"{tuple(tokens_BS.shape)}")
        seen = 0 if cache is None else cache.length
        if seen + tokens_BS.shape[1] > self.cfg.seq_len:
            before = f"{seen} cached + " if cache is not None else ""
            raise ValueError(f"sequence length {before}{tokens_BS.shape[1]} exceeds "
                             f"model.seq_len={self.cfg.seq_len}")
        h_BSD = self.hidden(tokens_BS, cache)
        if targets_BS is not None:
            loss = self.head_loss(h_BSD, targets_BS)
            if self.mtp is not None and self.training:
                return (loss, *self.mtp_loss_terms(h_BSD, tokens_BS, targets_BS))
            return loss
        return self.logits(h_BSD)

    def hidden(self, tokens_BS: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """The last block's output [B, S, D] (before the final norm)."""
        h_BSD = self.tok_embeddings(tokens_BS)
        mask = self.attention_mask(tokens_BS) if cache is None else None
        for block in self.layers.values():
            if cache is not None:
                h_BSD = block(h_BSD, cache.layers[block.layer_id])
            else:
                h_BSD = block(h_BSD) if mask is None else block(h_BSD, None, mask)
        return h_BSD

    def head_side_embedding(self) -> nn.Embedding:
        """The embedding the head's side of the model uses (the tied head, the
        multi-token-prediction modules' shifted tokens): ``tok_embeddings``, or where the
        model is cut into pipeline stages the last stage's copy of it."""
        return self.tok_embeddings if self.stage_embedding is None else self.stage_embedding

    def head_weight(self) -> torch.Tensor:
        """The output head's weight [V, D]: the embedding's when tied."""
        return self.head_side_embedding().weight if self.output is None else self.output.weight

    def logits(self, h_BSD: torch.Tensor) -> torch.Tensor:
        """The final norm and the output head: fp32 logits [B, S, V] of the last block's
        output."""
        h_BSD = self.norm(h_BSD)
        return F.linear(h_BSD, self.head_weight().to(h_BSD.dtype)).float()

    def head_loss(self, h_BSD: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """The final norm, the output head and the mean next-token cross-entropy of the
        last block's output ``h_BSD`` against ``targets_BS`` (int64 [B, S], -100 skipped),
        fused over chunks of tokens (:func:`epscale.head_loss.head_loss`): equal to
        ``next_token_loss(self.logits(h_BSD), targets_BS)`` without the [T, V] logits
        kept for backward."""
        h_TD = self.norm(h_BSD).flatten(0, 1)
        return head_loss(h_TD, self.head_weight(), targets_BS.reshape(-1))

    def mtp_targets(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor,
                    k: int) -> torch.Tensor:
        """The targets of multi-token-prediction depth k: position i predicts token
        i + k + 1 (``targets_BS[i + k]``); -100 at the last k positions (past the
        sequence) and, with document masking, where any of tokens i .. i + k is an EOS (the
        target lies in a later document; :meth:`loss_targets` is the case k = 0)."""
        y_BS = mtp_shift(targets_BS, k, -100)
        if self.doc_eos_id is None:
            return y_BS
        eos_BS = tokens_BS == self.doc_eos_id
        crossed_BS = eos_BS.clone()
        for j in range(1, k + 1):
            crossed_BS |= mtp_shift(eos_BS, j, False)
        return y_BS.masked_fill(crossed_BS, -100)

    def mtp_loss_terms(self, h_BSD: torch.Tensor, tokens_BS: torch.Tensor,
                       targets_BS: torch.Tensor) -> list[torch.Tensor]:
        """The multi-token-prediction losses L^1 .. L^D (0-dim each) from the main model's
        last block output ``h_BSD``: module k takes h^{k-1} and the shared embedding of
        the tokens k positions ahead (:func:`mtp_shift`; the last k positions' inputs
        wrap around, their targets are -100), and its loss is the shared head's chunked
        cross-entropy (:func:`epscale.head_loss.head_loss`: no [T, V] logits) of its own
        final norm's output against :meth:`mtp_targets`."""
        mask = self.attention_mask(tokens_BS)
        embedding, losses = self.head_side_embedding(), []
        for k, module in enumerate(self.mtp.values(), start=1):
            e_BSD = embedding(tokens_BS.roll(-k, dims=1))
            h_BSD = module(h_BSD, e_BSD, mask)
            y_T = self.mtp_targets(tokens_BS, targets_BS, k).reshape(-1)
            losses.append(head_loss(module.norm(h_BSD).flatten(0, 1), self.head_weight(), y_T))
        return losses

    def mtp_loss(self) -> torch.Tensor:
        """The mean of the multi-token-prediction losses of the last :meth:`loss` in
        training mode, (1 / D) * sum_k L^k (0-dim; 0 without modules or in eval mode). The
        trainer adds ``train.mtp_loss_weight`` times it to the loss."""
        if not self.last_mtp_losses:
            return torch.zeros((), device=self.tok_embeddings.weight.device)
        return torch.stack(self.last_mtp_losses).mean()

    def loss_targets(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """The targets the loss counts: with document masking, -100 after each EOS (no
        loss across the EOS -> next-document join)."""
        if self.doc_eos_id is None:
            return targets_BS
        return targets_BS.masked_fill(tokens_BS == self.doc_eos_id, -100)

    def loss(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss (0-dim); in training mode with multi-token-prediction
        modules their losses are kept for :meth:`mtp_loss` (returned by the forward beside
        the main loss, so that wrappers' backward hooks see them: FSDP gathers the shared
        head again before their backward reaches it)."""
        out = self(tokens_BS, targets_BS=self.loss_targets(tokens_BS, targets_BS))
        if isinstance(out, tuple):
            self.last_mtp_losses = list(out[1:])
            return out[0]
        self.last_mtp_losses = []
        return out

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' router losses from the last forward (0-dim tensor)."""
        total = torch.zeros((), device=self.tok_embeddings.weight.device)
        for moe in self.moe_layers():
            total = total + moe.aux_loss.to(total.device)
        return total


def next_token_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits against the next tokens (targets -100 skipped)."""
    return F.cross_entropy(logits_BSV.view(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1))


def build_model(cfg: RunConfig, device: torch.device | str | None = None,
                seed: int | None = None) -> Transformer:
    """The full (unsharded) model on ``device`` (default: torch's default device, the CPU
    unless ``torch.set_default_device`` said otherwise), initialised from ``seed`` (default
    ``train.seed``), identical on every rank and to any sharded build of the same seed
    (``epscale.parallel.materialize``)."""
    seed = cfg.train.seed if seed is None else seed
    torch.manual_seed(seed)
    model = Transformer(cfg.model, cfg.moe)
    initialize_(model, model.param_init, seed)
    return model if device is None else model.to(device)


def build_meta_model(cfg: RunConfig) -> Transformer:
    """The model on the meta device: shapes only, no memory. Parallelize and shard it,
    then materialise each rank's part (:func:`epscale.parallel.parallelize_model`)."""
    with torch.device("meta"):
        return Transformer(cfg.model, cfg.moe)
