"""Analytic model size and FLOPs of a recipe, exact for the model epscale builds (memory per
rank: :mod:`epscale.plan.memory`).

Everything here is computed from the :class:`~epscale.config.RunConfig` alone (no model is
built), so a 671B recipe is described in microseconds. The parameter count follows the
modules of ``epscale.model`` / ``epscale.moe`` one by one:

* token embedding ``V*D``; output head ``V*D`` unless ``tie_embeddings`` (counted once);
* per layer two RMSNorm weights ``2*D``; a final RMSNorm ``D``;
* attention ``mha``: wq ``D*H*hd``, wk/wv ``D*KV*hd`` each, wo ``H*hd*D`` (no biases),
  with ``qk_norm`` two RMSNorm weights ``2*hd``;
  ``mla`` (DeepSeek-V2/V3): wq_a ``D*q_lora`` + q_norm ``q_lora`` + wq_b
  ``q_lora*H*(nope+rope)`` (or wq ``D*H*(nope+rope)`` when ``q_lora_rank`` is 0), wkv_a
  ``D*(kv_lora+rope)``, kv_norm ``kv_lora``, wkv_b ``kv_lora*H*(nope+v)``, wo ``H*v*D``;
* dense FFN ``m*D*dense_hidden_dim`` with ``m`` = 3 for SwiGLU, 2 for GELU;
* MoE layer: router gate ``E*D``, routed experts ``E*m*D*F``, shared experts
  ``m*D*shared_width`` (the expert bias is a buffer, not a parameter).
* multi-token-prediction modules (``model.mtp_depth`` = Dm): each one block more (layer
  id ``num_layers + k - 1``, MoE or dense by the model's pattern, counted in the categories
  above), three RMSNorm weights ``3*D`` (enorm, hnorm, its final norm) and the projection
  eh_proj ``2*D*D``; the embedding and head are shared with the model (Hugging Face's
  DeepSeek-V3 files hold a copy of each per module, which epscale does not count).
  ``mtp_params`` is the modules' total (included in the categories).

Active parameters are those one token touches: everything except the ``E-K`` routed
experts it does not choose per MoE layer (the embedding table counts in full, the
convention behind the published "active" figures of Mixtral, DeepSeek-V3 and Qwen3).

FLOPs per token (training = forward + backward = 3x forward): ``2`` per multiply-add of
every active matrix (all weights except the embedding lookup and the norms), plus the
attention scores and the weighted sum over the causal context, ``2*H*(dqk+dv)`` per key
with ``(S+1)/2`` keys on average per query (causal kernels skip the masked half). Each
multi-token-prediction module adds its block, its projection and one more pass of the
output head.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..config import ModelConfig, MoEConfig, RunConfig


def _ffn_mats(activation: str) -> int:
    return 3 if activation == "swiglu" else 2


def head_dim(model: ModelConfig) -> int:
    """Per-head width of ``mha`` attention (``model.head_dim`` or ``dim // num_heads``)."""
    return model.head_dim or model.dim // model.num_heads


def attention_params(model: ModelConfig) -> int:
    """Weights of one attention block (without its input norm)."""
    D, H = model.dim, model.num_heads
    if model.attention == "mla":
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        if model.q_lora_rank > 0:
            q = D * model.q_lora_rank + model.q_lora_rank + model.q_lora_rank * H * qk
        else:
            q = D * H * qk
        kv = (D * (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank
              + model.kv_lora_rank * H * (model.qk_nope_head_dim + model.v_head_dim))
        return q + kv + H * model.v_head_dim * D
    hd, kv_heads = head_dim(model), model.num_kv_heads or model.num_heads
    qk_norm = 2 * hd if model.qk_norm else 0   # one RMSNorm weight each for queries, keys
    return 2 * D * H * hd + 2 * D * kv_heads * hd + qk_norm


def attention_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs of QK^T and AV for one query over its causal context, one layer."""
    H = model.num_heads
    if model.attention == "mla":
        dqk, dv = model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
    else:
        dqk = dv = head_dim(model)
    return 2.0 * H * (dqk + dv) * (model.seq_len + 1) / 2


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts and training FLOPs of one recipe (see the module docstring)."""

    total_params: int
    active_params: int
    embedding_params: int       # input embedding + untied output head
    attention_params: int       # all layers' attention blocks (incl. MLA norms)
    expert_params: int          # routed experts, all MoE layers
    shared_expert_params: int
    dense_ffn_params: int       # FFNs of the dense (non-MoE) layers
    router_params: int
    norm_params: int
    mtp_proj_params: int        # the multi-token-prediction modules' eh_proj weights
    num_moe_layers: int         # incl. the multi-token-prediction modules' MoE blocks
    flops_per_token: float      # training (fwd + bwd), incl. attention over seq_len
    mtp_params: int = 0         # every weight of the multi-token-prediction modules

    def as_dict(self) -> dict:
        return asdict(self)


def expert_params_per_expert(moe: MoEConfig) -> int:
    return _ffn_mats(moe.activation) * moe.dim * moe.hidden_dim


def _block_counts(model: ModelConfig, moe: MoEConfig, ids: range) -> dict[str, int]:
    """The weights of the blocks ``ids`` (their two norms included), by category."""
    D, m = model.dim, _ffn_mats(moe.activation)
    n_moe = sum(model.is_moe_layer(i) for i in ids)
    n_dense = len(ids) - n_moe
    return {
        "attention_params": len(ids) * attention_params(model),
        "expert_params": n_moe * moe.num_experts * expert_params_per_expert(moe),
        "shared_expert_params": n_moe * m * D * moe.shared_width,
        "dense_ffn_params": n_dense * m * D * model.dense_hidden_dim,
        "router_params": n_moe * moe.num_experts * D,
        "norm_params": 2 * len(ids) * D,
        "num_moe_layers": n_moe,
    }


def _counts(model: ModelConfig, moe: MoEConfig) -> dict[str, int]:
    D, V, L, Dm = model.dim, model.vocab_size, model.num_layers, model.mtp_depth
    main = _block_counts(model, moe, range(L))
    mtp = _block_counts(model, moe, range(L, L + Dm))
    c = {k: main[k] + mtp[k] for k in main}
    c["norm_params"] += D + 3 * D * Dm          # the final norm; each module's three
    c["mtp_proj_params"] = Dm * 2 * D * D
    c["embedding_params"] = V * D * (1 if model.tie_embeddings else 2)
    c["mtp_params"] = (sum(v for k, v in mtp.items() if k != "num_moe_layers")
                       + Dm * (3 * D + 2 * D * D))
    return c


def published_size(run_cfg: RunConfig) -> ModelSize:
    """:func:`model_size` of the model without its multi-token-prediction modules: what
    published counts give (DeepSeek-V3's 671B total and 37B active leave out its MTP
    module, listed apart: 685B on the hub)."""
    if not run_cfg.model.mtp_depth:
        return model_size(run_cfg)
    return model_size(replace(run_cfg, model=replace(run_cfg.model, mtp_depth=0)))


def model_size(run_cfg: RunConfig) -> ModelSize:
    """Parameter counts and training FLOPs per token of ``run_cfg``'s model."""
    model, moe = run_cfg.model, run_cfg.moe
    c = _counts(model, moe)
    n_moe = c["num_moe_layers"]
    total = sum(v for k, v in c.items() if k not in ("num_moe_layers", "mtp_params"))
    inactive = n_moe * (moe.num_experts - moe.top_k) * expert_params_per_expert(moe)
    active = total - inactive
    input_embedding = model.vocab_size * model.dim
    # Matmul weights a token's forward multiplies by: all active params except the input
    # embedding lookup (a gather) and the norm weights (elementwise); the tied head is a
    # matmul even though its weights are the embedding's.
    matmul_active = active - input_embedding - c["norm_params"]
    if model.tie_embeddings:
        matmul_active += input_embedding
    blocks = model.num_layers + model.mtp_depth
    # each multi-token-prediction module runs the (shared) head once more
    matmul_active += model.mtp_depth * model.vocab_size * model.dim
    if model.attention == "mla":  # the MLA q/kv norms are elementwise too
        matmul_active -= blocks * (model.kv_lora_rank + model.q_lora_rank)
    elif model.qk_norm:           # as are the query/key norms
        matmul_active -= blocks * 2 * head_dim(model)
    fwd = 2.0 * matmul_active + blocks * attention_flops_per_token(model)
    return ModelSize(total_params=total, active_params=active, flops_per_token=3.0 * fwd, **c)

