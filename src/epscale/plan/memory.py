"""Memory per rank of one training step, computed from the recipe and a layout (nothing is
built): the weights, gradients and AdamW state a rank holds (replicated, or sharded by
FSDP), the activations saved for backward (with or without recomputation), and the
transient peaks of a step (the all-gathered block under FSDP, the dispatcher's rows).

Legend: T tokens per micro-batch and rank, D model dim, F expert hidden dim, Fd dense FFN
width, Fs shared-expert width, E experts, e = E/ep, K top-k, H heads, G key/value heads,
hd head dim, V vocabulary, L layers; under a pipeline p pipeline ranks (r the 0-based
one), n stages, v stages per rank, m micro-batches per step.

Held for the whole step (what ``benchmarks/memory.py`` measures):

* parameters: fp32 master weights (the trainer keeps fp32 parameters; bf16 is a compute
  dtype: FSDP mixed precision or autocast). Replicated: every non-expert weight plus this
  rank's E/ep experts (and redundant slots). FSDP: each weight's share of dp_shard, split
  along dim 0 in torch.chunk pieces of ceil(rows / dp_shard) rows (FSDP pads the last); an
  expert slice's share of efsdp = dp_shard / ep (whole experts, or the hidden dim when
  efsdp does not divide e).
* gradients: the same shapes, fp32 (FSDP reduces in fp32).
* optimizer: AdamW's two moments per parameter, in ``train.optimizer_state_dtype`` (fp32,
  or bf16: 2 x 2 bytes; the fp32 copies a bf16-state step makes chunk by chunk are
  transient and come after backward, off the peak) (:func:`optimizer_state_bytes`).
* activations: the tensors autograd keeps for backward for one micro-batch (two with
  ``parallel.overlap_micro_batches``: :func:`pairs_micro_batches`), counted from
  what each module saves (its inputs and intermediates; see ``_saved_per_token``); norms
  keep their fp32 input and rstd (and, decomposed on the CPU, their fp32 output:
  :data:`NORM_KERNELS`), the rest is kept in the compute dtype, index tensors in int64. The output head
  and the cross-entropy run fused over chunks of tokens (``epscale.head_loss``): they keep
  the head's input in the compute dtype and the targets, no [T, V] logits; one chunk's logits are a transient of the head's forward and backward
  (``head_chunk``, :func:`head_transient_bytes`), held while the activations are but not
  while a block is rebuilt: the total counts the larger of it and ``recompute``.
  bf16 follows the trainer's two rules. Under FSDP (its MixedPrecisionPolicy) the
  parameters and so the residual stream are bf16. Without FSDP bf16 is autocast over fp32
  weights: the residual stream (a block's input and output) stays fp32, each matrix
  product casts its input anew (an input feeding q, k and v is kept three times) and its
  weight, and autograd keeps the cast weights until the backward (a rank's whole
  model's, or with recomputation the head's, and one block's rebuilt at a time).
  ``full`` recomputation keeps each block's input; ``selective`` keeps the block input and
  the outputs of its matrix products and of the router's top-k; ``train.recompute_modules``
  keeps what no recomputation keeps less what the named parts drop
  (:func:`recompute_dropped_per_token`; ``recompute`` then counts a block's whole drop,
  an upper bound: its regions are rebuilt one after another). What a forward keeps is
  ``activations``; ``recompute`` is the rest of one block's set, rebuilt during its
  backward (the largest block's; 0 without recomputation). The expert output rows kept
  for the gate gradient are fp32 on the local path (it weights them in fp32) and in the
  compute dtype under expert parallelism (the combine's). ``train.activation_storage:
  fp8`` keeps the routed experts' saved rows (:func:`fp8_saved_tensors`) and the dense
  FFNs' and shared experts' hidden activations (:func:`fp8_ffn_tensors`) and the
  attention kernel's output and output projection's input (:func:`fp8_attention_tensors`)
  at 1 byte per element plus an fp32 scale per 1 x 128 tile (:mod:`epscale.moe.saved_fp8`).

ZeRO levels under FSDP (``parallel.zero``, :func:`zero_state_bytes`; measured exactly by
tests/test_zero.py). Level 3 without a pipeline is the above. Levels 1 and 2 keep every
weight the rank's blocks use gathered for the whole step (``unsharded``: each weight's
full padded size over dp_shard, an expert slice's over efsdp, in the compute dtype), and
level 1 accumulates the unsharded gradients (real shapes, fp32: FSDP upcasts to its
fp32 reduction dtype) instead of sharded ones until the last micro-batch's reduce-scatter.
Under a pipeline torch's PipelineStage accumulates unsharded gradients and keeps the
weights gathered after each backward at every level (3 included: its next forward frees
them again), so a pipeline rank is counted as level 1 whatever the level; the gathered
transient is then one block's gradients in the compute dtype.

Transient (not measured by the benchmark; in the total): under FSDP the largest block's
gathered weights in the compute dtype, twice (this block and the prefetched next one),
plus its unsharded gradients before the reduce-scatter; the dispatcher's send and receive
rows (T*K rows of D, twice).

Pipeline (``parallel.pp`` = p > 1): world
= p x (the layout above, inside each stage); dp_shard and dp are each stage's. A pipeline
rank holds the parameters (gradients, AdamW state) of its stages' blocks only, the
embedding where it holds stage 0, the final norm and head where it holds stage n - 1
(and there the multi-token-prediction modules, and a copy of the embedding for a tied
head or the modules' lookups: ``epscale.parallel.pipeline``'s stage embedding, also on a
V schedule's rank 0, which holds both), sharded inside the stage as without a pipeline; FSDP's gathered block is its largest; the
dispatch rows are there where it holds an MoE block. Activations: the set of stage s for
one micro-batch (``stage_activations``) is its blocks' (plus the embedding's and head's
where it has them), plus the stage output the schedule keeps until that micro-batch's
backward (T x D in the residual stream's dtype: the compute dtype under FSDP, fp32 under
autocast; on the last stage the micro-batch's 0-dim loss); a stage that
receives its input keeps no copy of it under full recomputation (the block's saved input
is the receive buffer; nor does it with the norms recomputed, which keep their input as
it is). The rank keeps several micro-batches' sets at once: the peak of
its schedule's order (:func:`epscale.plan.pipeline.schedule_actions`, torch's own order),
a forward holding its set until the backward of that micro-batch and stage; a backward
split in two (the zero-bubble schedules) frees it at its weight half (assumed: the input
half frees little, the weight gradients need the saved inputs of every matrix product,
and its output gradients too; the last stage of a tied head with MTP modules runs its
weight gradients at its input half, which frees it there). That gives, in stage sets at
the peak: 1F1B rank r of p keeps min(m, p - r); GPipe all m; interleaved 1F1B with v
stages per rank (m a multiple of p) (v - 1) p + 2 (p - 1 - r) + 1 (rank 0: about p + (p - 1) / v micro-batches of all its
layers, Korthikanti et al.'s figure); interleaved zero-bubble v p; ZB-V 2p on every rank
(p micro-batches of both its stages, as 1F1B's first rank); DualPipeV 2p + 1. p2p buffers:
torch's PipelineStage allocates a receive buffer (T x D, the residual stream's dtype) for every
micro-batch of the step, for the input of a stage whose previous stage is on another rank
and for the output gradient of one whose next stage is; parallel/pipeline_buffers.py
frees each one's storage except while its micro-batch is in flight, from the posting of
its receive to the end of that micro-batch's backward on the stage
(:func:`receive_buffers_in_flight`: the peak of the rank's order with the receives placed
where torch places them; 1F1B rank r: p - r inputs and one gradient). The rank that
needs the most is what ``estimate`` reports; :func:`pipeline_memory` gives every rank.
p2p traffic per step: m x T x D (the residual stream's dtype) forward and as much backward across each
stage boundary between two ranks, per GPU of the stage.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from ..config import ConfigError, ModelConfig, MoEConfig, RunConfig
from ..config.schema import PP_SCHEDULES
from .layout import Layout
from .pipeline import (in_flight, layers_per_stage, paired_items, schedule_actions, stage_layers,
                       stage_placement)

ACTIVATION_STORAGE = ("compute", "fp8")   # train.activation_storage
FP8_TILE = 128                            # channels per fp8 scale (1 x 128 tiles)
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "float8": 1, "fp8": 1}
# the fused output head + cross-entropy (epscale.head_loss) computes the logits of this
# many bytes (fp32) at a time. Each chunk adds its product into the fp32 weight gradient
# [V, D] (read and written once per chunk), so fewer, larger chunks cost less time; the
# accelerators' budget bounds the transient (DeepSeek-V3: 16 chunks of 256 tokens, as
# Liger's chunking gives), the CPU's is larger (memory is not what a CPU run lacks:
# 64-row chunks of a 32k vocabulary ran at 0.6x the speed of 512-row ones)
HEAD_CHUNK_BYTES = {"accelerator": 128 << 20, "cpu": 64 << 20}


def head_chunk_rows(tokens: int, vocab_size: int, device: str = "accelerator") -> int:
    """Rows (tokens) of one chunk of the fused head + cross-entropy: as many as keep the
    chunk's fp32 logits [rows, V] within :data:`HEAD_CHUNK_BYTES` of ``device``
    ('accelerator' or 'cpu'), at least 1 and at most ``tokens``; above 128, a multiple of
    128 (whole GEMM tiles). DeepSeek-V3 (V = 129,280) on a GPU: 256 rows, 126 MiB."""
    rows = HEAD_CHUNK_BYTES[device] // (4 * max(1, vocab_size))
    if rows > 128:
        rows -= rows % 128
    return max(1, min(tokens, rows))


@dataclass(frozen=True)
class Activations:
    """How one micro-batch's activations are kept (with the :class:`Layout`'s micro-batch
    size, what the memory model needs beyond the degrees): recomputation, the compute
    dtype, and what runs the experts (it sets what they save)."""

    activation_checkpointing: str = "none"
    compute_dtype: str = "float32"
    experts_impl: str = "grouped_mm"
    recompute_modules: tuple[str, ...] = ()    # train.recompute_modules (with 'none' only)
    storage: str = "compute"                   # train.activation_storage: 'compute' or 'fp8'
    norm_kernel: str = "fused"                 # what runs RMSNorm: NORM_KERNELS

    def __post_init__(self) -> None:
        if self.norm_kernel not in NORM_KERNELS:
            raise ConfigError(f"norm kernel {self.norm_kernel!r} is invalid: must be one of "
                              f"{', '.join(NORM_KERNELS)}")
        if self.compute_dtype not in DTYPE_BYTES:
            raise ConfigError(f"compute dtype {self.compute_dtype!r} is invalid: must be one of "
                              f"{', '.join(sorted(DTYPE_BYTES))}")
        if self.storage not in ACTIVATION_STORAGE:
            raise ConfigError(f"activation storage {self.storage!r} is invalid: must be one of "
                              f"{', '.join(ACTIVATION_STORAGE)}")

    @staticmethod
    def of(cfg: RunConfig, activation_checkpointing: str | None = None,
           compute_dtype: str | None = None, experts_impl: str | None = None,
           norm_kernel: str = "fused") -> Activations:
        """The recipe's (bfloat16 compute for train.dtype bfloat16 or auto) on a GPU (the
        fused RMSNorm), with any of the arguments replacing it."""
        train = cfg.train
        dtype = compute_dtype or ("bfloat16" if train.dtype in ("bfloat16", "auto") else "float32")
        impl = experts_impl or ("cpu_fused" if cfg.moe.experts_impl == "cpu_fused" else "grouped_mm")
        ac = activation_checkpointing or train.activation_checkpointing
        modules = tuple(train.recompute_modules) if ac == "none" else ()
        return Activations(ac, dtype, impl, modules, train.activation_storage, norm_kernel)


# What runs RMSNorm (``epscale.model.RMSNorm``: ``F.rms_norm`` on the fp32 upcast input and
# weight), which sets what autograd keeps of it: "fused" where torch's ``rms_norm`` calls
# ``_fused_rms_norm`` (CUDA and the other accelerators: pytorch's
# aten/src/ATen/native/layer_norm.cpp, ``rms_norm_symint``), whose backward keeps its input
# and the rstd (tools/autograd/derivatives.yaml); "composite" where it runs decomposed (the
# CPU: pow, mean, rsqrt, mul, mul), which also keeps the fp32 normalized output. The CPU
# tests measure the composite; ``epscale describe`` plans GPUs, the fused.
NORM_KERNELS = ("fused", "composite")


def norm_fp32_per_token(width: int, norm_kernel: str) -> int:
    """fp32 elements per token one RMSNorm over ``width`` channels keeps for backward: its
    fp32 input and the rstd, and under the composite the normalized output too."""
    return (2 * width + 1) if norm_kernel == "composite" else (width + 1)


def with_pipeline(cfg: RunConfig, pp: int | None = None, schedule: str | None = None,
                  virtual_stages: int | None = None) -> RunConfig:
    """``cfg`` with any of the pipeline keys replaced (validated as a recipe is; an explicit
    ``parallel.pp_layers_per_stage`` is dropped when the stages change)."""
    par = cfg.parallel
    pp = par.pp if pp is None else pp
    schedule = par.pp_schedule if schedule is None else schedule
    if virtual_stages is None:
        virtual_stages = par.pp_virtual_stages
        if schedule != par.pp_schedule and schedule in PP_SCHEDULES:   # the new schedule's default
            virtual_stages = 2 if PP_SCHEDULES[schedule] != "single" else 1
    if (pp, schedule, virtual_stages) == (par.pp, par.pp_schedule, par.pp_virtual_stages):
        return cfg
    return replace(cfg, parallel=replace(par, pp=pp, pp_schedule=schedule,
                                         pp_virtual_stages=virtual_stages,
                                         pp_layers_per_stage=None))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds during a training step (see the module docstring)."""

    params: float
    grads: float
    optimizer: float
    activations: float          # kept for backward at the end of the forward
    recompute: float            # rebuilt at once by recomputation during backward
    gathered: float             # FSDP: gathered weights and unsharded grads of the largest block
    comm: float                 # the dispatcher's row buffers
    params_per_rank: float      # parameter count held by the rank (not bytes)
    p2p_buffers: float = 0      # pipeline: the receive buffers of the micro-batches in flight
    unsharded: float = 0        # weights kept gathered for the step (ZeRO-1/2, pipelines)
    head_chunk: float = 0       # the fused head's chunk of logits (transient; not with recompute)

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations
                + max(self.recompute, self.head_chunk)
                + self.gathered + self.comm + self.p2p_buffers + self.unsharded)

    def as_dict(self) -> dict[str, float]:
        """The fields and the total (``p2p_buffers`` only under a pipeline, ``unsharded``
        only where weights stay gathered, ``head_chunk`` only where the head is)."""
        out = {**asdict(self), "total": self.total}
        for key in ("p2p_buffers", "unsharded", "head_chunk"):
            if not out[key]:
                del out[key]
        return out


@dataclass(frozen=True)
class RankMemory:
    """One pipeline rank: its stages, their blocks, what it holds at its peak."""

    rank: int
    stages: tuple[int, ...]
    layers: tuple[tuple[int, int], ...]   # each stage's blocks: [start, stop)
    in_flight: int                        # stage activation sets held at the peak
    stage_activations: tuple[float, ...]  # bytes one micro-batch keeps on each of its stages
    p2p_send_bytes: float                 # sent to other ranks per step (forward + backward)
    memory: MemoryEstimate

    def as_dict(self) -> dict:
        return {"rank": self.rank, "stages": list(self.stages),
                "layers": [list(r) for r in self.layers], "in_flight": self.in_flight,
                "stage_activations": list(self.stage_activations),
                "p2p_send_bytes": self.p2p_send_bytes, "memory": self.memory.as_dict()}


@dataclass(frozen=True)
class ParamShape:
    """One parameter of the model epscale builds: its name's role, full shape, and the
    block it belongs to (-1: embedding, final norm, head)."""

    name: str
    shape: tuple[int, ...]
    expert: bool = False
    block: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _ffn(prefix: str, D: int, width: int, activation: str, block: int) -> list[ParamShape]:
    mats = [ParamShape(f"{prefix}.w1.weight", (width, D), block=block),
            ParamShape(f"{prefix}.w2.weight", (D, width), block=block)]
    if activation == "swiglu":
        mats.append(ParamShape(f"{prefix}.w3.weight", (width, D), block=block))
    return mats


def _attention(model: ModelConfig, i: int, block: str) -> list[ParamShape]:
    D, H = model.dim, model.num_heads
    p = f"{block}.attention"
    if model.attention == "mla":
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        out = []
        if model.q_lora_rank > 0:
            out += [ParamShape(f"{p}.wq_a.weight", (model.q_lora_rank, D), block=i),
                    ParamShape(f"{p}.q_norm.weight", (model.q_lora_rank,), block=i),
                    ParamShape(f"{p}.wq_b.weight", (H * qk, model.q_lora_rank), block=i)]
        else:
            out.append(ParamShape(f"{p}.wq.weight", (H * qk, D), block=i))
        return out + [
            ParamShape(f"{p}.wkv_a.weight", (model.kv_lora_rank + model.qk_rope_head_dim, D), block=i),
            ParamShape(f"{p}.kv_norm.weight", (model.kv_lora_rank,), block=i),
            ParamShape(f"{p}.wkv_b.weight", (H * (model.qk_nope_head_dim + model.v_head_dim),
                                             model.kv_lora_rank), block=i),
            ParamShape(f"{p}.wo.weight", (D, H * model.v_head_dim), block=i)]
    hd, G = model.head_dim or D // H, model.num_kv_heads or H
    out = [ParamShape(f"{p}.wq.weight", (H * hd, D), block=i),
           ParamShape(f"{p}.wk.weight", (G * hd, D), block=i),
           ParamShape(f"{p}.wv.weight", (G * hd, D), block=i),
           ParamShape(f"{p}.wo.weight", (D, H * hd), block=i)]
    if model.qk_norm:
        out += [ParamShape(f"{p}.q_norm.weight", (hd,), block=i),
                ParamShape(f"{p}.k_norm.weight", (hd,), block=i)]
    return out


def _block(model: ModelConfig, moe: MoEConfig, i: int, b: str) -> list[ParamShape]:
    """The parameters of block ``i`` (layer id), named under ``b``."""
    D = model.dim
    out = [ParamShape(f"{b}.attention_norm.weight", (D,), block=i)]
    out += _attention(model, i, b)
    out.append(ParamShape(f"{b}.ffn_norm.weight", (D,), block=i))
    if model.is_moe_layer(i):
        p = f"{b}.ffn"
        out.append(ParamShape(f"{p}.router.gate.weight", (moe.num_experts, D), block=i))
        E, F = moe.num_experts, moe.hidden_dim
        out += [ParamShape(f"{p}.experts.w1", (E, D, F), True, i),
                ParamShape(f"{p}.experts.w2", (E, F, D), True, i)]
        if moe.activation == "swiglu":
            out.append(ParamShape(f"{p}.experts.w3", (E, D, F), True, i))
        if moe.num_shared_experts:
            out += _ffn(f"{p}.shared_experts", D, moe.shared_width, moe.activation, i)
    else:
        out += _ffn(f"{b}.ffn", D, model.dense_hidden_dim, moe.activation, i)
    return out


def param_shapes(model: ModelConfig, moe: MoEConfig) -> list[ParamShape]:
    """Every parameter of ``epscale.model.Transformer(model, moe)`` with its full shape
    (the routed experts stacked: [E, D, F] / [E, F, D]). A multi-token-prediction module
    (``mtp.{i}``, i = num_layers + k - 1) holds block i (its own FSDP unit) and, with the
    root's parameters (block -1), its norms and its projection [D, 2D]."""
    D, V = model.dim, model.vocab_size
    out = [ParamShape("tok_embeddings.weight", (V, D))]
    for i in range(model.num_layers):
        out += _block(model, moe, i, f"layers.{i}")
    for i in range(model.num_layers, model.num_layers + model.mtp_depth):
        out += [ParamShape(f"mtp.{i}.enorm.weight", (D,)),
                ParamShape(f"mtp.{i}.hnorm.weight", (D,)),
                ParamShape(f"mtp.{i}.eh_proj.weight", (D, 2 * D))]
        out += _block(model, moe, i, f"mtp.{i}.block")
        out.append(ParamShape(f"mtp.{i}.norm.weight", (D,)))
    out.append(ParamShape("norm.weight", (D,)))
    if not model.tie_embeddings:
        out.append(ParamShape("output.weight", (V, D)))
    return out


def _chunk(rows: int, ways: int) -> int:
    return -(-rows // ways)


def local_numel(p: ParamShape, lay: Layout) -> int:
    """Elements of ``p`` one rank holds at ``lay`` (the largest share, as FSDP pads)."""
    if p.expert:
        E, rest = p.shape[0], p.shape[1:]
        slots = E + (lay.redundant_experts if lay.ep > 1 else 0)
        e = slots // lay.ep
        if lay.efsdp == 1:
            return e * math.prod(rest)
        if e % lay.efsdp == 0:
            return (e // lay.efsdp) * math.prod(rest)
        hidden = 1 if p.name.endswith("w2") else 2   # [e, F, D] / [e, D, F]
        shape = [e, *rest]
        shape[hidden] = _chunk(shape[hidden], lay.efsdp)
        return math.prod(shape)
    if not lay.fsdp:
        return p.numel
    return _chunk(p.shape[0], lay.dp_shard) * math.prod(p.shape[1:])


def zero_state_bytes(shapes, lay: Layout, compute_bytes: int) -> dict[str, float]:
    """The state one rank holds for the whole step for the parameters ``shapes`` (those of
    its blocks) at ``lay``: ``params`` (fp32 master weights, its shares), ``grads``,
    ``optimizer`` (AdamW's two fp32 moments of its shares; the estimate counts them by
    ``train.optimizer_state_dtype``: :func:`optimizer_state_bytes`), ``unsharded`` (weights kept
    gathered, ``compute_bytes`` per element) and ``block`` (the gathered size of the
    largest block, elements), by ``lay.zero`` (see the module docstring)."""
    held = real = padded = 0
    blocks: dict[int | str, int] = {}
    whole = Layout(lay.world, lay.ep)              # an expert slice before FSDP shards it
    for p in shapes:
        mine = local_numel(p, lay)
        held += mine
        full = p.numel if not p.expert else local_numel(p, whole)
        real += full
        padded += mine * (lay.efsdp if p.expert else lay.dp_shard)
        blocks[block_of(p)] = blocks.get(block_of(p), 0) + full
    out = {"params": held * 4.0, "grads": held * 4.0, "optimizer": held * 8.0,
           "unsharded": 0.0, "block": max(blocks.values(), default=0)}
    if lay.fsdp and (lay.zero < 3 or lay.pp > 1):
        out["unsharded"] = padded * float(compute_bytes)
        if lay.zero == 1 or lay.pp > 1:
            out["grads"] = real * 4.0
    return out


def _attention_saved_per_token(model: ModelConfig, norm_kernel: str) -> tuple[float, float]:
    """(compute-dtype, fp32) elements one block's attention saves per token (no
    recomputation), its input included."""
    D, H = model.dim, model.num_heads
    if model.attention == "mla":
        nope, rope, v = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
        q_lora, kv = model.q_lora_rank, model.kv_lora_rank
        # the q/kv latents' norms (input, output, rstd) and up-projection inputs
        lat = D + (3 * q_lora + 1 if q_lora else 0) + 3 * kv + 1 + kv + rope
        rotary = 2 * H * rope + 2 * rope                  # RoPE's inputs (q_pe, k_pe, rotated)
        attn = lat + rotary + H * (2 * (nope + rope) + 3 * v)   # q, k, v, sdpa out, wo input
        lse = H
    else:
        hd, G = model.head_dim or D // H, model.num_kv_heads or H
        attn = D + (H + 2 * G) * hd + 2 * H * hd           # qkv input, q/k/v, sdpa out, wo input
        lse = H
        if model.qk_norm:                                  # the q/k norms (per head)
            lse += (H + G) * norm_fp32_per_token(hd, norm_kernel)
    return attn, lse


def _dense_saved_per_token(model: ModelConfig, moe: MoEConfig, moe_layer: bool,
                           impl: str, local: bool, norm_kernel: str
                           ) -> tuple[float, float, float]:
    """(compute-dtype, fp32, int64) elements one block saves per token (no recomputation).
    ``local``: the experts run without expert parallelism (the local dispatcher weights
    their output rows in fp32, keeping an fp32 copy); under EP the combine keeps them in
    the compute dtype (:class:`epscale.dispatch.rows.WeightedRowSum`)."""
    D, K = model.dim, moe.top_k
    m = 3 if moe.activation == "swiglu" else 2
    acts = 4 if moe.activation == "swiglu" else 2      # per hidden unit: see the dense FFN
    norms = 2 * norm_fp32_per_token(D, norm_kernel)       # the block's two RMSNorms
    attn, lse = _attention_saved_per_token(model, norm_kernel)
    fp32 = norms + lse
    if not moe_layer:
        ffn = D + acts * model.dense_hidden_dim           # w1 input; h1, h3, silu(h1), w2 input
        return attn + ffn, fp32, 0.0
    E, F = moe.num_experts, moe.hidden_dim
    router_fp32 = E + K + 1                                # logits/scores, weights, renorm
    ints = 3 * K                                           # chosen ids, kept rows, slots
    if impl == "cpu_fused":                                # the chunked kernel keeps h1 (and h3)
        experts = K * (D + (m - 1) * F)                    # its input rows, h1 (and h3)
        ints += 4 * K
        fp32 += K
    else:                                                  # autograd over grouped GEMMs
        experts = K * (D + acts * F)                       # the output rows, for the gates'
        if local:                                          # gradient: in fp32 (the local
            fp32 += K * D                                  # path weights them in fp32) or
        else:                                              # as computed (the combine's)
            experts += K * D
        ints += 2 * K
    shared = acts * moe.shared_width if moe.num_shared_experts else 0   # input: the router's
    return D + attn + experts + shared, fp32 + router_fp32, ints


def _attention_region_kept(model: ModelConfig, core: bool, up_proj: bool) -> tuple[float, float]:
    """(compute-dtype, fp32) elements per token the attention keeps as one selective
    region (``attention_core`` / ``mla_up_proj``): its input, the outputs of its projections
    but the up projections' (``up_proj``), the attention kernel's output and statistics
    unless ``core``, and the output projection's output (the region's kept result)."""
    D, H = model.dim, model.num_heads
    if model.attention == "mla":
        nope, rope, v = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
        q_lora, qk = model.q_lora_rank, nope + rope
        products = (q_lora if q_lora else H * qk) + model.kv_lora_rank + rope
        if not up_proj:
            products += (H * qk if q_lora else 0) + H * (nope + v)
        out = H * v
    else:
        hd, G = model.head_dim or D // H, model.num_kv_heads or H
        products, out = (H + 2 * G) * hd, H * hd
    kernel = (out, H) if not core else (0, 0)
    return D + products + kernel[0] + D, kernel[1]


def gate_weights_in_experts(modules, experts_impl: str, dispatcher: str) -> bool:
    """Whether the routed experts apply the gate weights themselves, before their down
    projection (:meth:`epscale.moe.experts.GroupedExperts.takes_gate_weights`): under
    ``moe_act`` on the grouped-GEMM path, with a dispatcher that has the weights on the
    experts' rank (every one but ``alltoall``, which weights the rows back at the
    source). Then the combine only sums and keeps no output rows for the gates' gradient;
    the experts keep each row's weight (fp32)."""
    return ("moe_act" in modules and experts_impl != "cpu_fused"
            and dispatcher not in GATE_AT_SOURCE)


GATE_AT_SOURCE = ("alltoall",)      # dispatchers whose combine weights the rows at the source


def recompute_dropped_per_token(model: ModelConfig, moe: MoEConfig, moe_layer: bool,
                                acts: Activations, local: bool = True,
                                dispatcher: str = "dedup") -> tuple[float, float, float]:
    """(compute-dtype, fp32, int64) elements per token a block keeps less under
    ``acts.recompute_modules`` than without recomputation (see
    :mod:`epscale.parallel.activation`): a norm keeps its input instead of what it keeps
    without (:func:`norm_fp32_per_token`); the router none of its fp32 scores and chosen ids; the shared
    experts and a dense FFN none of their hidden activations; ``moe_act`` (grouped-GEMM
    path) not the activation's output and the down projection's input, nor the output rows
    the combine kept (fp32 on the ``local`` path) where the experts take the gate weights
    (:func:`gate_weights_in_experts`); the attention regions what
    :func:`_attention_region_kept` leaves out."""
    mods, D, K = set(acts.recompute_modules), model.dim, moe.top_k
    hidden = 4 if moe.activation == "swiglu" else 2       # saved per hidden unit (no recompute)
    ups = 2 if moe.activation == "swiglu" else 1          # the up projections' outputs
    cd = fp32 = ints = 0.0
    if "norm" in mods:
        cd, fp32 = cd - 2 * D, fp32 + 2 * norm_fp32_per_token(D, acts.norm_kernel)
    if mods & {"attention_core", "mla_up_proj"}:
        attn, lse = _attention_saved_per_token(model, acts.norm_kernel)
        kept, kept_fp32 = _attention_region_kept(model, "attention_core" in mods,
                                                 "mla_up_proj" in mods)
        cd, fp32 = cd + attn - kept, fp32 + lse - kept_fp32
    if not moe_layer:
        return cd + (hidden * model.dense_hidden_dim if "mlp" in mods else 0), fp32, ints
    if "router" in mods:
        fp32, ints = fp32 + moe.num_experts + K + 1, ints + K
    if "shared_experts" in mods and moe.num_shared_experts:
        cd += hidden * moe.shared_width
    if "moe_act" in mods and acts.experts_impl != "cpu_fused":
        cd += K * (hidden - ups) * moe.hidden_dim
    if gate_weights_in_experts(mods, acts.experts_impl, "local" if local else dispatcher):
        cd, fp32 = (cd, fp32 + K * D - K) if local else (cd + K * D, fp32 - K)
    return cd, fp32, ints


def _selective_per_token(model: ModelConfig, moe: MoEConfig, moe_layer: bool,
                         impl: str) -> tuple[float, float, float]:
    """Elements a block keeps under selective recomputation: its input and the outputs of
    its matrix products and of the router's top-k (the grouped GEMMs' too; the CPU
    kernel's products run into its own buffers and are recomputed)."""
    D, H, K = model.dim, model.num_heads, moe.top_k
    if model.attention == "mla":
        nope, rope, v = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
        attn = (model.q_lora_rank or 0) + H * (nope + rope) + model.kv_lora_rank + rope \
            + H * (nope + v) + H * v + D
    else:
        hd, G = model.head_dim or D // H, model.num_kv_heads or H
        attn = (H + 2 * G) * hd + H * hd + D              # q/k/v projections, sdpa out, wo out
    m = 3 if moe.activation == "swiglu" else 2
    if not moe_layer:
        return D + attn + (m - 1) * model.dense_hidden_dim + D, H, 0.0
    shared = ((m - 1) * moe.shared_width + D) if moe.num_shared_experts else 0
    experts = K * ((m - 1) * moe.hidden_dim + D) if impl != "cpu_fused" else 0
    return D + attn + shared + experts, H + moe.num_experts + K, K


def autocast_rule(lay: Layout, acts: Activations) -> bool:
    """Whether a bf16 (fp16) compute dtype runs as the trainer's autocast: without FSDP
    (FSDP casts the parameters themselves: its MixedPrecisionPolicy)."""
    return DTYPE_BYTES[acts.compute_dtype] < 4 and not lay.fsdp


def residual_bytes(lay: Layout, acts: Activations) -> int:
    """Bytes per element of the residual stream (a block's input and output, a pipeline
    stage's output and receive buffers): fp32 under autocast (it adds each block's bf16
    output to fp32), else the compute dtype."""
    return 4 if autocast_rule(lay, acts) else DTYPE_BYTES[acts.compute_dtype]


def _autocast_copies_per_token(model: ModelConfig, moe: MoEConfig, moe_layer: bool) -> int:
    """Compute-dtype elements per token autocast keeps beyond the FSDP rule's set: each
    matrix product casts its fp32 input anew, so one input feeding several products is
    kept once per product (q, k, v: two more; MLA's two down-projections: one more; the
    dense SwiGLU's w1 and w3: one more). The MoE layer casts its input once itself."""
    D = model.dim
    extra = D if model.attention == "mla" else 2 * D
    if not moe_layer and moe.activation == "swiglu":
        extra += D
    return extra


def fp8_saved_tensors(model: ModelConfig, moe: MoEConfig, acts: Activations, local: bool,
                      modules: tuple[str, ...], dispatcher: str = "dedup"
                      ) -> list[tuple[int, int, int]]:
    """(rows per token, channels, bytes per element as computed) of each tensor a MoE
    layer's fp8 store holds (``train.activation_storage: fp8``, grouped-GEMM experts,
    :mod:`epscale.moe.saved_fp8`): the rows the expert GEMMs read, the activation's
    saved tensors (h1 and h3, with silu(h1) and the down projection's input unless
    ``moe_act`` is in ``modules``; GELU: h1, and its output), and the output rows the
    combine keeps (fp32 on the local path) where it keeps the experts' own: not
    ``alltoall``'s, which weights the rows it received back (kept as they are), and none
    where the experts apply the gate weights (:func:`gate_weights_in_experts`)."""
    K, D, F = moe.top_k, model.dim, moe.hidden_dim
    cb = DTYPE_BYTES[acts.compute_dtype]
    swiglu = moe.activation == "swiglu"
    hidden = (2 if swiglu else 1) if "moe_act" in modules else (4 if swiglu else 2)
    out = [(K, D, cb), (K * hidden, F, cb)]
    where = "local" if local else dispatcher
    if where not in GATE_AT_SOURCE and not gate_weights_in_experts(modules, acts.experts_impl,
                                                                   where):
        out.append((K, D, 4 if local else cb))
    return out


def fp8_ffn_tensors(width: int, moe: MoEConfig, acts: Activations) -> list[tuple[int, int, int]]:
    """The same for a dense FFN of ``width`` (the dense layers', the shared experts'): its
    hidden activations (h1, silu(h1), h3 and the down projection's input; GELU: h1 and its
    output), one row each per token; its input is its caller's."""
    return [(4 if moe.activation == "swiglu" else 2, width, DTYPE_BYTES[acts.compute_dtype])]


def fp8_attention_tensors(model: ModelConfig, acts: Activations, modules: tuple[str, ...]
                          ) -> list[tuple[int, int, int]]:
    """The same for a block's attention (:func:`epscale.parallel.activation.attention_held`):
    the attention kernel's output (a row of v_head_dim, MHA/GQA head_dim, channels per
    head) and its output projection's input (one row of H times that), what DeepSeek-V3
    caches as "the inputs of the Linear after the attention operator"; under
    ``mla_up_proj`` the kernel's output only (the region caches it and rebuilds the
    projection's input from it), under ``attention_core`` neither (both rebuilt)."""
    if "attention_core" in modules:
        return []
    H = model.num_heads
    hv = model.v_head_dim if model.attention == "mla" else model.head_dim or model.dim // H
    cb = DTYPE_BYTES[acts.compute_dtype]
    kernel_out = [(H, hv, cb)]
    return kernel_out if "mla_up_proj" in modules else kernel_out + [(1, H * hv, cb)]


def fp8_saving_per_token(model: ModelConfig, moe: MoEConfig, acts: Activations, local: bool,
                         modules: tuple[str, ...], dispatcher: str = "dedup",
                         moe_layer: bool = True) -> float:
    """Bytes per token a layer keeps less with fp8 storage than without, ``modules``
    recomputed: each tensor of :func:`fp8_saved_tensors` (a MoE layer's routed experts)
    and :func:`fp8_ffn_tensors` (its shared experts unless ``shared_experts`` is
    recomputed; a dense layer's FFN unless ``mlp`` is) and of
    :func:`fp8_attention_tensors` at 1 byte per element plus one fp32 scale per tile of
    128 channels, instead of its own dtype."""
    if acts.storage != "fp8" or acts.experts_impl == "cpu_fused":
        return 0.0
    if not moe_layer:
        tensors = fp8_ffn_tensors(model.dense_hidden_dim, moe, acts) if "mlp" not in modules else []
    else:
        tensors = fp8_saved_tensors(model, moe, acts, local, modules, dispatcher)
        if moe.num_shared_experts and "shared_experts" not in modules:
            tensors += fp8_ffn_tensors(moe.shared_width, moe, acts)
    tensors = tensors + fp8_attention_tensors(model, acts, modules)
    return sum(rows * (channels * nbytes - channels - 4 * math.ceil(channels / FP8_TILE))
               for rows, channels, nbytes in tensors)


def _autocast_weight_copies(cfg: RunConfig, lay: Layout) -> tuple[dict[int, int], int]:
    """({block: elements}, head elements) of the weights autocast casts to the compute
    dtype in a forward and autograd keeps for backward: every matrix a product reads (a
    rank's own experts; not the router, which runs in fp32, nor the norms or the
    embedding lookup); the head's (the embedding's when tied)."""
    blocks: dict[int, int] = {}
    head = 0
    for p in cached_param_shapes(cfg.model, cfg.moe):
        if len(p.shape) < 2 or p.name.endswith("router.gate.weight"):
            continue
        if p.block >= 0:
            blocks[p.block] = blocks.get(p.block, 0) + local_numel(p, lay)
        elif p.name == "output.weight" or (cfg.model.tie_embeddings
                                           and p.name == "tok_embeddings.weight"):
            head = p.numel
    return blocks, head


def _activation_parts(cfg: RunConfig, lay: Layout, acts: Activations
                      ) -> tuple[float, list[float], list[float], float]:
    """(embedding, each block's full set, each block's kept set, head): bytes one
    micro-batch saves for backward at ``lay`` and ``acts`` (kept = full without
    recomputation). Under autocast (bf16 without FSDP) the block input a recomputed block
    keeps is fp32, and the sets add autocast's copies (inputs cast once per product, and
    the cast weights; recomputation rebuilds a block's; the fused head casts its weight
    without keeping the copy)."""
    model, moe = cfg.model, cfg.moe
    T = lay.micro_batch_size * model.seq_len
    cb, rb = DTYPE_BYTES[acts.compute_dtype], residual_bytes(lay, acts)
    autocast = autocast_rule(lay, acts)
    copies = _autocast_weight_copies(cfg, lay)[0] if autocast else {}

    def nbytes(parts):
        c, f, i = parts
        return T * (c * cb + f * 4 + i * 8)

    local, disp = lay.ep == 1, cfg.parallel.dispatcher
    n_blocks = model.num_layers + model.mtp_depth   # the MTP modules' blocks last
    blocks = []
    for i in range(n_blocks):
        full = nbytes(_dense_saved_per_token(model, moe, model.is_moe_layer(i), acts.experts_impl,
                                             local, acts.norm_kernel))
        full -= T * fp8_saving_per_token(model, moe, acts, local, (), disp, model.is_moe_layer(i))
        if autocast:
            full += (T * _autocast_copies_per_token(model, moe, model.is_moe_layer(i))
                     + copies.get(i, 0)) * cb
        blocks.append(full)
    # the final norm's and the head's input in the compute dtype; the fused loss keeps no
    # logits (see head_transient_bytes)
    head = T * (norm_fp32_per_token(model.dim, acts.norm_kernel) * 4 + model.dim * cb)
    head += model.mtp_depth * (head + _mtp_module_bytes(cfg, lay, acts))
    embed = T * 8
    if acts.activation_checkpointing == "full":
        kept = [T * model.dim * rb] * n_blocks
    elif acts.activation_checkpointing == "selective":
        # the selective set counts the block input in the compute dtype
        kept = [nbytes(_selective_per_token(model, moe, model.is_moe_layer(i), acts.experts_impl))
                + T * model.dim * (rb - cb) for i in range(n_blocks)]
    elif acts.recompute_modules:
        mods = acts.recompute_modules

        def fp8(moe_layer: bool) -> float:
            """fp8 storage holds fewer tensors where a recomputed part drops some: what
            the dropped ones weighed in fp8 beyond their computed dtype's share."""
            return T * (fp8_saving_per_token(model, moe, acts, local, (), disp, moe_layer)
                        - fp8_saving_per_token(model, moe, acts, local, mods, disp, moe_layer))
        # the norms keep their inputs in the residual stream's dtype
        norms = T * 2 * model.dim * (rb - cb) if "norm" in mods else 0
        kept = [b - nbytes(recompute_dropped_per_token(model, moe, model.is_moe_layer(i), acts,
                                                       local, disp))
                + fp8(model.is_moe_layer(i)) + norms for i, b in enumerate(blocks)]
    else:
        kept = blocks
    return embed, blocks, kept, head


def _mtp_module_bytes(cfg: RunConfig, lay: Layout, acts: Activations) -> float:
    """Bytes one multi-token-prediction module (``epscale.model.MTPModule``) keeps for
    backward beyond its block's set and its head's (its final norm and the head's input,
    as the model's): the shifted token ids and targets (int64), what enorm and hnorm keep
    (:func:`norm_fp32_per_token`; hnorm's fp32 input is the residual stream the previous
    final norm keeps already where that is fp32), the projection's input [T, 2D] in the
    compute dtype, and under autocast its cast weight [D, 2D]."""
    D, T = cfg.model.dim, lay.micro_batch_size * cfg.model.seq_len
    cb, rb = DTYPE_BYTES[acts.compute_dtype], residual_bytes(lay, acts)
    norm = norm_fp32_per_token(D, acts.norm_kernel)
    per_token = 2 * 8 + norm * 4 + (norm - D) * 4 + (D * 4 if rb != 4 else 0) + 2 * D * cb
    weight = 2 * D * D * cb if autocast_rule(lay, acts) else 0
    return float(T * per_token + weight)


def head_transient_bytes(cfg: RunConfig, lay: Layout, acts: Activations) -> float:
    """Bytes the fused output head + cross-entropy (``epscale.head_loss``) holds at once
    beyond what it keeps, in its forward and again in its backward (at most): one chunk of
    :func:`head_chunk_rows` tokens' logits in the compute dtype, their fp32 (log-)softmax
    and the chunk's gradient in the compute dtype, and under autocast the head's weight
    cast to the compute dtype."""
    model = cfg.model
    T, V = lay.micro_batch_size * model.seq_len, model.vocab_size
    cb = DTYPE_BYTES[acts.compute_dtype]
    out = head_chunk_rows(T, V) * V * (2 * cb + 4)
    if autocast_rule(lay, acts):
        out += _autocast_weight_copies(cfg, lay)[1] * cb
    return float(out)


def activation_bytes(cfg: RunConfig, lay: Layout, acts: Activations) -> tuple[float, float]:
    """(kept, rebuilt): bytes one micro-batch keeps for backward at the end of its forward
    at ``lay``, and the most that recomputation rebuilds at once during backward (one
    block's set beyond what it kept; 0 without recomputation). Without a pipeline: the
    whole model's."""
    embed, blocks, kept, head = _activation_parts(cfg, lay, acts)
    if acts.activation_checkpointing not in ("full", "selective") and not acts.recompute_modules:
        return embed + sum(blocks) + head, 0.0
    return embed + sum(kept) + head, max(b - k for b, k in zip(blocks, kept))


def optimizer_state_bytes(numel: float, state_dtype: str = "float32") -> float:
    """Bytes of AdamW's two moments (exp_avg, exp_avg_sq) for ``numel`` parameters kept
    in ``state_dtype`` (``train.optimizer_state_dtype``); the step counts (one scalar per
    tensor) are left out."""
    return 2 * numel * DTYPE_BYTES[state_dtype]


_SHAPES: dict[str, tuple[ParamShape, ...]] = {}


def cached_param_shapes(model: ModelConfig, moe: MoEConfig) -> tuple[ParamShape, ...]:
    """:func:`param_shapes`, built once per configuration (``describe --fit`` asks for the
    same model at a thousand layouts)."""
    key = repr((model, moe))
    if key not in _SHAPES:
        if len(_SHAPES) >= 32:
            _SHAPES.clear()
        _SHAPES[key] = tuple(param_shapes(model, moe))
    return _SHAPES[key]


@lru_cache(maxsize=4096)
def _rank_peak(schedule: str, pp: int, m: int, virtual_stages: int, rank: int,
               stage_bytes: tuple[tuple[int, float], ...],
               whole_backward: frozenset[int] = frozenset()) -> tuple[float, int]:
    """:func:`epscale.plan.pipeline.in_flight` of one rank's schedule order."""
    return in_flight(schedule_actions(schedule, pp, m, virtual_stages, rank), dict(stage_bytes),
                     whole_backward)


def block_of(p: ParamShape) -> int | str:
    """Where a parameter lives: its block, 'embed' (stage 0) or 'head' (the last stage)."""
    if p.block >= 0:
        return p.block
    return "embed" if p.name.startswith("tok_embeddings") else "head"


def pairs_micro_batches(cfg: RunConfig, lay: Layout) -> bool:
    """Whether the trainer runs ``cfg`` at ``lay`` with paired micro-batches
    (``parallel.overlap_micro_batches``: micro-batch i + 1's forward beside micro-batch i's
    backward): then :func:`estimate` holds two micro-batches' activations and row
    buffers, and two blocks' recomputation working sets (the backward's rebuilt block,
    and the forward's block caught mid-way at a hand-off, whose transients under
    recomputation are at most what that block rebuilds). An upper bound: the backward
    frees its set as it goes, and the bound is reached where the forward's last exchange
    comes before the backward has freed anything (the forward then waits at its end for
    the backward to end: ``finish_partner``). Measured at ep=2 on the CPU
    (``benchmarks/memory.py --part pairs``, RESULTS.md): the pairs' increment over the
    plain run is 0.45-0.52x of this bound's without recomputation, 0.6x with selective and
    0.4x with full recomputation (where two micro-batches' kept inputs alone, the bound
    before 2026-12-06, undercounted it)."""
    par = cfg.parallel
    return (par.overlap_micro_batches and par.overlap != "none" and lay.pp == 1
            and not lay.fsdp and lay.ep > 1 and lay.micro_batches > 1)


def estimate(cfg: RunConfig, lay: Layout, acts: Activations | None = None) -> MemoryEstimate:
    """Memory per rank of ``cfg`` trained at ``lay`` with its activations kept as ``acts``
    says (None: the recipe's, :meth:`Activations.of`); under a pipeline the rank that needs
    the most, see :func:`pipeline_memory`."""
    acts = acts or Activations.of(cfg)
    if lay.pp > 1:
        return max(pipeline_memory(cfg, lay, acts), key=lambda r: r.memory.total).memory
    shapes = cached_param_shapes(cfg.model, cfg.moe)
    n = sum(local_numel(p, lay) for p in shapes)
    cb = DTYPE_BYTES[acts.compute_dtype]
    gathered = 0.0
    states = zero_state_bytes(shapes, lay, cb)
    if lay.fsdp and lay.zero < 3:
        gathered = states["block"] * cb     # a block's gradients before their reduction
    elif lay.fsdp:
        by_block: dict[int, int] = {}
        for p in shapes:
            full = p.numel if not p.expert else local_numel(p, Layout(lay.world, lay.ep))
            by_block[p.block] = by_block.get(p.block, 0) + full
        # this block and the prefetched next one gathered, plus the block's unsharded grads
        gathered = max(by_block.values()) * cb * 3
    T = lay.micro_batch_size * cfg.model.seq_len
    comm = 2 * T * cfg.moe.top_k * cfg.model.dim * cb if lay.ep > 1 else 0.0
    kept, rebuilt = activation_bytes(cfg, lay, acts)
    if pairs_micro_batches(cfg, lay):  # a forward beside the previous one's backward
        kept, rebuilt, comm = 2 * kept, 2 * rebuilt, 2 * comm
    return MemoryEstimate(params=n * 4, grads=states["grads"],
                          optimizer=optimizer_state_bytes(n, cfg.train.optimizer_state_dtype),
                          activations=kept, recompute=rebuilt, gathered=gathered, comm=comm,
                          head_chunk=head_transient_bytes(cfg, lay, acts),
                          params_per_rank=n, unsharded=states["unsharded"])


def pipeline_memory(cfg: RunConfig, lay: Layout, acts: Activations | None = None
                    ) -> list[RankMemory]:
    """Every pipeline rank of ``cfg`` at ``lay`` and ``acts`` (pp > 1; the module docstring's
    'Pipeline'): the parameters of its stages, sharded inside the stage, and the
    activations of the micro-batches its schedule keeps at once."""
    if lay.pp < 2:
        raise ConfigError(f"parallel.pp = {lay.pp}: pipeline_memory needs a pipeline (pp > 1)")
    acts = acts or Activations.of(cfg)
    model = cfg.model
    sizes = list(lay.layers_per_stage or layers_per_stage(
        with_pipeline(cfg, lay.pp, lay.pp_schedule, lay.pp_virtual_stages)))
    ranges = stage_layers(sizes)
    n = len(ranges)
    placement = stage_placement(lay.pp_schedule, lay.pp, lay.pp_virtual_stages)
    owner = {s: r for r, held in enumerate(placement) for s in held}
    cb = DTYPE_BYTES[acts.compute_dtype]
    T = lay.micro_batch_size * model.seq_len
    act = T * model.dim * residual_bytes(lay, acts)  # one micro-batch's stage output (or its gradient)
    m = lay.micro_batches

    held: dict[int | str, int] = {}                # parameters this layout leaves a rank, per block
    full: dict[int | str, int] = {}                # a block's gathered size under FSDP
    unsharded = Layout(lay.world, lay.ep)
    shares: dict[tuple, tuple[int, int]] = {}      # the same shape has the same shares
    for p in cached_param_shapes(model, cfg.moe):
        kind = (p.shape, p.expert, p.name.endswith("w2"))
        if kind not in shares:
            shares[kind] = (local_numel(p, lay),
                            p.numel if not p.expert else local_numel(p, unsharded))
        key = block_of(p)
        mine, whole = shares[kind]
        held[key] = held.get(key, 0) + mine
        full[key] = full.get(key, 0) + whole
    embed, blocks, kept, head = _activation_parts(cfg, lay, acts)
    rebuilt = [b - k for b, k in zip(blocks, kept)]
    head_chunk = head_transient_bytes(cfg, lay, acts)
    # the multi-token-prediction modules' blocks run on the last stage, after the head
    mtp_blocks = list(range(model.num_layers, model.num_layers + model.mtp_depth))
    # the last stage's copy of the embedding (a tied head, the MTP modules' lookups)
    copy = ([ParamShape("tok_embeddings.weight", (model.vocab_size, model.dim))]
            if model.tie_embeddings or model.mtp_depth else [])
    recomputes = acts.activation_checkpointing in ("full", "selective") or bool(acts.recompute_modules)

    def stage_set(s: int) -> float:
        r = ranges[s]
        out = sum(kept[i] for i in r) + (embed if s == 0 else 0.0)
        if s == n - 1:
            out += head + sum(kept[i] for i in mtp_blocks)   # (its output: a 0-dim loss)
        else:
            out += act                               # the output the schedule keeps
        if s > 0 and (acts.activation_checkpointing == "full" or "norm" in acts.recompute_modules):
            out -= act    # the first block keeps its input as it is: the receive buffer
        return out

    sets = {s: stage_set(s) for s in range(n)}
    # the last stage of a tied head with MTP modules runs its weight gradients with its
    # input gradients (StageChunk.splits_backward): its sets are freed at the input half
    whole_backward = frozenset({n - 1} if model.tie_embeddings and model.mtp_depth else ())
    out = []
    for rank, stages in enumerate(placement):
        last = n - 1 in stages
        layers = [i for s in stages for i in ranges[s]] + (mtp_blocks if last else [])
        keys: list[int | str] = layers + ["embed"] * (0 in stages) + ["head"] * last
        mine, copied = set(keys), copy if last else []
        states = zero_state_bytes([p for p in cached_param_shapes(model, cfg.moe)
                                   if block_of(p) in mine] + copied, lay, cb)
        count = sum(held.get(k, 0) for k in keys) + sum(local_numel(p, lay) for p in copied)
        peak, sets_held = _rank_peak(lay.pp_schedule, lay.pp, m, lay.pp_virtual_stages, rank,
                                     tuple(sorted(sets.items())), whole_backward)
        moe_here = any(model.is_moe_layer(i) for i in layers)
        gathered = {**full, "head": full.get("head", 0) + sum(p.numel for p in copied)}
        receives = sum(_receive_peaks(lay.pp_schedule, lay.pp, m, lay.pp_virtual_stages)[rank][i][1]
                       for i in range(2))   # in flight only (parallel/pipeline_buffers.py)
        sends = sum((s < n - 1 and owner[s + 1] != rank) + (s > 0 and owner[s - 1] != rank)
                    for s in stages)
        mem = MemoryEstimate(
            params=count * 4, grads=states["grads"],
            optimizer=optimizer_state_bytes(count, cfg.train.optimizer_state_dtype),
            activations=peak,
            recompute=max((rebuilt[i] for i in layers), default=0.0) if recomputes else 0.0,
            head_chunk=head_chunk if n - 1 in stages else 0.0,
            gathered=max(gathered[k] for k in keys if k in gathered) * cb if lay.fsdp else 0.0,
            comm=2 * T * cfg.moe.top_k * model.dim * cb if lay.ep > 1 and moe_here else 0.0,
            params_per_rank=count, p2p_buffers=receives * act,
            unsharded=states["unsharded"])
        out.append(RankMemory(rank, tuple(stages), tuple((r.start, r.stop) for r in
                                                         (ranges[s] for s in stages)),
                              sets_held, tuple(sets[s] for s in stages), sends * m * act, mem))
    return out


def resolve(run_cfg: RunConfig, *, dp: int | None = None, ep: int | None = None,
            world: int | None = None, fsdp: bool | None = None, dp_replicate: int | None = None,
            activation_checkpointing: str | None = None, micro_batch_size: int | None = None,
            compute_dtype: str | None = None, experts_impl: str | None = None,
            pp: int | None = None, pp_schedule: str | None = None,
            pp_virtual_stages: int | None = None) -> tuple[RunConfig, Layout, Activations]:
    """(the recipe with any pipeline keys replaced, its :class:`Layout`, its
    :class:`Activations`) with any of these replacing its keys (``pp`` x ``dp`` x ``ep``
    sets the world of a replicated layout; ``world`` any layout's)."""
    acts = Activations.of(run_cfg, activation_checkpointing, compute_dtype, experts_impl)
    cfg = with_pipeline(run_cfg, pp, pp_schedule, pp_virtual_stages)
    lay = Layout.from_config(cfg, world, dp=dp, ep=ep, fsdp=fsdp, dp_replicate=dp_replicate,
                             micro_batch_size=micro_batch_size)
    return cfg, lay, acts


def memory_per_rank(run_cfg: RunConfig, **layout) -> MemoryEstimate:
    """Memory per rank of ``run_cfg`` at its own layout, or with the keywords of
    :func:`resolve` replacing its keys."""
    return estimate(*resolve(run_cfg, **layout))



def _runtime_items(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple]:
    """Rank ``rank``'s list as torch's runtime schedules lower it before placing
    receives: its compute actions (a DualPipeV overlapped forward + backward pair as one
    item of two), with the no-op items that take a turn each (an UNSHARD per stage before
    it runs, at most 3 active, a RESHARD per stage evicted or left at the end, a
    REDUCE_GRAD after each stage's m-th B or W: torch's ``_add_unshard_reshard`` and
    ``_add_reduce_grad``)."""
    items = paired_items(schedule, p, m, v, rank)
    out: list[tuple] = []
    active: list[int] = []
    backwards: dict[int, int] = {}
    for j, item in enumerate(items):
        upcoming: list[int] = []                  # the next 3 stages to run (torch's rule)
        for later in items[j:]:
            upcoming += [a[0] for a in later if a[0] not in upcoming]
            if len(upcoming) >= 3:
                break
        out += [()] * sum(s not in upcoming for s in active)      # RESHARD
        active = [s for s in active if s in upcoming]
        out += [()] * sum(s not in active for s in upcoming)      # UNSHARD
        active += [s for s in upcoming if s not in active]
        out.append(item)
        for a in item:
            if a[1] in ("B", "W"):
                backwards[a[0]] = backwards.get(a[0], 0) + 1
                out += [()] * (backwards[a[0]] == m)              # REDUCE_GRAD
    out += [()] * len(active)
    return out


def _with_receives(schedule: str, p: int, m: int, v: int) -> list[list[tuple[int, str, int]]]:
    """Every pipeline rank's actions with the receives it posts ("RF": a forward input,
    "RB": an output gradient) where torch places them: a single-stage schedule just
    before the compute that needs it; a runtime one (``_add_send_recv``, ranks in turn,
    a rank's next item once its inputs are received or local) when the sender's compute
    is placed."""
    if PP_SCHEDULES[schedule] == "single":
        n = p
        out = []
        for r in range(p):
            acts = []
            for a in schedule_actions(schedule, p, m, v, r):
                if a[1] == "F" and r > 0:
                    acts.append((r, "RF", a[2]))
                if a[1] in ("B", "I") and r < n - 1:
                    acts.append((r, "RB", a[2]))
                acts.append(a)
            out.append(acts)
        return out
    placement = stage_placement(schedule, p, v)
    owner = {s: r for r, held in enumerate(placement) for s in held}
    n = len(owner)
    todo = [_runtime_items(schedule, p, m, v, r) for r in range(p)]
    done: list[set] = [set() for _ in range(p)]
    out = [[] for _ in range(p)]

    def ready(r, a):
        s, kind, mb = a
        if kind == "F" and s > 0:
            return bool({(s, "RF", mb), (s - 1, "F", mb)} & done[r])
        if kind in ("B", "I") and s < n - 1:
            return bool({(s, "RB", mb), (s + 1, "I", mb), (s + 1, "B", mb)} & done[r])
        return True

    while any(todo):
        progress = False
        for r in range(p):
            if not todo[r] or not all(ready(r, a) for a in todo[r][0]):
                continue
            for s, kind, mb in todo[r].pop(0):
                out[r].append((s, kind, mb))
                done[r].add((s, kind, mb))
                to = s + 1 if kind == "F" else s - 1
                # a gradient a V passes between its two stages on one rank is held
                # like a received one; a passed input is counted in the stage sets
                if kind in ("F", "B", "I") and 0 <= to < n and (owner[to] != r or kind != "F"):
                    recv = (to, "RF" if kind == "F" else "RB", mb)
                    out[owner[to]].append(recv)
                    done[owner[to]].add(recv)
            progress = True
        assert progress, "a schedule torch could not lower"
    return out


def receive_buffers_in_flight(cfg: RunConfig, lay: Layout, rank: int) -> dict[str, int]:
    """The most receive buffers pipeline rank ``rank`` holds at once when each holds its
    storage only while its micro-batch is in flight (parallel/pipeline_buffers.py): an
    input activation buffer (``act``) from its receive's posting to that micro-batch's
    backward on the stage (B, or W of a split one), an output gradient buffer (``grad``:
    received, or passed by the next stage on the same rank under a V) from its receive's
    posting (or the pass) to the same point."""
    return dict(_receive_peaks(lay.pp_schedule, lay.pp, lay.micro_batches,
                               lay.pp_virtual_stages)[rank])


@lru_cache(maxsize=256)
def _receive_peaks(schedule: str, p: int, m: int, v: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """:func:`receive_buffers_in_flight` of every pipeline rank."""
    out = []
    for order in _with_receives(schedule, p, m, v):
        held: dict[str, set] = {"act": set(), "grad": set()}
        peak = {"act": 0, "grad": 0}
        for s, kind, mb in order:
            if kind in ("RF", "RB"):
                which = "act" if kind == "RF" else "grad"
                held[which].add((s, mb))
                peak[which] = max(peak[which], len(held[which]))
            elif kind in ("B", "W"):
                held["act"].discard((s, mb))
                held["grad"].discard((s, mb))
        out.append(tuple(peak.items()))
    return tuple(out)
