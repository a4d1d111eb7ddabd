"""Activation checkpointing (``train.activation_checkpointing``): a transformer block keeps
less for backward and recomputes the rest when backward reaches it.

* ``full``: a block keeps only its input; its whole forward runs again in backward.
* ``selective``: a block keeps the outputs of its matrix products (the attention and
  dense projections, the expert GEMMs of the grouped-GEMM path, the router's gate) and of
  the router's top-k, and recomputes the cheap element-wise work in between.

Recomputation routes identically (the router sees the same inputs and its bias changes
only after the optimizer step), the dispatchers exchange the same rows again with the
split sizes their first forward read on the host (:mod:`epscale.dispatch.host`: a
recomputation adds no host sync), and the token counters skip it
(``epscale.moe.layer.is_recomputing``), so no token is counted twice. The CPU kernel's
products run into preallocated buffers (``out=`` forms), which cannot be kept this way;
under ``selective`` they are recomputed like the rest. A split backward (inputs, then
weights: the zero-bubble and V pipeline schedules) recomputes a block once per part;
both get the first forward's kept products and host values (:func:`selective_contexts`).

Light recomputation by module (``train.recompute_modules``, Megatron-Core's
``--recompute-modules``; either it or a whole-block mode above, not both): only the named
parts of each block keep less and recompute in backward, everything else is kept as
without recomputation.

* ``norm``: the block's two RMSNorms (Megatron's ``layernorm``). Each keeps its input
  only, not its fp32 copies and statistics.
* ``router``: the router (gate, scores, top-k); it keeps its input.
* ``shared_experts`` / ``mlp``: the shared experts' FFN / the dense layers' FFN, recomputed
  whole from their input.
* ``moe_act``: the routed experts' activation (grouped-GEMM path): the activation and the
  down projection run as one function that keeps the activation's inputs only, so
  backward recomputes the activation and the activation's output and the down
  projection's input are not kept (what Megatron's output-discarding checkpoint saves;
  ``epscale.moe.experts._ActivationDown``). The CPU kernel (``moe.experts_impl:
  cpu_fused``) keeps only its up projections' outputs already: nothing more to drop
  there.
* ``attention_core``: the attention (Megatron's ``core_attn``): the attention module
  keeps its input and its projections' outputs; the attention kernel and the element-wise
  work between the projections (RoPE, q/k norms) run again in backward.
* ``mla_up_proj``: MLA's up projections (``wq_b``, ``wkv_b``), their latents' norms and
  RoPE run again in backward: the module keeps its input, the latents, the attention
  kernel's output and its output projection's, not the per-head q, k, v.

Norms, router, shared experts and dense FFN are plain non-reentrant checkpoints of their
module; the two attention ones are selective checkpoints (torch's
``create_selective_checkpoint_contexts``) of one region whose policy keeps the named
products' outputs. None of them contains a dispatcher exchange or a host read.

FP8 storage (``train.activation_storage: fp8``, :func:`apply_activation_storage`): each
MoE layer's forward runs inside its experts' :class:`epscale.moe.saved_fp8.Fp8Storage`
region, so the rows the experts mark are saved for backward in fp8 (the checkpointed
parts inside the layer, router and shared experts, keep their own sets as above). Each
attention's forward runs inside its own store, which holds in fp8 what the attention
keeps of its kernel's output until backward reaches the attention: without its
recomputation the kernel's output (which the fused kernels save) and the output
projection's input (the same memory on the GPU's flash kernel, a copy on the CPU's);
under ``mla_up_proj`` the kernel's output the selective region caches (the projection's
input is rebuilt from it); under ``attention_core`` nothing (the kernel runs again). A
saved-tensor hook does not see what a selective region caches, so the attention's store
gives the held tensors' memory back after the forward and refills it from the fp8 copy
when the attention's output gradient arrives
(:meth:`epscale.moe.saved_fp8.Fp8Storage.swap`): the same rounding whoever reads them.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from ..dispatch.host import recompute_contexts
from ..moe.layer import is_recomputing, moe_layers
from ..moe.saved_fp8 import FP8_DTYPE, Fp8Storage

STORAGE = ("compute", "fp8")      # train.activation_storage

MODES = ("none", "full", "selective")
RECOMPUTE_MODULES = ("norm", "router", "shared_experts", "mlp", "moe_act", "attention_core",
                     "mla_up_proj")

_aten = torch.ops.aten
KEEP = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
        _aten.linear.default, _aten.topk.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default}
if hasattr(_aten, "_grouped_mm"):
    KEEP.add(_aten._grouped_mm.default)


ATTENTION_OPS = {op for op in KEEP if "dot_product" in str(op)}
if hasattr(_aten, "_scaled_dot_product_cudnn_attention"):
    ATTENTION_OPS.add(_aten._scaled_dot_product_cudnn_attention.default)
PRODUCTS = {op for op in KEEP if op not in ATTENTION_OPS and op != _aten.topk.default}


def _keep_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts(policy: Callable[..., CheckpointPolicy]) -> tuple:
    """torch's selective-checkpoint contexts for ``policy``, whose recomputation context
    can be entered more than once. torch's hands each kept output back once and then
    marks it consumed ("Trying to backward an extra time"); a split backward (inputs,
    then weights: the zero-bubble and V pipeline schedules) recomputes a region twice, in
    two graph tasks. Here each recomputation starts from the kept outputs again, so the
    kept outputs are held until the region's autograd graph is freed (its last backward
    node has run) rather than released one by one during its recomputation."""
    caching, cached = create_selective_checkpoint_contexts(policy)
    return caching, _Replayable(cached)


class _Replayable:
    """A selective checkpoint's recomputation context (torch's ``_CachedTorchDispatchMode``,
    which looks its kept outputs up in ``storage``), entered afresh for each
    recomputation with the kept outputs as the forward left them."""

    def __init__(self, cached) -> None:
        if not isinstance(getattr(cached, "storage", None), dict):
            raise RuntimeError(f"torch {torch.__version__}'s selective checkpoint keeps its "
                               "outputs somewhere other than .storage; epscale's replay of "
                               "them (split-backward pipeline schedules) needs updating")
        self.cached = cached
        self.kept: dict | None = None

    def __enter__(self):
        storage = self.cached.storage
        if self.kept is None:      # the first recomputation: the forward's entries
            self.kept = {key: dict(entries) for key, entries in storage.items()}
        else:                      # again: as they were before the first consumed them
            for key, entries in self.kept.items():
                storage[key] = dict(entries)
        return self.cached.__enter__()

    def __exit__(self, *exc) -> bool | None:
        return self.cached.__exit__(*exc)


def _selective_contexts():
    """The selective policy's contexts, each entered together with the host-value
    record's (:func:`epscale.dispatch.host.recompute_contexts`)."""
    keep_fwd, keep_rec = selective_contexts(_keep_products)
    host_fwd, host_rec = recompute_contexts()
    return _Both(keep_fwd, host_fwd), _Both(keep_rec, host_rec)


class _Both:
    """Two contexts entered as one; re-enterable (a split backward enters the
    recomputation context once per part) where both are."""

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> bool:
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)
        return False


def run(fn: Callable[..., torch.Tensor], mode: str, *args) -> torch.Tensor:
    """``fn(*args)`` under ``mode`` ('none' runs it plainly)."""
    if mode == "none" or not torch.is_grad_enabled():
        return fn(*args)
    if mode == "full":
        return checkpoint(fn, *args, use_reentrant=False, context_fn=recompute_contexts)
    if mode == "selective":
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_selective_contexts)
    raise ValueError(f"activation checkpointing mode {mode!r}; allowed: {', '.join(MODES)}")


def _run_as(mode: str, fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    return run(fn, mode, *args)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of ``model`` (its ``layers``: a ModuleDict keyed by layer
    index, as epscale's Transformer holds them, or a list), in depth order, then the
    multi-token-prediction modules' blocks (``model.mtp``, :class:`epscale.model.MTPModule`:
    FSDP units, recomputed and compiled as the others); [] without."""
    layers = getattr(model, "layers", None)
    mtp = getattr(model, "mtp", None)
    if layers is not None and mtp is not None:
        return list(layers.values()) + [m.block for m in mtp.values()]
    if layers is None:
        return []
    return list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str,
                                   modules: tuple[str, ...] | list[str] = ()) -> None:
    """Set every transformer block of ``model`` (``model.layers``) to ``mode`` (after
    ``epscale.parallelize``), or with ``mode`` 'none' recompute only the parts named in
    ``modules`` (``train.recompute_modules``). With whole-block recomputation, the CPU
    path's kept buffers are turned off: a recomputed forward must run the same operations
    as the first one (selective recomputation matches them one by one), and a kept buffer
    is handed out or not depending on what else still holds it."""
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing = {mode!r}; allowed: {', '.join(MODES)}")
    unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
    if unknown:
        raise ValueError(f"train.recompute_modules: unknown {unknown}; allowed: "
                         f"{', '.join(RECOMPUTE_MODULES)}")
    if modules and mode != "none":
        raise ValueError(f"train.recompute_modules = {list(modules)} cannot be combined with "
                         f"train.activation_checkpointing = {mode!r}")
    for block in transformer_blocks(model):
        block.run_forward = partial(_run_as, mode)
        recompute_parts(block, set(modules))
    if mode != "none":
        for moe in moe_layers(model):
            moe.drop_kept_buffers()


def recompute_parts(block: torch.nn.Module, modules: set[str]) -> None:
    """Make the parts of ``block`` named in ``modules`` recompute in backward (and the
    others run plainly again: applying twice replaces, never stacks)."""
    _set_forward(block.attention_norm, "norm" in modules)
    _set_forward(block.ffn_norm, "norm" in modules)
    moe = block.ffn if getattr(block, "is_moe", False) else None
    if moe is None:
        _set_forward(block.ffn, "mlp" in modules)
    else:
        _set_forward(moe.router, "router" in modules)
        if moe.shared_experts is not None:
            _set_forward(moe.shared_experts, "shared_experts" in modules)
        moe.experts.recompute_activation = "moe_act" in modules
    _set_attention(block.attention, "attention_core" in modules, "mla_up_proj" in modules)


def _checkpointed(forward: Callable, context_fn: Callable | None, *args, **kwargs):
    """``forward`` recomputed in backward. No random op runs in these parts (the model has
    no dropout), so the RNG state is not saved (on the CPU that alone kept 5 KB per
    region)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **extra,
                      **kwargs)


def _set_forward(module: torch.nn.Module, on: bool, context_fn: Callable | None = None) -> None:
    """``module.forward`` checkpointed (``on``; under ``context_fn``'s policy where given)
    or its own again."""
    unstored = module.__dict__.pop("_unstored_forward", None)
    if unstored is not None:   # apply_activation_storage wraps last: take its wrapper off
        module.forward = unstored
    plain = module.__dict__.pop("_plain_forward", None)
    if plain is not None:
        module.forward = plain
    if on:
        module._plain_forward = module.forward
        module.forward = partial(_checkpointed, module.forward, context_fn)


def _keep_outputs(policy: Callable[..., bool]):
    """A selective checkpoint's contexts that keep the outputs of the ops ``policy``
    names and recompute the rest."""
    def decide(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if policy(op) else CheckpointPolicy.PREFER_RECOMPUTE
    return partial(selective_contexts, decide)


class _Inside:
    """How deep the forward is inside the marked modules (forward hooks count; they run
    again during recomputation, so the policy decides the same both times)."""

    def __init__(self):
        self.depth = 0
        self.handles: list = []

    def mark(self, module: torch.nn.Module) -> None:
        def enter(*_):
            self.depth += 1

        def leave(*_):
            self.depth -= 1
        self.handles += [module.register_forward_pre_hook(enter),
                         module.register_forward_hook(leave, always_call=True)]


def _set_attention(attn: torch.nn.Module, core: bool, up_proj: bool) -> None:
    """``attention_core`` and/or ``mla_up_proj`` on one attention module: a selective
    checkpoint of its forward keeping the products' outputs, except the attention
    kernel's (``core``) and the up projections' (``up_proj``, marked by hooks)."""
    attn.recomputed_parts = frozenset(name for name, on in (("attention_core", core),
                                                             ("mla_up_proj", up_proj)) if on)
    old = attn.__dict__.pop("_recompute_marks", None)
    for handle in (old.handles if old is not None else []):
        handle.remove()
    inside = _Inside()
    if up_proj:
        for name in ("wq_b", "wkv_b"):
            if hasattr(attn, name):
                inside.mark(getattr(attn, name))
        attn._recompute_marks = inside

    def keep(op) -> bool:
        if inside.depth:
            return False
        return op in PRODUCTS or (op in ATTENTION_OPS and not core)
    _set_forward(attn, core or up_proj, _keep_outputs(keep))


def apply_activation_storage(model: torch.nn.Module, storage: str) -> None:
    """Store the FFNs' and the attention's saved activations as ``storage`` says
    (``train.activation_storage``: 'compute' as computed, 'fp8' in fp8 with 1 x 128 tile
    scales): each MoE layer's forward runs inside one fp8 store holding its routed
    experts' rows and its shared experts' hidden activations, each dense FFN's and each
    attention's (its kernel's output, :func:`attention_held`) inside its own (after
    :func:`apply_activation_checkpointing`, whose recomputed parts keep their own sets;
    applying again replaces, never stacks)."""
    if storage not in STORAGE:
        raise ValueError(f"train.activation_storage = {storage!r}; allowed: {', '.join(STORAGE)}")
    if storage == "fp8" and FP8_DTYPE is None:
        raise ValueError(f"train.activation_storage = 'fp8' needs torch.float8_e4m3fn, which "
                         f"this torch ({torch.__version__}) lacks: set train.activation_storage:"
                         " compute")
    for moe in moe_layers(model):
        parts = [moe.experts] + ([moe.shared_experts] if moe.shared_experts is not None else [])
        _set_storage(moe, parts, storage == "fp8")
    for block in transformer_blocks(model):
        if not getattr(block, "is_moe", False):
            _set_storage(block.ffn, [block.ffn], storage == "fp8")
        held = attention_held(getattr(block.attention, "recomputed_parts", frozenset()))
        _set_storage(block.attention, [block.attention], storage == "fp8" and bool(held), held)


def attention_held(recomputed: frozenset[str] | set[str]) -> tuple[str, ...]:
    """What of the attention's output fp8 storage holds (:meth:`Fp8Storage.hold`'s names)
    with the attention's ``recomputed`` parts: what the attention keeps of it."""
    if "attention_core" in recomputed:
        return ()
    if "mla_up_proj" in recomputed:
        return ("kernel_out",)
    return ("kernel_out", "proj_input")


def _set_storage(module: torch.nn.Module, parts: list[torch.nn.Module], fp8: bool,
                 held: tuple[str, ...] = ()) -> None:
    """``module.forward`` run inside a new fp8 store that ``parts`` mark into and hold
    ``held`` in (``fp8``), or as it was."""
    plain = module.__dict__.pop("_unstored_forward", None)
    if plain is not None:
        module.forward = plain
    store = Fp8Storage(held) if fp8 else None
    for part in parts:
        part.fp8_storage = store
    if store is not None:
        module._unstored_forward = module.forward
        module.forward = partial(_stored_forward, store, module.forward)


def _stored_forward(store: Fp8Storage, forward: Callable, *args, **kwargs):
    """``forward`` inside ``store``'s region; what it held swapped for fp8 copies, but in a
    recomputation (backward reads what it keeps right away, and no gradient of its output
    would arrive to refill them)."""
    with store.region():
        out = forward(*args, **kwargs)
        if not is_recomputing():
            store.swap(out)
        return out
