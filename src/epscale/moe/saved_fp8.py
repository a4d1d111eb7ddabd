"""Saved activations stored in fp8 for backward (``train.activation_storage: fp8``).

DeepSeek-V3 (arXiv 2412.19437, section 3.3) caches the activations its Linear backward
reads in FP8 with one scale per 1 x 128 tile of channels, and the SwiGLU inputs of the MoE
the same way. Here the FFNs mark what they want stored so (the routed experts: the rows
the expert GEMMs read, the SwiGLU inputs and intermediates, the expert outputs the combine
keeps for the gate gradient, :class:`epscale.moe.experts.GroupedExperts`; the dense FFNs
and shared experts: their hidden activations, :class:`epscale.moe.experts.FeedForward`);
while a MoE layer's (a dense FFN's) forward runs inside :meth:`Fp8Storage.region`, torch's
saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``) replace each marked tensor autograd saves
by its fp8 copy, made once however many operations save it, and restore it in the
original dtype when backward reads it. Unmarked tensors are saved as they are.

The attention (:class:`epscale.model.Attention`, :class:`epscale.model.LatentAttention`)
holds the input of its output projection, "the inputs of the Linear after the attention
operator" DeepSeek-V3 caches in FP8 (in its own E5M6 format; here the same e4m3 with 1 x
128 tile scales as the rest), and the attention kernel's output, which the fused kernels
keep for their backward (:meth:`Fp8Storage.hold`). These are kept either by autograd or,
where the attention is a selective recomputation region (``mla_up_proj``), by the
region's cache of the kernel's output, which saved-tensor hooks do not see; so a held
tensor's memory is given back at the end of the forward, an fp8 copy kept instead, and
its memory refilled from the copy when backward reaches the attention's output
(:meth:`Fp8Storage.swap`). Whoever holds the tensor then reads the restored values.

Rounding: e4m3 keeps 3 mantissa bits, so a value is restored within 2^-4 of itself
(relative), or within the tile's smallest step (amax / 448 x 2^-9) near zero.

Legend: N rows (every dim but the last), C channels (the last dim), b = ceil(C / 128).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0         # the largest finite e4m3fn value
TILE = 128              # channels per scale
_BLOCK_ELEMENTS = 1 << 22   # rows quantized at once: bounds the fp32 temporaries


@dataclass(frozen=True)
class Fp8Saved:
    """A tensor stored as fp8 ``q_NC`` with fp32 scales ``scale_Nb`` (one per row and tile
    of 128 channels), and the shape and dtype it is restored to."""

    q_NC: torch.Tensor
    scale_Nb: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    def restore(self) -> torch.Tensor:
        return dequantize(self.q_NC, self.scale_Nb, self.dtype).view(self.shape)

    @property
    def nbytes(self) -> int:
        return self.q_NC.numel() + 4 * self.scale_Nb.numel()


def stored_bytes(rows: int, channels: int) -> int:
    """Bytes an [rows, channels] tensor takes in fp8 storage (payload and scales)."""
    return rows * (channels + 4 * math.ceil(channels / TILE))


def quantize(x: torch.Tensor) -> Fp8Saved:
    """``x`` (any float dtype, at least 1-d) as fp8 with one scale per 1 x 128 tile of its
    last dim (a shorter last tile where C is not a multiple of 128)."""
    if FP8_DTYPE is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has no float8_e4m3fn dtype: set "
                           "train.activation_storage: compute")
    C = x.shape[-1]
    x_NC = x.reshape(-1, C)
    N, b = x_NC.shape[0], math.ceil(C / TILE)
    q_NC = torch.empty((N, C), dtype=FP8_DTYPE, device=x.device)
    scale_Nb = torch.empty((N, b), dtype=torch.float32, device=x.device)
    step = max(1, _BLOCK_ELEMENTS // max(C, 1))
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        xp = x_NC[r0:r1].float()
        if b * TILE != C:
            xp = torch.nn.functional.pad(xp, (0, b * TILE - C))
        xt = xp.view(r1 - r0, b, TILE)
        scale = xt.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
        q_NC[r0:r1] = (xt / scale.unsqueeze(-1)).view(r1 - r0, b * TILE)[:, :C].to(FP8_DTYPE)
        scale_Nb[r0:r1] = scale
    return Fp8Saved(q_NC, scale_Nb, tuple(x.shape), x.dtype)


def dequantize(q_NC: torch.Tensor, scale_Nb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, C] in ``dtype`` from fp8 values and their tile scales."""
    N, C = q_NC.shape
    b = scale_Nb.shape[1]
    x = q_NC.float()
    if b * TILE != C:
        x = torch.nn.functional.pad(x, (0, b * TILE - C))
    x = x.view(N, b, TILE) * scale_Nb.unsqueeze(-1)
    return x.view(N, b * TILE)[:, :C].to(dtype)


def _key(t: torch.Tensor) -> tuple:
    """The same key for a contiguous tensor and its contiguous reshapes (``linear`` saves
    its 3-d input flattened to rows)."""
    if t.is_contiguous():
        return (t.data_ptr(), t.numel(), t.dtype)
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _storage_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` with its dims reordered so that it is contiguous and covers its whole storage
    (the channels stay last), or None where no such view exists."""
    if not t.is_floating_point() or t.dim() < 1 or not t.numel() or t.stride(-1) != 1:
        return None
    order = sorted(range(t.dim() - 1), key=lambda d: -t.stride(d)) + [t.dim() - 1]
    v = t.permute(order)
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return v if v.is_contiguous() and t.storage_offset() == 0 and whole else None


def _refill(t: torch.Tensor, saved: Fp8Saved) -> None:
    """Give ``t``'s storage its memory back, filled with the restored values (written
    through a new tensor on the storage: ``t``'s version does not change, as autograd and
    the recomputation cache check)."""
    storage = t.untyped_storage()
    storage.resize_(t.numel() * t.element_size())
    with torch.no_grad():
        view = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape)
        view.copy_(saved.restore())


class Fp8Storage:
    """The fp8 store of one module's forward: tensors :meth:`mark` ed inside
    :meth:`region` are saved for backward as fp8 copies (one copy for a tensor and its
    contiguous reshapes, each restored in its own shape). A marked tensor is held until the
    region ends (so no other tensor takes its address meanwhile, and each is quantized
    once), then only its copy stays, with the autograd graph.

    ``held``: the names :meth:`hold` takes (the attention's: ``kernel_out``, the attention
    kernel's output, and ``proj_input``, its output projection's input; the caller names
    those its recomputation keeps)."""

    def __init__(self, held: tuple[str, ...] = ()):
        self._marked: dict[tuple, torch.Tensor] = {}
        self._copies: dict[tuple, Fp8Saved] = {}
        self._depth = 0
        self.held = frozenset(held)
        self._held: list[torch.Tensor] = []

    def mark(self, *tensors: torch.Tensor | None) -> None:
        """Store these (floating-point) tensors in fp8 when autograd saves them from now on
        (the hooks pack a tensor when an operation saves it: mark it before); nothing
        outside a region or without gradients."""
        if not self._depth or not torch.is_grad_enabled():
            return
        for t in tensors:
            if t is not None and t.is_floating_point() and t.dim() >= 1 and t.numel():
                self._marked[_key(t)] = t

    def hold(self, **tensors: torch.Tensor) -> None:
        """Keep the tensors named in ``held`` in fp8 from the end of the region's forward
        until backward reaches its output (:meth:`swap`), whoever keeps them for backward.
        Only a tensor that has its storage to itself (in some order of its dims, the
        channels last) can be held, once per storage; nothing outside a region or without
        gradients."""
        if not self._depth or not torch.is_grad_enabled():
            return
        for name, t in tensors.items():
            view = _storage_view(t) if name in self.held else None
            ptr = view.untyped_storage().data_ptr() if view is not None else None
            if view is not None and all(h.untyped_storage().data_ptr() != ptr for h in self._held):
                self._held.append(view)

    def swap(self, out: torch.Tensor) -> None:
        """At the end of the region's forward (``out``: its output): each held tensor's
        memory is given back and an fp8 copy kept, until the gradient of ``out`` arrives
        (a hook on it refills the memory before any backward inside the region reads it)."""
        held, self._held = self._held, []
        if not held or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return
        with torch.no_grad():
            copies = [(t, quantize(t)) for t in held]
        for t, _ in copies:
            t.untyped_storage().resize_(0)

        def refill(grad):
            for t, saved in copies:
                _refill(t, saved)
            copies.clear()
        out.register_hook(refill)

    @contextlib.contextmanager
    def region(self):
        """Run a forward with the hooks on (re-entering is a no-op)."""
        if self._depth or not torch.is_grad_enabled():
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._depth = 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._depth = 0
            self._marked.clear()
            self._copies.clear()
            self._held.clear()

    def _pack(self, t: torch.Tensor):
        key = _key(t)
        if key not in self._marked:
            return t
        copy = self._copies.get(key)
        if copy is None:
            copy = self._copies[key] = quantize(t)
        return copy if copy.shape == tuple(t.shape) else replace(copy, shape=tuple(t.shape))

    @staticmethod
    def _unpack(saved):
        return saved.restore() if isinstance(saved, Fp8Saved) else saved
