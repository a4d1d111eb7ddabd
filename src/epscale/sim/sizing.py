"""Analytic model size, FLOPs and memory of a recipe, exact for the model epscale builds.

Everything here is computed from the :class:`~epscale.config.RunConfig` alone (no model is
built), so a 671B recipe is described in microseconds. The parameter count follows the
modules of ``epscale.model`` / ``epscale.moe`` one by one:

* token embedding ``V*D``; output head ``V*D`` unless ``tie_embeddings`` (counted once);
* per layer two RMSNorm weights ``2*D``; a final RMSNorm ``D``;
* attention ``mha``: wq ``D*H*hd``, wk/wv ``D*KV*hd`` each, wo ``H*hd*D`` (no biases);
  ``mla`` (DeepSeek-V2/V3): wq_a ``D*q_lora`` + q_norm ``q_lora`` + wq_b
  ``q_lora*H*(nope+rope)`` (or wq ``D*H*(nope+rope)`` when ``q_lora_rank`` is 0), wkv_a
  ``D*(kv_lora+rope)``, kv_norm ``kv_lora``, wkv_b ``kv_lora*H*(nope+v)``, wo ``H*v*D``;
* dense FFN ``m*D*dense_hidden_dim`` with ``m`` = 3 for SwiGLU, 2 for GELU;
* MoE layer: router gate ``E*D``, routed experts ``E*m*D*F``, shared experts
  ``m*D*shared_width`` (the expert bias is a buffer, not a parameter).

Active parameters are those one token touches: everything except the ``E-K`` routed
experts it does not choose per MoE layer (the embedding table counts in full, the
convention behind the published "active" figures of Mixtral, DeepSeek-V3 and Qwen3).

FLOPs per token (training = forward + backward = 3x forward): ``2`` per multiply-add of
every active matrix (all weights except the embedding lookup and the norms), plus the
attention scores and the weighted sum over the causal context, ``2*H*(dqk+dv)`` per key
with ``(S+1)/2`` keys on average per query (causal kernels skip the masked half).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import ConfigError, ModelConfig, MoEConfig, RunConfig

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "float8": 1, "fp8": 1}


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
    return 2 * D * H * hd + 2 * D * kv_heads * hd


def attention_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs of QK^T and AV for one query over its causal context, one layer."""
    H = model.num_heads
    if model.attention == "mla":
        dqk, dv = model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
    else:
        dqk = dv = head_dim(model)
    return 2.0 * H * (dqk + dv) * (model.seq_len + 1) / 2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes held by one rank during a training step (all figures in bytes).

    ``params``/``grads``/``optimizer`` (AdamW: two moments, plus an fp32 master copy when
    the parameters are kept in a narrower dtype) and ``activations`` (saved for backward,
    one micro-batch, no recomputation, flash-style attention without the S*S matrix).
    """

    params: float
    grads: float
    optimizer: float
    activations: float
    params_per_rank: float      # parameter count held by the rank (not bytes)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


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
    num_moe_layers: int
    flops_per_token: float      # training (fwd + bwd), incl. attention over seq_len
    memory: MemoryEstimate      # per rank, for the recipe's own parallel layout

    def as_dict(self) -> dict:
        d = asdict(self)
        d["memory"] = self.memory.as_dict()
        return d


def expert_params_per_expert(moe: MoEConfig) -> int:
    return _ffn_mats(moe.activation) * moe.dim * moe.hidden_dim


def _counts(model: ModelConfig, moe: MoEConfig) -> dict[str, int]:
    D, V, m = model.dim, model.vocab_size, _ffn_mats(moe.activation)
    n_moe = sum(model.is_moe_layer(i) for i in range(model.num_layers))
    n_dense = model.num_layers - n_moe
    return {
        "embedding_params": V * D * (1 if model.tie_embeddings else 2),
        "attention_params": model.num_layers * attention_params(model),
        "expert_params": n_moe * moe.num_experts * expert_params_per_expert(moe),
        "shared_expert_params": n_moe * m * D * moe.shared_width,
        "dense_ffn_params": n_dense * m * D * model.dense_hidden_dim,
        "router_params": n_moe * moe.num_experts * D,
        "norm_params": (2 * model.num_layers + 1) * D,
        "num_moe_layers": n_moe,
    }


def model_size(run_cfg: RunConfig, *, dp: int | None = None, ep: int | None = None,
               param_dtype: str | None = None, grad_dtype: str | None = None,
               optim_dtype: str = "float32", act_dtype: str | None = None) -> ModelSize:
    """Sizes of ``run_cfg``'s model and its memory per rank.

    The layout defaults to ``run_cfg.parallel`` (dp x ep); dtypes default to what the
    trainer uses for ``train.dtype`` ('bfloat16': bf16 params/grads/activations with an
    fp32 master copy; 'float32'/'auto': fp32 everywhere).
    """
    model, moe = run_cfg.model, run_cfg.moe
    c = _counts(model, moe)
    n_moe = c["num_moe_layers"]
    total = sum(v for k, v in c.items() if k != "num_moe_layers")
    inactive = n_moe * (moe.num_experts - moe.top_k) * expert_params_per_expert(moe)
    active = total - inactive
    input_embedding = model.vocab_size * model.dim
    # Matmul weights a token's forward multiplies by: all active params except the input
    # embedding lookup (a gather) and the norm weights (elementwise); the tied head is a
    # matmul even though its weights are the embedding's.
    matmul_active = active - input_embedding - c["norm_params"]
    if model.tie_embeddings:
        matmul_active += input_embedding
    if model.attention == "mla":  # the MLA q/kv norms are elementwise too
        matmul_active -= model.num_layers * (model.kv_lora_rank + model.q_lora_rank)
    fwd = 2.0 * matmul_active + model.num_layers * attention_flops_per_token(model)
    mem = memory_per_rank(run_cfg, dp=dp, ep=ep, param_dtype=param_dtype,
                          grad_dtype=grad_dtype, optim_dtype=optim_dtype, act_dtype=act_dtype)
    return ModelSize(total_params=total, active_params=active, flops_per_token=3.0 * fwd,
                     memory=mem, **c)


def _dtype_bytes(key: str, name: str) -> int:
    if name not in DTYPE_BYTES:
        raise ConfigError(f"{key} = {name!r} is invalid: must be one of "
                          f"{', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[name]


def memory_per_rank(run_cfg: RunConfig, *, dp: int | None = None, ep: int | None = None,
                    param_dtype: str | None = None, grad_dtype: str | None = None,
                    optim_dtype: str = "float32", act_dtype: str | None = None
                    ) -> MemoryEstimate:
    """Training memory of one rank when routed experts are sharded ``ep`` ways (plus the
    ``parallel.redundant_experts`` copies) and all other weights are replicated (no
    ZeRO/FSDP sharding, as epscale's trainer does).

    Activations: one micro-batch of ``train.micro_batch_size * model.seq_len`` tokens;
    an MoE layer's experts see ``T*K`` rows on average (balanced routing).
    """
    model, moe, par = run_cfg.model, run_cfg.moe, run_cfg.parallel
    ep = par.ep if ep is None else ep
    dp = par.dp if dp is None else dp
    if ep < 1 or dp < 1:
        raise ConfigError(f"layout dp={dp}, ep={ep} is invalid: both must be >= 1")
    if moe.num_experts % ep:
        raise ConfigError(f"parallel.ep = {ep} is invalid: must divide moe.num_experts "
                          f"({moe.num_experts}) so every rank holds whole experts")
    narrow = run_cfg.train.dtype == "bfloat16"
    param_dtype = param_dtype or ("bfloat16" if narrow else "float32")
    grad_dtype = grad_dtype or param_dtype
    act_dtype = act_dtype or param_dtype
    pb = _dtype_bytes("param_dtype", param_dtype)
    gb = _dtype_bytes("grad_dtype", grad_dtype)
    ob = _dtype_bytes("optim_dtype", optim_dtype)
    ab = _dtype_bytes("act_dtype", act_dtype)
    c = _counts(model, moe)
    total = sum(v for k, v in c.items() if k != "num_moe_layers")
    # Redundant expert slots (parallel.redundant_experts) add copies to the EP group.
    slots = moe.num_experts + (par.redundant_experts if ep > 1 else 0)
    per_rank = total - c["expert_params"] + c["expert_params"] * slots / (moe.num_experts * ep)
    master = 4 if pb < 4 else 0
    # Activations saved for backward per token, in elements.
    D, L = model.dim, model.num_layers
    if model.attention == "mla":
        H = model.num_heads
        attn = (model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim
                + H * (2 * (model.qk_nope_head_dim + model.qk_rope_head_dim)
                       + 2 * model.v_head_dim))
    else:
        hd, kv = head_dim(model), model.num_kv_heads or model.num_heads
        attn = model.num_heads * hd * 2 + 2 * kv * hd   # q, attn-out, k, v
    per_layer_common = 2 * D + attn + D                 # two norm inputs, residual
    m = _ffn_mats(moe.activation)
    dense_ffn = (m + (1 if m == 3 else 0)) * model.dense_hidden_dim
    moe_ffn = (moe.top_k * (D + (m + 1) * moe.hidden_dim + D) + 2 * moe.num_experts
               + (m + 1) * moe.shared_width)
    n_moe = c["num_moe_layers"]
    per_token = L * per_layer_common + n_moe * moe_ffn + (L - n_moe) * dense_ffn
    per_token += model.vocab_size * 2   # logits and their softmax for the loss
    tokens = run_cfg.train.micro_batch_size * model.seq_len
    return MemoryEstimate(params=per_rank * pb, grads=per_rank * gb,
                          optimizer=per_rank * (2 * ob + master),
                          activations=per_token * tokens * ab, params_per_rank=per_rank)
