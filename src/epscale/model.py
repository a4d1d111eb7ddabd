"""A small decoder-only MoE transformer: the trainer's model.

Token embedding -> ``num_layers`` pre-norm blocks (causal attention with RoPE through
``scaled_dot_product_attention``; a dense SwiGLU/GELU FFN for the first
``num_dense_layers`` and then an :class:`epscale.MoE` every ``moe_every`` layers, GLaM
style) -> RMSNorm -> output head (tied to the embedding or not).

Legend: B batch (sequences), S sequence length, D model dim, H query heads, G key/value
heads, h head dim, V vocabulary, T tokens (B*S).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, MoEConfig, RunConfig
from .moe.experts import FeedForward
from .moe.layer import MoE
from .parallel import activation
from .parallel.materialize import initialize_, reset_buffers_
from .parallel.shard import mark_all_expert_params


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in fp32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_SH, sin_SH (fp32, [S, head_dim/2]) for rotary position embeddings."""
    if head_dim % 2:
        raise ValueError(f"rotary head dim {head_dim} must be even")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles_SH = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles_SH.cos().float(), angles_SH.sin().float()


def apply_rope(x_BHSh: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dim of x [B, H, S, h] by position (fp32 math)."""
    S = x_BHSh.shape[-2]
    x = x_BHSh.float()
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos_SH[:S], sin_SH[:S]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x_BHSh.dtype)


class Attention(nn.Module):
    """Causal multi-head attention (grouped-query when num_kv_heads < num_heads)."""

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
        self._rope = (cfg.seq_len, h, cfg.rope_theta)
        cos, sin = rope_tables(*self._rope)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_buffers(self) -> None:
        """The rotary tables again (after ``to_empty`` from the meta device)."""
        cos, sin = rope_tables(*self._rope)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        h, H, G = self.head_dim, self.num_heads, self.num_kv_heads
        q = self.wq(x_BSD).view(B, S, H, h).transpose(1, 2)
        k = self.wk(x_BSD).view(B, S, G, h).transpose(1, 2)
        v = self.wv(x_BSD).view(B, S, G, h).transpose(1, 2)
        q = apply_rope(q, self.rope_cos, self.rope_sin)
        k = apply_rope(k, self.rope_cos, self.rope_sin)
        o_BHSh = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G != H)
        return self.wo(o_BHSh.transpose(1, 2).reshape(B, S, H * h))


class LatentAttention(nn.Module):
    """DeepSeek multi-head latent attention (MLA): queries and keys/values go through
    low-rank latents; a small rotary part of the key is shared by all heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = H = cfg.num_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank > 0:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, H * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, cfg.dim, bias=False)
        self._rope = (cfg.seq_len, self.rope, cfg.rope_theta)
        cos, sin = rope_tables(*self._rope)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    reset_buffers = Attention.reset_buffers

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        H, qk = self.num_heads, self.nope + self.rope
        q = self.wq_b(self.q_norm(self.wq_a(x_BSD))) if hasattr(self, "wq_a") else self.wq(x_BSD)
        q = q.view(B, S, H, qk).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv_lat, k_pe = self.wkv_a(x_BSD).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv_lat)).view(B, S, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_pe = apply_rope(q_pe, self.rope_cos, self.rope_sin)
        k_pe = apply_rope(k_pe.unsqueeze(1), self.rope_cos, self.rope_sin).expand(B, H, S, self.rope)
        q = torch.cat((q_nope, q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        o_BHSh = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o_BHSh.transpose(1, 2).reshape(B, S, H * self.v_dim))


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
        # train.activation_checkpointing (epscale.parallel.activation): 'none', 'full', 'selective'
        self.checkpointing = "none"

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return activation.run(self._forward, self.checkpointing, x_BSD)

    def _forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        with self.timer("attention"):
            x_BSD = x_BSD + self.attention(self.attention_norm(x_BSD))
        return x_BSD + self.ffn(self.ffn_norm(x_BSD))


class Transformer(nn.Module):
    """Decoder-only language model. ``forward(tokens_BS)`` (int64 ids < vocab_size,
    S <= seq_len) returns fp32 logits [B, S, V]; ``loss(tokens_BS, targets_BS)`` the mean
    next-token cross-entropy (without the MoE auxiliary losses, see :meth:`aux_loss`)."""

    def __init__(self, cfg: ModelConfig, moe_cfg: MoEConfig):
        super().__init__()
        if moe_cfg.dim != cfg.dim:
            raise ValueError(f"moe.dim={moe_cfg.dim} must equal model.dim={cfg.dim}")
        self.cfg, self.moe_cfg = cfg, moe_cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, moe_cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def param_init(self, name: str) -> tuple[str, float | None]:
        """How parameter ``name`` starts: N(0, 0.02) for embeddings and dense projections,
        residual outputs (``wo``, ``w2``) scaled by 1/sqrt(2*layers) (GPT-2), the router
        N(0, 1/sqrt(D)), routed experts N(0, 1/sqrt(D)) in and N(0, 1/sqrt(F)) out, norms
        ones. The values come from :func:`epscale.parallel.materialize.initialize_`, the
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

    def moe_layers(self) -> list[MoE]:
        """The MoE layers, in depth order."""
        return [b.ffn for b in self.layers if isinstance(b.ffn, MoE)]

    def set_timer(self, timer: Callable[[str], ContextManager]) -> None:
        """Route the 'attention' and MoE ('router', 'dispatch', ...) sections to ``timer``."""
        for block in self.layers:
            block.timer = timer
        for moe in self.moe_layers():
            moe.timer = timer

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        if tokens_BS.dim() != 2:
            raise ValueError(f"Transformer.forward expects token ids [B, S], got shape "
                             f"{tuple(tokens_BS.shape)}")
        if tokens_BS.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence length {tokens_BS.shape[1]} exceeds model.seq_len="
                             f"{self.cfg.seq_len}")
        h_BSD = self.tok_embeddings(tokens_BS)
        for block in self.layers:
            h_BSD = block(h_BSD)
        h_BSD = self.norm(h_BSD)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(h_BSD, weight.to(h_BSD.dtype)).float()

    def loss(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        logits_BSV = self(tokens_BS)
        return F.cross_entropy(logits_BSV.view(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1))

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' router losses from the last forward (0-dim tensor)."""
        total = torch.zeros((), device=self.tok_embeddings.weight.device)
        for moe in self.moe_layers():
            total = total + moe.aux_loss.to(total.device)
        return total


def iter_named_expert_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Routed-expert weights (leading dim = experts), by name."""
    for name, p in model.named_parameters():
        if ".experts." in f".{name}" and ".shared_experts." not in f".{name}":
            yield name, p


def build_model(cfg: RunConfig, device: torch.device | str | None = None,
                seed: int | None = None) -> Transformer:
    """The full (unsharded) model on ``device`` (default: torch's default device, the CPU
    unless ``torch.set_default_device`` said otherwise), initialised from ``seed`` (default
    ``train.seed``), identical on every rank and to any sharded build of the same seed
    (:func:`materialize`)."""
    seed = cfg.train.seed if seed is None else seed
    torch.manual_seed(seed)
    model = Transformer(cfg.model, cfg.moe)
    initialize_(model, model.param_init, seed)
    return model if device is None else model.to(device)


def build_meta_model(cfg: RunConfig) -> Transformer:
    """The model on the meta device: shapes only, no memory. Parallelize and shard it,
    then :func:`materialize` each rank's part."""
    with torch.device("meta"):
        return Transformer(cfg.model, cfg.moe)


def materialize(model: Transformer, device: torch.device | str, seed: int, dims=None) -> None:
    """Allocate a (parallelized, possibly FSDP-sharded) meta-device ``model`` on
    ``device`` and fill each rank's shard of every parameter with the values a
    single-process :func:`build_model` of ``seed`` holds there; buffers are set again."""
    model.to_empty(device=device)
    mark_all_expert_params(model)  # to_empty registered new parameter objects
    initialize_(model, model.param_init, seed, dims)
    reset_buffers_(model)
