"""Hugging Face checkpoints to and from epscale: Mixtral, Qwen3-MoE, Ernie 4.5 MoE, GLM-4
MoE and DeepSeek-V3, in the hub's per-expert safetensors layout.

    model, cfg = from_pretrained("path/to/hf_dir")       # logits equal transformers'
    import_hf("hf_dir", "runs/x")     # a run directory `epscale train --run-dir` continues

(the way back, ``export_hf`` / ``to_pretrained``: :mod:`epscale.interop.hf_export`).

How the names and layouts map (per layer ``model.layers.{i}.``; ``{moe}`` is
``block_sparse_moe`` for Mixtral, ``mlp`` otherwise):

* ``self_attn.{q,k,v,o}_proj`` <-> ``attention.w{q,k,v,o}``; ``self_attn.{q,k}_norm`` <->
  ``attention.{q,k}_norm`` (Qwen3). MLA: ``q_a_proj/q_a_layernorm/q_b_proj`` (or
  ``q_proj``), ``kv_a_proj_with_mqa/kv_a_layernorm/kv_b_proj`` <-> ``wq_a/q_norm/wq_b``
  (``wq``), ``wkv_a/kv_norm/wkv_b``; DeepSeek-V3 stores the rotary dimensions as
  interleaved pairs (``rope_interleave``), epscale as two halves: those rows are permuted.
* routed experts ``{moe}.experts.{j}.{gate,up,down}`` ([F, D], [F, D], [D, F] each) <->
  ``ffn.experts.w1/w3/w2`` stacked ([E, D, F], [E, D, F], [E, F, D]);
  ``{moe}.gate.weight`` <-> ``ffn.router.gate.weight``; DeepSeek-V3's
  ``mlp.gate.e_score_correction_bias`` (GLM-4 MoE too; Ernie 4.5:
  ``mlp.moe_statics.e_score_correction_bias`` [1, E], and its q/k rotary rows interleaved
  like DeepSeek-V3's) <-> ``ffn.router.expert_bias``;
  ``mlp.shared_experts.*`` <-> ``ffn.shared_experts.w1/w3/w2``; dense FFNs ``mlp.*`` <->
  ``ffn.w1/w3/w2``.
* DeepSeek-V3's multi-token-prediction module k (``model.mtp_depth``; the hub's
  ``num_nextn_predict_layers``) is hub layer ``i = num_hidden_layers + k - 1``:
  ``model.layers.{i}.{enorm,hnorm,eh_proj,shared_head.norm}`` <->
  ``mtp.{i}.{enorm,hnorm,eh_proj,norm}``, its decoder-layer tensors <-> ``mtp.{i}.block.*``
  as above, and ``model.layers.{i}.embed_tokens`` / ``shared_head.head``: copies of the
  shared embedding and head (written equal to them; an import refuses copies that differ,
  as epscale's modules share one embedding and head). An import builds as many modules
  as the weights hold (``model.mtp_depth=0`` as an override leaves them out).

Legend: E experts, D model dim, F expert hidden dim, H heads.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ..config import (
    RunConfig,
    apply_overrides,
    dump_yaml,
    from_dict,
    load_yaml,
    to_dict,
)
from ..model import Transformer, build_meta_model
from ..parallel.materialize import reset_buffers_
from ..parallel.shard import mark_all_expert_params
from ..training import checkpoint as ckpt
from ..training.checkpoint.state import saved_keys
from ..training.checkpoint.store import quiet
from .files import HFError, HFWeights, read_json
from .hf_config import Mapped, recipe_from_hf
from .hf_tokenizer import TOKENIZER_FILES

SOURCE_DIR = "hf_source"    # RUN_DIR/hf_source: config.json and tokenizer files of the import
COPIED = ("config.json", "generation_config.json", *TOKENIZER_FILES)
DEFAULT_SHARD_BYTES = 5 * 2 ** 30
# The training section of an import: continuing a pretrained model, not a fresh one (the
# recipe defaults, lr 3e-3 after 30 warm-up steps, would undo much of its training).
# Peak lr of the order of a pretraining run's final lr, briefly warmed up; override with
# train.lr=... etc.
CONTINUED_PRETRAINING = {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 10}


@dataclass(frozen=True)
class HFTensorMap:
    """Where a Hugging Face family keeps its MoE layer's tensors."""

    moe: str                          # module name of the MoE block
    experts: tuple[str, str, str]     # gate (w1), up (w3), down (w2) of one expert
    bias: str | None = None           # the router's score-correction bias, if the format has one


TENSOR_MAPS = {
    "mixtral": HFTensorMap("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": HFTensorMap("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": HFTensorMap("mlp", ("gate_proj", "up_proj", "down_proj"),
                          "gate.e_score_correction_bias"),
    "glm4_moe": HFTensorMap("mlp", ("gate_proj", "up_proj", "down_proj"),
                       "gate.e_score_correction_bias"),
    "ernie4_5_moe": HFTensorMap("mlp", ("gate_proj", "up_proj", "down_proj"),
                           "moe_statics.e_score_correction_bias"),
    "llama": HFTensorMap("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3": HFTensorMap("mlp", ("gate_proj", "up_proj", "down_proj")),
}
DENSE = ("gate_proj", "up_proj", "down_proj")
BIAS_ROWS = {"ernie4_5_moe"}     # stores its correction bias as [1, E] (one expert group)
ROPE_PAIRS = {"ernie4_5_moe"}    # rotary dimensions of q/k as interleaved pairs (MHA)
MTP_FAMILIES = {"deepseek_v3", "glm4_moe"}  # multi-token-prediction layers after the last
MTP_WRITERS = ("deepseek_v3",)   # the formats epscale reads and writes those layers in
# a multi-token-prediction module's own tensors (beside its decoder layer's): hub <- epscale
MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
           "eh_proj.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}


@dataclass
class Rule:
    """One epscale tensor and the hub tensors it is made of (both ways)."""

    name: str                                              # epscale state-dict name
    hf: list[str]                                          # hub names
    hf_shapes: list[tuple[int, ...]]
    to_ours: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def _copy(name: str, hf: str, shape) -> Rule:
    return Rule(name, [hf], [tuple(shape)], lambda ts: ts[0], lambda t: [t])


def _experts(name: str, prefix: str, proj: str, shape) -> Rule:
    """Stacked [E, a, b] <-> E hub matrices [b, a] (nn.Linear's [out, in])."""
    E, a, b = shape
    names = [f"{prefix}.experts.{j}.{proj}.weight" for j in range(E)]
    return Rule(name, names, [(b, a)] * E,
                lambda ts: torch.stack(ts).transpose(1, 2).contiguous(),
                lambda t: [t[j].t() for j in range(E)])


def _rope_rows(name: str, hf: str, shape, rows: Callable[[torch.Tensor], torch.Tensor],
               perm: torch.Tensor, interleave: bool) -> Rule:
    """A projection whose rotary output rows the hub interleaves: ``rows(view)`` is the
    rotary slice of the weight viewed so that its last-but-one dim is those rows."""
    if not interleave:
        return _copy(name, hf, shape)
    inv = torch.argsort(perm)

    def permute(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        view = rows(t)
        view.copy_(view[..., order, :])
        return t

    return Rule(name, [hf], [tuple(shape)], lambda ts: permute(ts[0], perm),
                lambda t: [permute(t, inv)])


def rules(model_shapes: dict[str, tuple[int, ...]], cfg: RunConfig, family: str,
          interleave: bool) -> list[Rule]:
    """The rules of every epscale tensor the hub format holds, in state-dict order."""
    m = cfg.model
    lay = TENSOR_MAPS[family]
    rope = m.qk_rope_head_dim if m.attention == "mla" else (m.head_dim or m.dim // m.num_heads)
    perm = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
    qk, H = m.qk_nope_head_dim + rope, m.num_heads
    out = []
    mtp_ids = range(m.num_layers, m.num_layers + m.mtp_depth)
    if mtp_ids and family not in MTP_WRITERS:
        raise HFError(f"the {family} format has no multi-token-prediction modules "
                      f"(model.mtp_depth = {m.mtp_depth}); {', '.join(MTP_WRITERS)} has")
    emb_copies = [f"model.layers.{i}.embed_tokens.weight" for i in mtp_ids]
    head_copies = [f"model.layers.{i}.shared_head.head.weight" for i in mtp_ids]
    for name, shape in model_shapes.items():
        parts = name.split(".")
        if name == "tok_embeddings.weight":
            out.append(_shared(name, ["model.embed_tokens.weight"] + emb_copies
                               + (head_copies if m.tie_embeddings else []), shape))
        elif name == "norm.weight":
            out.append(_copy(name, "model.norm.weight", shape))
        elif name == "output.weight":
            out.append(_shared(name, ["lm_head.weight"] + head_copies, shape))
        elif parts[0] in ("layers", "mtp"):
            p = f"model.layers.{parts[1]}"
            rest = ".".join(parts[2:])
            if parts[0] == "mtp" and rest in MTP_OWN:
                out.append(_copy(name, f"{p}.{MTP_OWN[rest]}", shape))
                continue
            if parts[0] == "mtp":
                rest = rest[len("block."):]
            rule = _layer_rule(name, rest, p, shape, lay, family, interleave, perm, qk, H, m)
            if rule is not None:
                out.append(rule)
        else:
            raise HFError(f"epscale tensor '{name}' has no place in the {family} format")
    return out


def _shared(name: str, hf: list[str], shape) -> Rule:
    """One epscale tensor the hub stores several equal copies of (the embedding and head
    beside DeepSeek-V3's multi-token-prediction layers): written to each; read from the
    first, the others checked equal to it."""

    def to_ours(ts: list[torch.Tensor]) -> torch.Tensor:
        for other, t in zip(hf[1:], ts[1:]):
            if not torch.equal(t, ts[0]):
                raise HFError(f"hub tensor '{other}' differs from '{hf[0]}': epscale's "
                              "multi-token-prediction modules share the model's embedding "
                              "and output head, so their copies must be equal")
        return ts[0]

    return Rule(name, hf, [tuple(shape)] * len(hf), to_ours,
                lambda t: [t] + [t.clone() for _ in hf[1:]])   # safetensors: no shared storage


def _layer_rule(name, rest, p, shape, lay: HFTensorMap, family, interleave, perm, qk, H, m):
    attn = {"attention_norm.weight": "input_layernorm.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "attention.wo.weight": "self_attn.o_proj.weight"}
    if m.attention == "mla":
        attn.update({"attention.wq_a.weight": "self_attn.q_a_proj.weight",
                     "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
                     "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
                     "attention.wkv_b.weight": "self_attn.kv_b_proj.weight"})
    else:
        attn.update({f"attention.w{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkv"})
        attn.update({f"attention.{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"})
        if family in ROPE_PAIRS and rest in ("attention.wq.weight", "attention.wk.weight"):
            return _rope_rows(name, f"{p}.{attn[rest]}", shape,
                              lambda t: t.view(-1, len(perm), t.shape[-1]), perm, True)
    if rest in attn:
        return _copy(name, f"{p}.{attn[rest]}", shape)
    if rest in ("attention.wq_b.weight", "attention.wq.weight"):
        hf = f"{p}.self_attn.{'q_b_proj' if rest.endswith('wq_b.weight') else 'q_proj'}.weight"
        nope = m.qk_nope_head_dim
        return _rope_rows(name, hf, shape, lambda t: t.view(H, qk, -1)[:, nope:], perm,
                          interleave)
    if rest == "attention.wkv_a.weight":
        r = m.kv_lora_rank
        return _rope_rows(name, f"{p}.self_attn.kv_a_proj_with_mqa.weight", shape,
                          lambda t: t[r:], perm, interleave)
    ffn = {"w1": DENSE[0], "w3": DENSE[1], "w2": DENSE[2]}
    kind, _, leaf = rest.partition(".")
    if kind == "ffn":
        head, _, tail = leaf.partition(".")
        if head in ffn and tail == "weight":                       # a dense layer
            return _copy(name, f"{p}.mlp.{ffn[head]}.weight", shape)
        moe = f"{p}.{lay.moe}"
        if leaf == "router.gate.weight":
            return _copy(name, f"{moe}.gate.weight", shape)
        if leaf == "router.expert_bias":
            if lay.bias is None:
                return None
            if family in BIAS_ROWS:
                return Rule(name, [f"{moe}.{lay.bias}"], [(1, *shape)],
                            lambda ts: ts[0].reshape(shape), lambda t: [t.reshape(1, *shape)])
            return _copy(name, f"{moe}.{lay.bias}", shape)
        if leaf.startswith("router."):
            return None                                            # balancing state
        if head == "experts":
            proj = dict(zip(("w1", "w3", "w2"), lay.experts))[tail]
            return _experts(name, moe, proj, shape)
        if head == "shared_experts":
            w = tail.split(".")[0]
            return _copy(name, f"{moe}.shared_experts.{ffn[w]}.weight", shape)
    raise HFError(f"epscale tensor '{name}' has no place in the {family} format")


def model_shapes(cfg: RunConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the model's state dict (built on the meta device)."""
    return {k: tuple(v.shape) for k, v in build_meta_model(cfg).state_dict().items()}


# ---------------------------------------------------------------------- import
def read_hf(hf_dir: str | Path, overrides: list[str] | None = None,
            seq_len: int | None = None) -> tuple[Mapped, RunConfig]:
    """config.json of ``hf_dir`` as an epscale recipe (``overrides``: dotted key=value),
    with a continued-pretraining training section (:data:`CONTINUED_PRETRAINING`)."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise HFError(f"'{hf_dir}' is not a directory (expected a Hugging Face model "
                      "directory with config.json and *.safetensors)")
    source = hf_dir / "config.json"
    mapped = recipe_from_hf(read_json(source), source, seq_len)
    mapped.data["train"] = dict(CONTINUED_PRETRAINING)
    depth = _mtp_layers_held(hf_dir, mapped)
    if depth:
        mapped.data["model"]["mtp_depth"] = depth
    cfg = from_dict(RunConfig, apply_overrides(mapped.data, list(overrides or [])))
    return mapped, cfg


def state_from_hf(hf_dir: str | Path, mapped: Mapped, cfg: RunConfig,
                  report: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """The epscale state dict (fp32) of the weights in ``hf_dir``. A missing tensor, one of
    another shape than config.json implies, or one epscale has no place for is an HFError
    naming the file and the tensor. ``report`` hears about hub tensors left out on
    purpose (DeepSeek-V3's multi-token-prediction layers)."""
    weights = HFWeights(hf_dir)
    shapes = model_shapes(cfg)
    state, used = {}, set()
    for rule in rules(shapes, cfg, mapped.family, mapped.rope_interleave):
        missing = [n for n in rule.hf if n not in weights]
        if missing:
            raise HFError(f"tensor '{missing[0]}' is missing from '{hf_dir}' (config.json "
                          f"implies it; {len(missing)} of this kind missing)")
        state[rule.name] = rule.to_ours([weights.get(n, s)
                                         for n, s in zip(rule.hf, rule.hf_shapes)])
        used.update(rule.hf)
    for name, shape in shapes.items():  # balancing state the hub format has no place for
        state.setdefault(name, torch.zeros(shape))
    skipped, mtp = _ignorable(weights.names(), mapped, cfg)
    if mtp and report is not None:
        why = (f"model.mtp_depth = {cfg.model.mtp_depth}" if mapped.family in MTP_WRITERS
               else f"epscale reads them in {', '.join(MTP_WRITERS)} only")
        report(f"note: {len(mtp)} tensor(s) of the multi-token-prediction layer(s) (e.g. "
               f"'{mtp[0]}') are not imported ({why})")
    extra = sorted(set(weights.names()) - used - skipped)
    if extra:
        raise HFError(f"tensor '{extra[0]}' in '{weights.where(extra[0])}' has no place in "
                      f"epscale's {mapped.family} model ({len(extra)} such tensors); does "
                      "config.json describe these weights?")
    return state


def _mtp_layers_held(hf_dir: Path, mapped: Mapped) -> int:
    """How many multi-token-prediction modules the weights of ``hf_dir`` hold (hub layers
    num_hidden_layers, num_hidden_layers + 1, ... with an ``eh_proj``), in the formats
    epscale reads them in (:data:`MTP_WRITERS`); 0 otherwise or without weights."""
    if mapped.family not in MTP_WRITERS or not any(hf_dir.glob("*.safetensors")):
        return 0
    names = set(HFWeights(hf_dir).names())
    L, depth = mapped.data["model"]["num_layers"], 0
    while f"model.layers.{L + depth}.eh_proj.weight" in names:
        depth += 1
    return depth


def _ignorable(names: list[str], mapped: Mapped, cfg: RunConfig) -> tuple[set[str], list[str]]:
    """Hub tensors that carry nothing epscale's model computes with (rotary caches, a tied
    head), and DeepSeek-V3's multi-token-prediction layers (past the last layer)."""
    out, mtp = set(), []
    for n in names:
        parts = n.split(".")
        if n.endswith("rotary_emb.inv_freq") or (n == "lm_head.weight"
                                                 and cfg.model.tie_embeddings):
            out.add(n)
        elif len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and \
                int(parts[2]) >= cfg.model.num_layers + cfg.model.mtp_depth and \
                mapped.family in MTP_FAMILIES:
            out.add(n)
            mtp.append(n)
    return out, mtp


def from_pretrained(path: str | Path, overrides: list[str] | None = None,
                    seq_len: int | None = None) -> tuple[Transformer, RunConfig]:
    """An epscale :class:`~epscale.model.Transformer` (fp32, CPU, eval mode) with the
    weights of the Hugging Face directory ``path``, and its recipe; ``model(tokens_BS)``
    returns the logits transformers' model gives, [B, S, V]."""
    mapped, cfg = read_hf(path, overrides, seq_len)
    state = state_from_hf(path, mapped, cfg, report=lambda msg: warnings.warn(msg, stacklevel=3))
    return model_from_state(cfg, state), cfg


def model_from_state(cfg: RunConfig, state: dict[str, torch.Tensor]) -> Transformer:
    """The model of ``cfg`` holding ``state`` (no random initialisation on the way)."""
    model = build_meta_model(cfg)
    model.to_empty(device="cpu")
    mark_all_expert_params(model)
    reset_buffers_(model)
    model.load_state_dict(state, strict=True)
    return model.eval()


def import_hf(hf_dir: str | Path, run_dir: str | Path, overrides: list[str] | None = None,
              seq_len: int | None = None, report: Callable[[str], None] = print) -> Path:
    """Write the Hugging Face model ``hf_dir`` as run directory ``run_dir``: config.yaml
    (the recipe, ``overrides`` applied), a step-0 checkpoint that ``epscale train
    --run-dir`` continues from at any dp / ep / FSDP layout, and ``hf_source/`` (the
    config.json and tokenizer files). Returns the checkpoint directory."""
    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    mapped, cfg = read_hf(hf_dir, overrides, seq_len)
    check_new_run_dir(run_dir)
    state = state_from_hf(hf_dir, mapped, cfg, report)
    return write_run(run_dir, cfg, state, hf_dir, {"hf_family": mapped.family})


def check_new_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise HFError(f"'{run_dir}' is a file, not a run directory")
    if ckpt.list_checkpoints(run_dir):
        raise HFError(f"'{run_dir}' already holds checkpoints; import into a new run directory")


def write_run(run_dir: Path, cfg: RunConfig, state: dict[str, torch.Tensor], hf_dir: Path,
              meta: dict) -> Path:
    """RUN_DIR/config.yaml, RUN_DIR/hf_source/ (config.json and tokenizer files of
    ``hf_dir``) and a step-0 checkpoint holding ``state`` (through
    :func:`epscale.training.checkpoint.import_full`: loads at any layout)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    src = run_dir / SOURCE_DIR
    src.mkdir(exist_ok=True)
    for name in COPIED:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, src / name)
    dump_yaml(cfg, run_dir / "config.yaml")
    tmp = run_dir / ".hf_import.pt"
    try:
        torch.save({"model": state, "meta": {"config": to_dict(cfg), "hf_source": str(hf_dir),
                                             **meta}}, tmp)
        return ckpt.import_full(tmp, run_dir, step=0)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------- export
def run_config(path: Path, meta: dict) -> RunConfig:
    """The recipe a checkpoint was written with (its meta.json, else RUN_DIR/config.yaml)."""
    if isinstance(meta.get("config"), dict):
        return from_dict(RunConfig, meta["config"])
    candidate = path.parent.parent / "config.yaml"
    if candidate.is_file():
        return from_dict(RunConfig, load_yaml(candidate))
    raise HFError(f"checkpoint '{path}' records no config (meta.json) and no config.yaml is "
                  "beside its run directory")


def source_config(path: Path) -> dict | None:
    f = path.parent.parent / SOURCE_DIR / "config.json"
    return read_json(f) if f.is_file() else None


def load_tensors(path: Path, specs: dict[str, tuple | None]) -> dict[str, torch.Tensor]:
    """Full tensors ``model.{name}`` of a checkpoint (written at any layout), read into
    this process only (``specs``: name -> (shape, dtype), None to look it up)."""
    saved = saved_keys(path)
    state = {}
    for name, spec in specs.items():
        md = saved[f"model.{name}"]
        shape, dtype = spec if spec is not None else (tuple(md.size), md.properties.dtype)
        state[name] = torch.empty(shape, dtype=dtype)
    with quiet():
        dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    return state


__all__ = ["HFError", "from_pretrained", "import_hf", "load_tensors", "model_from_state",
           "read_hf", "run_config", "source_config", "state_from_hf"]
