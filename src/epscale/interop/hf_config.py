"""Hugging Face ``config.json`` -> an epscale recipe, for Mixtral, Qwen3-MoE, Ernie 4.5
MoE, GLM-4 MoE and DeepSeek-V3 (MoE) and Llama / Qwen3 (dense, for upcycling). (The way
back: :mod:`epscale.interop.hf_config_out`.)

Every field of config.json is either mapped, known not to change the function the model
computes (token ids, serving hints: :data:`NEUTRAL`), or an error that names it: nothing
is dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import RunConfig
from .errors import HFError
from .hf_families import HF_LATENT_NORM_EPS

MOE_FAMILIES = ("mixtral", "qwen3_moe", "ernie4_5_moe", "glm4_moe", "deepseek_v3")
DENSE_FAMILIES = ("llama", "qwen3")
DEFAULT_SEQ_LEN = 4096  # model.seq_len of an import: min(max_position_embeddings, this)

# Fields that do not change the function the model computes.
NEUTRAL = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "output_router_logits", "_name_or_path", "auto_map", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_return_dict", "pretraining_tp", "ep_size",
    "num_nextn_predict_layers", "max_position_embeddings", "tie_word_embeddings",
    "chunk_size_feed_forward", "is_encoder_decoder", "tokenizer_class", "id2label",
    "label2id", "problem_type", "name_or_path", "max_window_layers", "num_mtp_layers",
}
YARN_KEYS = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"}
LLAMA3_KEYS = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}


@dataclass
class Mapped:
    """A config.json read as an epscale recipe: the recipe's sections (``data``), the
    family, and facts the weight mapping needs."""

    family: str
    data: dict[str, Any]
    rope_interleave: bool = False   # DeepSeek-V3: rotary dims stored as interleaved pairs


class _Fields:
    """config.json fields, remembering which were read."""

    def __init__(self, data: dict, source: Path):
        self.data, self.source, self.used = data, source, set()

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        value = self.data.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise HFError(f"'{self.source}': field '{key}' is missing")
        return value

    def only(self, key: str, allowed: tuple, what: str) -> Any:
        value = self.get(key)
        if value not in allowed:
            raise HFError(f"'{self.source}': field '{key}' = {value!r} is not supported: {what}")
        return value

    def check_all_read(self) -> None:
        left = sorted(set(self.data) - self.used - NEUTRAL)
        if left:
            raise HFError(f"'{self.source}': config field(s) {', '.join(repr(k) for k in left)} "
                          f"are not supported by epscale's {self.data.get('model_type')} import "
                          "(they would change the model, and epscale cannot represent them)")


def read_family(hf: dict, source: Path, allowed: tuple[str, ...]) -> str:
    family = hf.get("model_type")
    if family not in allowed:
        archs = ", ".join(hf.get("architectures") or []) or "none named"
        dense = (" (a dense model: 'epscale upcycle' turns it into an MoE)"
                 if family in DENSE_FAMILIES and allowed == MOE_FAMILIES else "")
        raise HFError(f"'{source}': model_type {family!r} (architectures: {archs}) is not "
                      f"supported{dense}; supported: {', '.join(allowed)}")
    return family


def _rope(f: _Fields) -> tuple[float, dict | None]:
    """(rope_theta, model.rope_scaling or None) from rope_parameters (transformers 5) or
    rope_theta + rope_scaling (earlier configs)."""
    params = dict(f.get("rope_parameters") or {})
    legacy = f.get("rope_scaling")
    legacy_theta = f.get("rope_theta")
    theta = params.pop("rope_theta", None) or legacy_theta or 10000.0
    kind = params.pop("rope_type", None) or params.pop("type", None)
    if legacy and kind in (None, "default"):
        params = dict(legacy)
        kind = params.pop("rope_type", None) or params.pop("type", None)
        params.pop("rope_theta", None)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFError(f"'{f.source}': partial_rotary_factor = {params['partial_rotary_factor']}"
                      " is not supported (epscale rotates every dimension of the rotary part)")
    params.pop("partial_rotary_factor", None)
    if kind in (None, "default"):
        if params:
            raise HFError(f"'{f.source}': rope fields {sorted(params)} are not supported "
                          "with the default RoPE")
        return float(theta), None
    allowed = {"yarn": YARN_KEYS, "llama3": LLAMA3_KEYS}.get(kind)
    if allowed is None:
        raise HFError(f"'{f.source}': rope type {kind!r} is not supported (epscale has "
                      "'default', 'yarn' and 'llama3')")
    extra = sorted(set(params) - allowed)
    if extra:
        raise HFError(f"'{f.source}': rope {kind} field(s) {extra} are not supported")
    orig = params.get("original_max_position_embeddings")
    if orig is None:
        raise HFError(f"'{f.source}': rope {kind} needs original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = f.need("max_position_embeddings") / orig
    out = {"type": kind, "factor": float(factor), "original_seq_len": int(orig)}
    if kind == "yarn":
        out.update(beta_fast=float(params.get("beta_fast") or 32.0),
                   beta_slow=float(params.get("beta_slow") or 1.0),
                   mscale=float(params.get("mscale") or 0.0),
                   mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                   attention_factor=params.get("attention_factor"),
                   truncate=bool(params.get("truncate", True)))
    else:
        out.update(low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(params.get("high_freq_factor", 4.0)))
    return float(theta), out


def _attention_common(f: _Fields, seq_len: int | None) -> dict:
    f.only("hidden_act", ("silu",), "epscale's FFNs are SwiGLU (hidden_act 'silu')")
    f.only("attention_bias", (None, False), "epscale's projections have no bias")
    f.only("mlp_bias", (None, False), "epscale's FFNs have no bias")
    if f.get("attention_dropout", 0.0) != 0.0:
        raise HFError(f"'{f.source}': attention_dropout = {f.get('attention_dropout')} is not "
                      "supported (epscale has no dropout)")
    types = f.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise HFError(f"'{f.source}': layer_types {sorted(set(types))} are not supported "
                      "(epscale has full causal attention in every layer)")
    max_pos = int(f.need("max_position_embeddings"))
    theta, scaling = _rope(f)
    dim, heads = int(f.need("hidden_size")), int(f.need("num_attention_heads"))
    return {
        "vocab_size": int(f.need("vocab_size")), "dim": dim,
        "num_layers": int(f.need("num_hidden_layers")), "num_heads": heads,
        "seq_len": int(seq_len or min(max_pos, DEFAULT_SEQ_LEN)),
        "norm_eps": float(f.need("rms_norm_eps")),
        "tie_embeddings": bool(f.get("tie_word_embeddings", False)),
        "rope_theta": theta, "rope_scaling": scaling,
    }


def _mha(f: _Fields, model: dict) -> None:
    heads = model["num_heads"]
    model["num_kv_heads"] = int(f.get("num_key_value_heads", heads))
    model["head_dim"] = int(f.get("head_dim", model["dim"] // heads))
    model["attention"] = "mha"


def _sliding_window(f: _Fields, flag: str | None) -> None:
    window = f.get("sliding_window")
    on = f.get(flag, False) if flag else window is not None
    if on and window is not None and window < f.need("max_position_embeddings"):
        raise HFError(f"'{f.source}': sliding_window = {window} is not supported (epscale "
                      "attends over the whole context)")


def _moe_pattern(f: _Fields, moe_ids: list[int], num_layers: int) -> tuple[int, int]:
    """(num_dense_layers, moe_every) that make exactly ``moe_ids`` MoE layers."""
    want = set(moe_ids)
    if not want:
        raise HFError(f"'{f.source}': no layer is MoE (a dense model: 'epscale upcycle' turns "
                      "it into one)")
    for dense in range(num_layers):
        for every in range(1, num_layers + 1):
            got = {i for i in range(dense, num_layers) if (i - dense) % every == 0}
            if got == want:
                return dense, every
    raise HFError(f"'{f.source}': MoE layers {sorted(want)} (from decoder_sparse_step / "
                  "mlp_only_layers) are not 'the first k dense, then every m-th' as epscale's "
                  "model.num_dense_layers / model.moe_every describe")


def recipe_from_hf(hf: dict, source: Path, seq_len: int | None = None,
                   families: tuple[str, ...] = MOE_FAMILIES) -> Mapped:
    """Map config.json (``hf``, read from ``source``) to an epscale recipe's sections."""
    family = read_family(hf, source, families)
    f = _Fields(hf, source)
    model = _attention_common(f, seq_len)
    moe: dict[str, Any] = {"dim": model["dim"], "activation": "swiglu", "capacity_factor": None}
    interleave = False
    L = model["num_layers"]
    if family == "mixtral":
        _mha(f, model)
        _sliding_window(f, None)
        if f.get("router_jitter_noise", 0.0) != 0.0:
            raise HFError(f"'{source}': router_jitter_noise = {f.get('router_jitter_noise')} is "
                          "not supported (epscale's router adds no noise)")
        F = int(f.need("intermediate_size"))
        model.update(dense_hidden_dim=F, num_dense_layers=0, moe_every=1)
        moe.update(num_experts=int(f.need("num_local_experts")),
                   top_k=int(f.need("num_experts_per_tok")), hidden_dim=F,
                   score_func="softmax", route_norm=True,
                   aux_loss_coeff=float(f.get("router_aux_loss_coef", 0.0)))
    elif family == "qwen3_moe":
        _mha(f, model)
        model["qk_norm"] = True
        _sliding_window(f, "use_sliding_window")
        E = f.get("num_experts") or f.get("num_local_experts")
        if E is None:
            raise HFError(f"'{source}': field 'num_experts' is missing")
        step = int(f.get("decoder_sparse_step", 1))
        mlp_only = set(f.get("mlp_only_layers", []))
        ids = [i for i in range(L) if i not in mlp_only and (i + 1) % step == 0]
        dense, every = _moe_pattern(f, ids, L)
        model.update(dense_hidden_dim=int(f.need("intermediate_size")), num_dense_layers=dense,
                     moe_every=every)
        moe.update(num_experts=int(E), top_k=int(f.need("num_experts_per_tok")),
                   hidden_dim=int(f.need("moe_intermediate_size")), score_func="softmax",
                   route_norm=bool(f.get("norm_topk_prob", False)),
                   aux_loss_coeff=float(f.get("router_aux_loss_coef", 0.0)))
    elif family == "deepseek_v3":
        heads = model["num_heads"]
        if int(f.get("num_key_value_heads", heads)) != heads:
            raise HFError(f"'{source}': num_key_value_heads = {f.get('num_key_value_heads')} "
                          f"must equal num_attention_heads ({heads}) for MLA")
        nope, rope = int(f.need("qk_nope_head_dim")), int(f.need("qk_rope_head_dim"))
        for key, want in (("qk_head_dim", nope + rope), ("head_dim", rope)):
            if f.get(key, want) != want:
                raise HFError(f"'{source}': {key} = {f.get(key)} disagrees with qk_nope_head_dim"
                              f" + qk_rope_head_dim ({nope} + {rope})")
        if f.get("moe_layer_freq", 1) != 1:
            raise HFError(f"'{source}': moe_layer_freq = {f.get('moe_layer_freq')} is not "
                          "supported (every layer after first_k_dense_replace is MoE)")
        f.only("scoring_func", (None, "sigmoid"), "transformers' DeepSeek-V3 router is sigmoid")
        f.only("topk_method", (None, "noaux_tc"), "'noaux_tc' (group-limited, with the "
               "score-correction bias) is what transformers implements")
        if f.get("quantization_config") is not None:
            raise HFError(f"'{source}': quantization_config is set (an fp8 checkpoint); "
                          "dequantize it to bf16 first")
        interleave = bool(f.get("rope_interleave", True))
        model.update(attention="mla", q_lora_rank=int(f.get("q_lora_rank", 0)),
                     kv_lora_rank=int(f.need("kv_lora_rank")), qk_nope_head_dim=nope,
                     qk_rope_head_dim=rope, v_head_dim=int(f.need("v_head_dim")),
                     dense_hidden_dim=int(f.need("intermediate_size")),
                     num_dense_layers=min(int(f.get("first_k_dense_replace", 0)), L), moe_every=1)
        if model["norm_eps"] != HF_LATENT_NORM_EPS:
            model["latent_norm_eps"] = HF_LATENT_NORM_EPS
        groups, topk_groups = int(f.get("n_group", 1)), int(f.get("topk_group", 1))
        if groups <= 1:
            groups = topk_groups = 0
        seq_aux = float(f.get("aux_loss_alpha", 0.0)) if f.get("seq_aux", True) else 0.0
        moe.update(num_experts=int(f.need("n_routed_experts")),
                   top_k=int(f.need("num_experts_per_tok")),
                   hidden_dim=int(f.need("moe_intermediate_size")),
                   num_shared_experts=int(f.get("n_shared_experts", 0)),
                   score_func="sigmoid", route_norm=bool(f.get("norm_topk_prob", True)),
                   route_scale=float(f.get("routed_scaling_factor", 1.0)),
                   num_groups=groups, topk_groups=topk_groups, seq_aux_loss_coeff=seq_aux)
    elif family == "ernie4_5_moe":
        _mha(f, model)
        f.only("use_bias", (None, False), "epscale's projections have no bias")
        start, interval = int(f.get("moe_layer_start_index", 1)), int(f.get("moe_layer_interval", 1))
        end = int(f.get("moe_layer_end_index", -1))
        end = L - 1 if end == -1 else end
        ids = [i for i in range(L) if (i + 1) % interval == 0 and start <= i <= end]
        dense, every = _moe_pattern(f, ids, L)
        model.update(dense_hidden_dim=int(f.need("intermediate_size")), num_dense_layers=dense,
                     moe_every=every)
        f.get("moe_norm_min")  # the floor of the top-k weight sum: 1e-12 vs epscale's + 1e-20
        moe.update(num_experts=int(f.need("moe_num_experts")), top_k=int(f.need("moe_k")),
                   hidden_dim=int(f.need("moe_intermediate_size")),
                   num_shared_experts=int(f.get("moe_num_shared_experts", 0)),
                   score_func="softmax", route_norm=True,
                   aux_loss_coeff=float(f.get("router_aux_loss_coef", 0.0)))
    elif family == "glm4_moe":
        prf = (hf.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                    f.get("partial_rotary_factor", 0.5))
        if prf != 1.0:  # transformers' glm4_moe default is 0.5
            raise HFError(f"'{source}': partial_rotary_factor = {prf} is not supported "
                          "(epscale rotates every dimension of the rotary part)")
        _mha(f, model)
        model["qk_norm"] = bool(f.get("use_qk_norm", False))
        groups, topk_groups = int(f.get("n_group", 1)), int(f.get("topk_group", 1))
        if groups <= 1:
            groups = topk_groups = 0
        model.update(dense_hidden_dim=int(f.need("intermediate_size")),
                     num_dense_layers=min(int(f.get("first_k_dense_replace", 1)), L), moe_every=1)
        moe.update(num_experts=int(f.need("n_routed_experts")),
                   top_k=int(f.need("num_experts_per_tok")),
                   hidden_dim=int(f.need("moe_intermediate_size")),
                   num_shared_experts=int(f.need("n_shared_experts")), score_func="sigmoid",
                   route_norm=bool(f.get("norm_topk_prob", True)),
                   route_scale=float(f.get("routed_scaling_factor", 1.0)),
                   num_groups=groups, topk_groups=topk_groups)
    else:  # dense: llama, qwen3 (the upcycling sources)
        _mha(f, model)
        if family == "qwen3":
            model["qk_norm"] = True
            _sliding_window(f, "use_sliding_window")
        F = int(f.need("intermediate_size"))
        model.update(dense_hidden_dim=F, num_dense_layers=L, moe_every=1)
        moe.update(hidden_dim=F)
    f.check_all_read()
    return Mapped(family, {"name": f"hf-{family}", "model": model, "moe": moe},
                  rope_interleave=interleave)
