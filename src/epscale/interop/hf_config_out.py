"""config.json of an epscale recipe in a transformers family's format (which family holds
the recipe exactly is :mod:`epscale.interop.hf_families`' question; this module only
writes the fields)."""

from __future__ import annotations

from typing import Any

from ..config import RunConfig
from .errors import HFError
from .hf_config import NEUTRAL
from .hf_families import ARCHITECTURES, EXPORT_FAMILIES, moe_layer_ids


def _rope_out(cfg: RunConfig) -> dict | None:
    rs = cfg.model.rope_scaling
    if rs is None:
        return None
    out: dict[str, Any] = {"rope_type": rs.type, "factor": rs.factor,
                           "original_max_position_embeddings": rs.original_seq_len}
    if rs.type == "yarn":
        out.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, truncate=rs.truncate)
        for key in ("mscale", "mscale_all_dim"):
            if getattr(rs, key):
                out[key] = getattr(rs, key)
        if rs.attention_factor is not None:
            out["attention_factor"] = rs.attention_factor
    else:
        out.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
    return out


def hf_from_recipe(cfg: RunConfig, family: str, dtype: str, source: dict | None = None,
                   special: dict[str, int | None] | None = None) -> dict:
    """config.json for ``cfg`` in ``family``'s format (what the family holds of ``cfg`` is
    checked first: :func:`epscale.interop.hf_families.choose`). ``source``: the
    config.json the run was imported from (its neutral fields are kept); ``special``:
    bos/eos/pad token ids of the export's tokenizer (they replace the source's)."""
    m, moe = cfg.model, cfg.moe
    moe_ids = moe_layer_ids(cfg)
    out: dict[str, Any] = {k: v for k, v in (source or {}).items()
                           if k in NEUTRAL and k not in ("architectures", "model_type")}
    for kind in ("bos", "eos", "pad"):
        key = f"{kind}_token_id"
        if special is not None:
            out[key] = special.get(kind)
        else:
            out.setdefault(key, None)
    rope = _rope_out(cfg)
    rope_params = {"rope_theta": m.rope_theta, **(rope or {"rope_type": "default"})}
    out.update({
        "architectures": [ARCHITECTURES[family]], "model_type": family,
        "vocab_size": m.vocab_size, "hidden_size": m.dim, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "rms_norm_eps": m.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": m.tie_embeddings, "attention_dropout": 0.0,
        "rope_theta": m.rope_theta, "rope_scaling": rope, "dtype": dtype,
        "rope_parameters": rope_params,
    })
    out.setdefault("max_position_embeddings", m.seq_len)
    out.setdefault("initializer_range", 0.02)
    shared = moe.shared_width // moe.hidden_dim
    if family != "deepseek_v3":
        out.update(num_key_value_heads=m.num_kv_heads or m.num_heads,
                   head_dim=m.head_dim or m.dim // m.num_heads, num_experts_per_tok=moe.top_k,
                   router_aux_loss_coef=moe.aux_loss_coeff)
    if family == "mixtral":
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.hidden_dim,
                   router_jitter_noise=0.0, sliding_window=None)
    elif family == "qwen3_moe":
        out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.hidden_dim,
                   intermediate_size=m.dense_hidden_dim, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(m.num_layers) if i not in moe_ids],
                   norm_topk_prob=moe.route_norm, use_sliding_window=False,
                   sliding_window=None, attention_bias=False)
    elif family == "ernie4_5_moe":
        out.pop("rope_scaling")
        out.update(moe_num_experts=moe.num_experts, moe_k=moe.top_k,
                   moe_intermediate_size=moe.hidden_dim, intermediate_size=m.dense_hidden_dim,
                   moe_num_shared_experts=shared, moe_layer_start_index=m.num_dense_layers,
                   moe_layer_end_index=m.num_layers - 1, moe_layer_interval=m.moe_every,
                   moe_norm_min=1e-20, use_bias=False)
    elif family == "glm4_moe":
        rope_params["partial_rotary_factor"] = 1.0
        out.update(n_routed_experts=moe.num_experts, moe_intermediate_size=moe.hidden_dim,
                   n_shared_experts=shared, intermediate_size=m.dense_hidden_dim,
                   first_k_dense_replace=m.num_dense_layers, n_group=moe.num_groups or 1,
                   topk_group=moe.topk_groups or moe.num_groups or 1,
                   norm_topk_prob=moe.route_norm, routed_scaling_factor=moe.route_scale,
                   use_qk_norm=m.qk_norm, attention_bias=False, num_nextn_predict_layers=0)
    elif family == "deepseek_v3":
        groups = moe.num_groups or 1
        out.update(num_key_value_heads=m.num_heads, n_routed_experts=moe.num_experts,
                   num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.hidden_dim,
                   n_shared_experts=shared, intermediate_size=m.dense_hidden_dim,
                   first_k_dense_replace=m.num_dense_layers, n_group=groups,
                   topk_group=moe.topk_groups or groups, norm_topk_prob=moe.route_norm,
                   routed_scaling_factor=moe.route_scale, scoring_func="sigmoid",
                   topk_method="noaux_tc", q_lora_rank=m.q_lora_rank or None,
                   kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                   qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                   head_dim=m.qk_rope_head_dim,
                   qk_head_dim=m.qk_nope_head_dim + m.qk_rope_head_dim, rope_interleave=True,
                   attention_bias=False, aux_loss_alpha=moe.seq_aux_loss_coeff, seq_aux=True)
        out.pop("num_nextn_predict_layers", None)
        if m.mtp_depth:
            out["num_nextn_predict_layers"] = m.mtp_depth
    else:
        raise HFError(f"family {family!r} is not one of {', '.join(EXPORT_FAMILIES)}")
    return out
