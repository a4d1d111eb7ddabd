"""Autograd-aware collectives for the dispatchers, with exact byte counting.

Legend: N rows sent by this rank, M rows received, D model dim, B bytes per packed row,
P ranks in the group.

Every exchange packs its row tensors (the token payload, expert ids, gate weights, ...) into
one uint8 buffer ``[N, B]`` so a dispatch is a single collective, whatever it carries.
Received fields are zero-copy views into the receive buffer. The backward of an exchange
is the same exchange reversed (send and receive splits swapped), carrying the gradients of
the floating-point fields in their own dtype.

An exchange may run asynchronously (``Exchange(..., async_op=True)``): the forward returns
its outputs at once and the caller must call ``exchange.wait()`` before reading them. This
is how the dispatchers keep a transfer in flight while experts or shared experts compute.

Hand-off points: a thread may register a hand-off (:func:`set_handoff`, e.g. the
overlapped forward/backward pair of ``epscale.parallel.overlap_pair``), called once per
collective of that thread, after the collective is issued and before it is waited for: in
:meth:`Exchange.wait`, before a backward's gradient exchange is waited for, and in
:func:`all_to_all_bytes` and :func:`finished_collective` (the all-gathers and
reduce-scatters of the ``allgather`` dispatcher and of spill-over's counts), whose
blocking collectives then run asynchronously around the hand-off. Another micro-batch's compute then runs while the transfer is in flight. A
thread without one (every thread outside such a pair) runs exactly as before. The pair's
backward side also registers its hand-off for autograd's worker threads
(:func:`set_engine_handoff`): on CUDA the engine runs a backward's nodes on its own device
thread, not on the thread that called ``backward()``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..plan.layout import Dims

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0          # largest finite e4m3fn value
FP8_BLOCK = 128          # channels that share one scale (DeepEP's per-128-channel scaling)
_NULL = contextlib.nullcontext()
_HANDOFF = threading.local()


def set_handoff(fn: Callable[[], None] | None) -> None:
    """Register ``fn`` as this thread's hand-off (None removes it): called where one of
    this thread's collectives is in flight and about to be waited for (see the module
    docstring). It must be called at the same points on every rank of a group, so it
    must not depend on whether the transfer has finished."""
    _HANDOFF.fn = fn


_ENGINE_HANDOFF: list[Callable[[], None] | None] = [None]


def set_engine_handoff(fn: Callable[[], None] | None) -> None:
    """Register ``fn`` as the hand-off of any thread without its own that is running a
    backward node (None removes it). The autograd engine runs the nodes of a backward
    whose tensors live on a GPU on its own device thread while the thread that called
    ``backward()`` waits, so a hand-off set on the caller (:func:`set_handoff`) would never
    be called there; the pair's backward side registers its hand-off here too. One per
    process: pairs do not nest."""
    _ENGINE_HANDOFF[0] = fn


def _handoff() -> Callable[[], None] | None:
    fn = getattr(_HANDOFF, "fn", None)
    if fn is None and _ENGINE_HANDOFF[0] is not None \
            and torch._C._current_autograd_node() is not None:
        return _ENGINE_HANDOFF[0]
    return fn


def hand_off() -> None:
    """Call this thread's hand-off, if it has one (or, inside a backward node, the
    engine's: :func:`set_engine_handoff`)."""
    fn = _handoff()
    if fn is not None:
        fn()


def has_handoff() -> bool:
    return _handoff() is not None


# --------------------------------------------------------------------------------------
# Byte accounting
# --------------------------------------------------------------------------------------


class CommCounter:
    """Bytes this rank sent to *other* ranks (a copy to itself costs no link).

    ``total`` counts every byte, ``inter_node`` the ones whose destination lives on another
    node. Both forward and backward exchanges are counted; read the difference around the
    region you want to measure.

    The counter is shared by all of one dispatcher's groups, so it also carries their
    communication settings: ``blocking`` (``parallel.overlap: none``: every exchange runs
    synchronously, whatever its caller asked) and ``clock`` (an
    ``epscale.metrics.commclock.CommClock`` timing the exchanges as 'dispatch', or None).
    """

    def __init__(self) -> None:
        self.total = 0
        self.inter_node = 0
        self.num_collectives = 0
        self.blocking = False
        self.clock = None

    def add(self, group_ranks: Sequence[int], my_rank: int, bytes_per_dest: Sequence[int],
            ranks_per_node: int) -> None:
        my_node = my_rank // ranks_per_node
        for g, nbytes in zip(group_ranks, bytes_per_dest):
            if g == my_rank:
                continue
            self.total += int(nbytes)
            if g // ranks_per_node != my_node:
                self.inter_node += int(nbytes)
        self.num_collectives += 1

    def snapshot(self) -> dict[str, int]:
        return {"total": self.total, "inter_node": self.inter_node,
                "collectives": self.num_collectives}


@dataclass
class GroupInfo:
    """A process group as the dispatchers see it: its global ranks and where they live."""

    group: dist.ProcessGroup | None
    ranks: list[int]              # global rank of each group rank
    my_rank: int                  # this process's global rank
    ranks_per_node: int
    counter: CommCounter

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        return self.ranks.index(self.my_rank)

    @classmethod
    def of(cls, group: dist.ProcessGroup, ranks_per_node: int, counter: CommCounter) -> "GroupInfo":
        return cls(group, dist.get_process_group_ranks(group), dist.get_rank(), ranks_per_node,
                   counter)


def group_info(dims: Dims, which: str, counter: CommCounter | None = None) -> GroupInfo:
    """GroupInfo of the ParallelDims ``dims``' group 'ep', 'dp', 'ep_inter' or 'ep_intra'
    (a single-rank group when the real one would be trivial), sharing ``counter``."""
    counter = counter if counter is not None else CommCounter()
    group = {"ep": dims.ep_group, "dp": dims.dp_group, "ep_inter": dims.ep_inter_group,
             "ep_intra": dims.ep_intra_group}[which]
    if group is None:
        return GroupInfo(None, [dims.rank], dims.rank, dims.ranks_per_node, counter)
    return GroupInfo.of(group, dims.ranks_per_node, counter)


# --------------------------------------------------------------------------------------
# Packing rows of mixed dtypes into bytes
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldSpec:
    dtype: torch.dtype
    width: int        # elements per row
    offset: int       # byte offset inside the packed row
    nbytes: int       # bytes of this field per row (fp8: payload + scales)
    fp8: bool = False


def _fp8_nbytes(width: int) -> int:
    return _fp8_scale_offset(width) + 4 * (-(-width // FP8_BLOCK))


def _fp8_scale_offset(width: int) -> int:
    return -(-width // 4) * 4  # the fp32 scales follow the payload, 4-byte aligned


def plan_fields(dtypes_widths: Sequence[tuple[torch.dtype, int]], fp8_field: int | None
                ) -> tuple[list[FieldSpec], int]:
    """Byte layout of a packed row: each field aligned to its element size, the row to 8."""
    specs, off = [], 0
    for i, (dtype, width) in enumerate(dtypes_widths):
        if i == fp8_field:
            align, nbytes, fp8 = 4, _fp8_nbytes(width), True
        else:
            align = torch.empty((), dtype=dtype).element_size()
            nbytes, fp8 = align * width, False
        off = -(-off // align) * align
        specs.append(FieldSpec(dtype, width, off, nbytes, fp8))
        off += nbytes
    return specs, -(-off // 8) * 8


def quantize_fp8(x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 payload [N, Dp] (D padded to whole 128-channel blocks) and fp32 scales [N, Dp/128]."""
    if FP8_DTYPE is None:
        raise RuntimeError("this torch build has no float8_e4m3fn dtype; use payload='bf16'")
    N, D = x_ND.shape
    num_blocks = -(-D // FP8_BLOCK)
    xp = x_ND.float()
    if num_blocks * FP8_BLOCK != D:
        xp = torch.nn.functional.pad(xp, (0, num_blocks * FP8_BLOCK - D))
    x_NbC = xp.view(N, num_blocks, FP8_BLOCK)
    amax_Nb = x_NbC.abs().amax(dim=-1).clamp_min(1e-12)
    scale_Nb = amax_Nb / FP8_MAX
    q = (x_NbC / scale_Nb.unsqueeze(-1)).to(FP8_DTYPE).view(N, num_blocks * FP8_BLOCK)
    return q, scale_Nb


def dequantize_fp8(q_ND: torch.Tensor, scale_Nb: torch.Tensor, width: int,
                   dtype: torch.dtype) -> torch.Tensor:
    N = q_ND.shape[0]
    num_blocks = scale_Nb.shape[1]
    x = q_ND.view(N, num_blocks, FP8_BLOCK).float() * scale_Nb.unsqueeze(-1)
    return x.view(N, num_blocks * FP8_BLOCK)[:, :width].to(dtype)


def pack_rows(fields: Sequence[torch.Tensor], specs: Sequence[FieldSpec], row_bytes: int
              ) -> torch.Tensor:
    """Copy row tensors ``[N, width_i]`` into one uint8 buffer ``[N, row_bytes]``."""
    N = fields[0].shape[0]
    device = fields[0].device
    buf = torch.empty((N, row_bytes), dtype=torch.uint8, device=device)
    if N == 0:
        return buf
    for t, s in zip(fields, specs):
        if s.fp8:
            q, scale = quantize_fp8(t)  # only the real channels travel, not the block padding
            buf[:, s.offset:s.offset + s.width].copy_(q[:, :s.width].view(torch.uint8))
            so = s.offset + _fp8_scale_offset(s.width)
            buf[:, so:s.offset + s.nbytes].view(torch.float32).copy_(scale)
        else:
            buf[:, s.offset:s.offset + s.nbytes].view(s.dtype).copy_(t.reshape(N, s.width))
    return buf


def unpack_rows(buf: torch.Tensor, specs: Sequence[FieldSpec]) -> list[torch.Tensor]:
    """Views (or, for an fp8 field, the dequantized tensor) of each field of ``buf``."""
    out = []
    for s in specs:
        raw = buf[:, s.offset:s.offset + s.nbytes]
        if s.fp8:
            scale = raw[:, _fp8_scale_offset(s.width):].view(torch.float32)
            q = raw[:, :s.width]
            pad = scale.shape[1] * FP8_BLOCK - s.width
            if pad:
                q = torch.nn.functional.pad(q, (0, pad))
            out.append(dequantize_fp8(q.contiguous().view(FP8_DTYPE), scale, s.width, s.dtype))
        else:
            out.append(raw.view(s.dtype))
    return out


# --------------------------------------------------------------------------------------
# All-to-all of packed rows, with autograd
# --------------------------------------------------------------------------------------


@dataclass
class Exchange:
    """One all-to-all of rows over ``info.group``.

    ``send_splits[p]`` rows go to group rank p, ``recv_splits[p]`` come from it (host ints,
    known from the count exchange). ``fp8_field`` names a field sent as e4m3 + scales in
    the forward (its gradient travels back in the field's own dtype).
    """

    info: GroupInfo
    send_splits: list[int]
    recv_splits: list[int]
    fp8_field: int | None = None
    async_op: bool = False
    _work: object | None = field(default=None, repr=False)
    _finish: Callable[[], None] | None = field(default=None, repr=False)
    _bwd_meta: object | None = field(default=None, repr=False)      # set by the forward
    _bwd_pending: tuple | None = field(default=None, repr=False)    # started by done()'s backward

    def reversed(self) -> "Exchange":
        return Exchange(self.info, self.recv_splits, self.send_splits)

    def __call__(self, *fields: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _RowAllToAll.apply(self, *fields)

    def wait(self) -> None:
        if self._work is not None:
            hand_off()
            self._work.wait()
            self._work = None
        if self._finish is not None:
            self._finish()
            self._finish = None

    def done(self, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Wait for an async exchange and return its outputs ``outs`` through the point
        where they are first read (:class:`_ExchangeDone`): in backward, the gradients'
        exchange starts there and is waited for in this exchange's own backward, so what
        autograd runs in between (the next chunk's experts, the shared experts) hides it."""
        return _ExchangeDone.apply(self, *outs)


def all_to_all_bytes(info: GroupInfo, send_buf: torch.Tensor, send_splits: list[int],
                     recv_splits: list[int], async_op: bool = False):
    """all_to_all_single of a [N, B] buffer; returns (recv [M, B], work or None).
    A blocking call from a thread with a hand-off (:func:`set_handoff`) runs
    asynchronously around it and returns already waited for (work None)."""
    recv = send_buf.new_empty((sum(recv_splits),) + tuple(send_buf.shape[1:]))
    row_bytes = send_buf[0:1].numel() * send_buf.element_size() if send_buf.dim() > 1 else send_buf.element_size()
    info.counter.add(info.ranks, info.my_rank, [n * row_bytes for n in send_splits],
                     info.ranks_per_node)
    if info.size == 1:
        recv.copy_(send_buf)
        return recv, None
    blocking = info.counter.blocking
    handed = not async_op and not blocking and has_handoff()
    async_op = (async_op or handed) and not blocking
    clock = info.counter.clock
    if clock is None:
        work = dist.all_to_all_single(recv, send_buf, recv_splits, send_splits,
                                      group=info.group, async_op=async_op)
    elif async_op:
        work = clock.track("dispatch", dist.all_to_all_single(
            recv, send_buf, recv_splits, send_splits, group=info.group, async_op=True),
            keep=(recv, send_buf))
    else:
        with clock.blocking("dispatch"):
            work = dist.all_to_all_single(recv, send_buf, recv_splits, send_splits,
                                          group=info.group)
    if handed:  # the caller asked to block: wait here, after the hand-off
        hand_off()
        work.wait()
        work = None
    return recv, work


class _RowAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ex: Exchange, *fields):
        specs, row_bytes = plan_fields([(t.dtype, math.prod(t.shape[1:])) for t in fields],
                                       ex.fp8_field)
        ctx.ex, ctx.shapes = ex, [tuple(t.shape[1:]) for t in fields]
        ctx.float_fields = [i for i, t in enumerate(fields) if t.is_floating_point()]
        ctx.bwd_meta = ex._bwd_meta = _GradMeta(ctx.shapes, ctx.float_fields,
                                                [t.dtype for t in fields], fields[0].device)
        flat = [t.reshape(t.shape[0], s.width) for t, s in zip(fields, specs)]
        send = pack_rows(flat, specs, row_bytes)
        async_op = ex.async_op and not ex.info.counter.blocking
        recv, work = all_to_all_bytes(ex.info, send, ex.send_splits, ex.recv_splits, async_op)
        M = recv.shape[0]
        if async_op and any(s.fp8 for s in specs):
            # The fp8 field must be dequantized after the data arrived: hand out a buffer now
            # and fill it in wait(). Nothing reads it before then.
            fp8_i = ex.fp8_field
            outs = [None] * len(fields)
            for i, s in enumerate(specs):
                if not s.fp8:
                    outs[i] = recv[:, s.offset:s.offset + s.nbytes].view(s.dtype)
            outs[fp8_i] = torch.empty((M, specs[fp8_i].width), dtype=specs[fp8_i].dtype,
                                      device=recv.device)
            target = outs[fp8_i]

            def finish():
                # Through detach(): the output is not yet read by anyone, and autograd
                # forbids in-place writes to outputs of a multi-output function.
                with torch.no_grad():
                    target.detach().copy_(unpack_rows(recv, [specs[fp8_i]])[0])
            ex._finish = finish
        else:
            outs = unpack_rows(recv, specs)
        ex._work = work
        if not async_op:
            ex.wait()
        outs = [o if o.shape[1:] == shp else o.view((M,) + shp) for o, shp in zip(outs, ctx.shapes)]
        non_diff = [o for i, o in enumerate(outs) if i not in ctx.float_fields]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        pending = getattr(ctx.ex, "_bwd_pending", None)
        if pending is None:  # no done() point, or its backward did not run: blocking
            pending = _grads_start(ctx.ex, ctx.bwd_meta, grads)
        ctx.ex._bwd_pending = None
        return (None, *_grads_finish(ctx.bwd_meta, pending))


@dataclass(frozen=True)
class _GradMeta:
    """What the backward of a row exchange needs to know about its forward fields."""

    shapes: list[tuple[int, ...]]
    float_fields: list[int]
    in_dtypes: list[torch.dtype]
    device: torch.device


def _grads_start(ex: Exchange, meta: _GradMeta, grads) -> tuple:
    """Pack the float fields' gradients and start their exchange (sent back the way the
    rows came; async). Every float field travels (zeros where no grad arrived) so the
    byte layout is the same on every rank whatever each one's autograd graph needed.
    Returns (recv buffer or None, work or None, field specs)."""
    M = sum(ex.recv_splits)
    g_list = []
    for i in meta.float_fields:
        g = grads[i]
        if g is None:
            g = torch.zeros((M,) + meta.shapes[i], dtype=meta.in_dtypes[i], device=meta.device)
        g_list.append(g.reshape(M, math.prod(meta.shapes[i])).to(meta.in_dtypes[i]))
    specs, row_bytes = plan_fields(
        [(meta.in_dtypes[i], math.prod(meta.shapes[i])) for i in meta.float_fields], None)
    if not g_list:
        return None, None, specs
    send = pack_rows(g_list, specs, row_bytes)
    recv, work = all_to_all_bytes(ex.info, send, ex.recv_splits, ex.send_splits, async_op=True)
    return recv, work, specs


def _grads_finish(meta: _GradMeta, pending: tuple) -> list:
    """Wait for :func:`_grads_start`'s exchange; the gradient of each forward field."""
    recv, work, specs = pending
    out = [None] * len(meta.shapes)
    if recv is None:
        return out
    if work is not None:
        hand_off()
        work.wait()
    N = recv.shape[0]
    for i, g in zip(meta.float_fields, unpack_rows(recv, specs)):
        out[i] = g.reshape((N,) + meta.shapes[i])
    return out


class _ExchangeDone(torch.autograd.Function):
    """Identity on an exchange's outputs that marks where they are first read. Forward:
    wait for the transfer. Backward: START the gradients' exchange (async), which the
    exchange's backward waits for; the incoming gradients pass through unchanged (that
    backward ignores them once started)."""

    @staticmethod
    def forward(ctx, ex: Exchange, *outs):
        ex.wait()
        ctx.ex = ex
        ctx.is_float = [o.is_floating_point() for o in outs]
        views = tuple(o.view_as(o) for o in outs)
        non_diff = [v for v in views if not v.is_floating_point()]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return views

    @staticmethod
    def backward(ctx, *grads):
        ex: Exchange = ctx.ex
        ex._bwd_pending = _grads_start(ex, ex._bwd_meta, grads)
        return (None, *(g if f else None for g, f in zip(grads, ctx.is_float)))


def exchange_counts(info: GroupInfo, counts_PC: torch.Tensor) -> torch.Tensor:
    """All-to-all of small int64 count rows: row p of ``counts_PC`` goes to group rank p;
    returns row q = what group rank q sent here. No autograd, no host sync."""
    recv, work = all_to_all_bytes(info, counts_PC.contiguous(), [1] * info.size, [1] * info.size)
    if work is not None:
        work.wait()
    return recv


# --------------------------------------------------------------------------------------
# All-gather / reduce-scatter of padded row blocks (the allgather backend)
# --------------------------------------------------------------------------------------


def timed_blocking(info: GroupInfo):
    """The context a blocking collective of ``info`` runs in: timed as 'dispatch' by the
    dispatcher's clock, if it has one."""
    clock = info.counter.clock
    return _NULL if clock is None else clock.blocking("dispatch")


def finished_collective(info: GroupInfo, issue: Callable[[bool], object], keep: tuple) -> None:
    """Run a collective of ``info`` whose result the caller needs at once: ``issue(async_op)``
    issues it. Blocking, timed as 'dispatch' (:func:`timed_blocking`); from a thread with a
    hand-off (and the exchanges not forced blocking), issued asynchronously, tracked by the
    clock (``keep``: its tensors), the hand-off called, then waited for, as
    :func:`all_to_all_bytes` does."""
    if info.counter.blocking or not has_handoff():
        with timed_blocking(info):
            issue(False)
        return
    work = issue(True)
    clock = info.counter.clock
    if clock is not None:
        work = clock.track("dispatch", work, keep=keep)
    hand_off()
    work.wait()


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


class AllGatherRows(torch.autograd.Function):
    """[Tmax, C] on each rank -> [P*Tmax, C] (rank-major). Backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, info: GroupInfo, x_TC: torch.Tensor):
        ctx.info = info
        P = info.size
        out = x_TC.new_empty((P * x_TC.shape[0],) + tuple(x_TC.shape[1:]))
        info.counter.add(info.ranks, info.my_rank,
                         [x_TC.numel() * x_TC.element_size()] * P, info.ranks_per_node)
        if P == 1:
            out.copy_(x_TC)
        else:
            x_TC = x_TC.contiguous()
            finished_collective(info, lambda async_op: dist.all_gather_into_tensor(
                out, x_TC, group=info.group, async_op=async_op), (out, x_TC))
        return out

    @staticmethod
    def backward(ctx, g):
        return None, ReduceScatterRows.apply(ctx.info, g.contiguous())


class ReduceScatterRows(torch.autograd.Function):
    """[P*Tmax, C] -> [Tmax, C]: the sum over ranks of block ``my index``. Backward: gather."""

    @staticmethod
    def forward(ctx, info: GroupInfo, y_PTC: torch.Tensor):
        ctx.info = info
        P = info.size
        out = y_PTC.new_empty((y_PTC.shape[0] // P,) + tuple(y_PTC.shape[1:]))
        block = out.numel() * out.element_size()
        # A ring reduce-scatter sends (P-1)/P of the buffer; count it as P-1 blocks.
        info.counter.add(info.ranks, info.my_rank, [block] * P, info.ranks_per_node)
        if P == 1:
            out.copy_(y_PTC)
        else:
            y_PTC = y_PTC.contiguous()
            finished_collective(info, lambda async_op: _reduce_scatter(
                out, y_PTC, info.group, async_op), (out, y_PTC))
        return out

    @staticmethod
    def backward(ctx, g):
        return None, AllGatherRows.apply(ctx.info, g.contiguous())


def counters_of(dispatcher) -> list[CommCounter]:
    """The byte counters of a MoE layer's dispatcher and of the dispatchers it wraps
    (a placement wrapper holds it in ``inner``, spill-over in ``plain``, with its ``info``
    and the inner dispatchers it builds later taking the same switches); where the layer's
    communication switches live."""
    out, seen = [], set()
    while dispatcher is not None:
        for counter in (getattr(dispatcher, "counter", None),
                        getattr(getattr(dispatcher, "info", None), "counter", None)):
            if isinstance(counter, CommCounter) and id(counter) not in seen:
                seen.add(id(counter))
                out.append(counter)
        dispatcher = getattr(dispatcher, "inner", None) or getattr(dispatcher, "plain", None)
    return out
