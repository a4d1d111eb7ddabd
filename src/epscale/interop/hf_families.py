"""Which transformers family holds an epscale model, exactly or not at all (torch-free).

Export is exact or refused: :func:`fit` lists, for one family, what the model has that the
family's transformers implementation cannot compute (``missing``: never written) and what
writing it there would drop (``dropped``: the router's loss-free-balancing bias where the
family has no correction bias, token dropping by capacity where the family is dropless;
written only with ``--lossy``). :func:`choose` takes the first family that holds the
model exactly, in :data:`EXPORT_FAMILIES` order (the family a run was imported from
first). What each family computes (read from transformers' modeling files):

* ``mixtral``: MHA/GQA, softmax top-k renormalised, every layer MoE; no correction bias.
* ``qwen3_moe``: MHA/GQA with QK-norm, softmax top-k (renormalised or not), any dense
  layers (``mlp_only_layers``); no correction bias.
* ``ernie4_5_moe``: MHA/GQA (rotary as interleaved pairs), softmax top-k renormalised with
  ``moe_statics.e_score_correction_bias`` for selection (loss-free balancing), shared
  experts, the first k layers dense then every m-th MoE as ``(i + 1) % m == 0``.
* ``glm4_moe``: MHA/GQA (QK-norm optional), sigmoid with ``e_score_correction_bias``,
  group-limited top-k, routed scaling, at least one shared expert, first k layers dense.
* ``deepseek_v3``: MLA, otherwise as glm4_moe (shared experts optional).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import RunConfig
from .errors import HFError

# Preference order of an export: the simplest format that holds the model exactly.
EXPORT_FAMILIES = ("mixtral", "qwen3_moe", "ernie4_5_moe", "glm4_moe", "deepseek_v3")
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "ernie4_5_moe": "Ernie4_5_MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
BIAS_FAMILIES = ("ernie4_5_moe", "glm4_moe", "deepseek_v3")  # have a correction bias
HF_LATENT_NORM_EPS = 1e-6  # DeepSeek-V3's q_a / kv_a layernorms in transformers


@dataclass
class Fit:
    """How family ``family`` holds a model: ``missing`` (what it cannot compute: never
    written) and ``dropped`` (what writing it there leaves out: only with --lossy)."""

    family: str
    missing: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.missing and not self.dropped

    def reasons(self) -> str:
        return "; ".join(self.missing + self.dropped)


def needs_bias(cfg: RunConfig, bias_nonzero: bool = False) -> bool:
    """Whether the router's expert bias changes the model: it is trained (loss-free
    balancing, moe.bias_update_speed > 0) or a checkpoint holds a nonzero one."""
    return cfg.moe.bias_update_speed > 0 or bias_nonzero


def moe_layer_ids(cfg: RunConfig) -> list[int]:
    return [i for i in range(cfg.model.num_layers) if cfg.model.is_moe_layer(i)]


def fit(cfg: RunConfig, family: str, bias: bool) -> Fit:
    """What ``family`` cannot hold of ``cfg`` (``bias``: the expert bias matters,
    :func:`needs_bias`)."""
    m, moe = cfg.model, cfg.moe
    out = Fit(family)

    def need(ok: bool, what: str) -> None:
        if not ok:
            out.missing.append(what)

    need(moe.activation == "swiglu", f"moe.activation = {moe.activation!r} (transformers' MoE "
         "families are SwiGLU)")
    ids = moe_layer_ids(cfg)
    need(m.mtp_depth == 0 or family == "deepseek_v3", f"model.mtp_depth = {m.mtp_depth} "
         "(only deepseek_v3 stores multi-token-prediction modules)")
    if family == "deepseek_v3":
        need(m.attention == "mla", f"model.attention = {m.attention!r} (deepseek_v3 has MLA)")
        eps = m.norm_eps if m.latent_norm_eps is None else m.latent_norm_eps
        need(m.attention != "mla" or eps == HF_LATENT_NORM_EPS, f"MLA latent norm epsilon {eps}"
             f" (transformers' deepseek_v3 uses {HF_LATENT_NORM_EPS})")
    else:
        need(m.attention == "mha", f"model.attention = {m.attention!r} ({family} has "
             "multi-head attention; MLA: deepseek_v3)")
    if family in ("mixtral", "qwen3_moe", "ernie4_5_moe"):
        need(moe.score_func == "softmax", f"moe.score_func = {moe.score_func!r} ({family} "
             "routes by softmax)")
        need(moe.route_scale == 1.0, f"moe.route_scale = {moe.route_scale} ({family} has no "
             "routed scaling factor)")
        need(moe.num_groups == 0, f"moe.num_groups = {moe.num_groups} ({family} has no "
             "group-limited routing)")
    else:
        need(moe.score_func == "sigmoid", f"moe.score_func = {moe.score_func!r} ({family} "
             "routes by sigmoid)")
        need(m.moe_every == 1, f"model.moe_every = {m.moe_every} ({family}: every layer after "
             "the first k dense ones is MoE)")
    if family in ("mixtral", "qwen3_moe"):
        need(moe.num_shared_experts == 0, f"moe.num_shared_experts = {moe.num_shared_experts}"
             f" ({family} has no shared experts)")
    else:
        need(moe.shared_width % moe.hidden_dim == 0, f"shared expert width {moe.shared_width} "
             f"(not a multiple of moe.hidden_dim = {moe.hidden_dim}, as {family} needs)")
    if family == "glm4_moe":
        need(moe.num_shared_experts > 0, "moe.num_shared_experts = 0 (glm4_moe always has a "
             "shared expert)")
    if family == "mixtral":
        need(not m.qk_norm, "model.qk_norm = true (mixtral has no QK-norm)")
        need(ids == list(range(m.num_layers)), "dense layers (every mixtral layer is MoE)")
    if family in ("mixtral", "ernie4_5_moe"):
        need(moe.route_norm, f"moe.route_norm = false ({family} renormalises the top-k weights)")
    if family == "qwen3_moe":
        need(m.qk_norm, "model.qk_norm = false (qwen3_moe normalises queries and keys)")
    if family == "ernie4_5_moe":
        need(not m.qk_norm, "model.qk_norm = true (ernie4_5_moe has no QK-norm)")
        want = [i for i in range(m.num_dense_layers, m.num_layers) if (i + 1) % m.moe_every == 0]
        need(ids == want, f"MoE layers {ids} (ernie4_5_moe makes layer i MoE when i >= "
             f"{m.num_dense_layers} and (i + 1) % {m.moe_every} == 0)")
    if bias and family not in BIAS_FAMILIES:
        out.dropped.append(f"the router's expert bias (loss-free balancing, moe.bias_update_"
                           f"speed = {moe.bias_update_speed}): {family} has no correction bias, "
                           "so expert selection and the logits would differ")
    if moe.capacity_factor is not None:
        out.dropped.append(f"token dropping (moe.capacity_factor = {moe.capacity_factor}): "
                           f"{family} is dropless, so its logits differ wherever epscale drops "
                           "a token")
    return out


def choose(cfg: RunConfig, family: str | None = None, prefer: str | None = None,
           bias: bool | None = None, lossy: bool = False) -> Fit:
    """The family to write ``cfg`` in: ``family`` when named (--arch), else the first of
    ``prefer`` (the imported model's family) and :data:`EXPORT_FAMILIES` that holds it
    exactly. Where none does: with ``lossy`` the first whose only losses are droppable
    (its ``dropped`` says what), else an :class:`~epscale.interop.files.HFError` with every
    family's reasons and what ``--lossy`` would drop."""
    bias = needs_bias(cfg) if bias is None else bias
    if family is not None:
        if family not in EXPORT_FAMILIES:
            raise HFError(f"--arch {family!r} is not one of {', '.join(EXPORT_FAMILIES)}")
        f = fit(cfg, family, bias)
        if f.missing or (f.dropped and not lossy):
            more = " (or pass --lossy to write it anyway)" if not f.missing else ""
            raise HFError(f"the run cannot be written exactly as {family}: {f.reasons()}{more}")
        return f
    order = ([prefer] if prefer in EXPORT_FAMILIES else []) + \
        [f for f in EXPORT_FAMILIES if f != prefer]
    fits = [fit(cfg, f, bias) for f in order]
    for f in fits:
        if f.exact:
            return f
    droppable = [f for f in fits if not f.missing]
    if lossy and droppable:
        return droppable[0]
    why = "".join(f"\n  {f.family}: {f.reasons()}" for f in fits)
    hint = (f"\n'export-hf --lossy' writes it as {droppable[0].family}, dropping "
            + "; ".join(droppable[0].dropped) if droppable else
            "\nno family can hold it even with --lossy")
    raise HFError(f"no transformers family represents this model exactly:{why}{hint}")


def describe_export(cfg: RunConfig) -> str:
    """One line for ``epscale describe``: the family ``export-hf`` writes the recipe as."""
    try:
        f = choose(cfg)
        return f"{f.family} ({ARCHITECTURES[f.family]}), exact"
    except HFError:
        pass
    try:
        f = choose(cfg, lossy=True)
        return (f"no exact transformers family (export-hf refuses); --lossy writes "
                f"{f.family}, dropping {'; '.join(d.split(':')[0] for d in f.dropped)}")
    except HFError:
        reasons = fit(cfg, "mixtral", needs_bias(cfg)).missing[:1] or ["see export-hf"]
        return f"none: no transformers family can hold it ({reasons[0]})"
