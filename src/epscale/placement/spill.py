"""Least-loaded spill-over at run time (LLEP, Nguyen et al.): when this step's routing
overloads some EP ranks, part of their hot experts' rows is computed on the least-loaded
ranks, with the experts' weights shipped there for the step and their gradients sent back.

Legend: T tokens, K top-k, A = T*K assignments, E experts, e = E/R experts per rank,
R ranks of the EP group, S helper slots per rank (the most experts one helper takes),
W = e + S slots per rank, D model dim, F hidden dim.

Per layer and step (all ranks take the same decisions from the same numbers):

1. The per-rank expert counts [R, E] are all-gathered over the EP group and copied to the
   host: spill-over adds this ONE host sync per layer, on top of the backend's own.
2. ``plan_spill`` (longest-processing-time) decides which rows of which hot experts move to
   which helper. Below the threshold nothing changes: the plain backend runs.
3. A transient physical layout with W slots per rank: rank r's slots [r*W, r*W + e) are its
   own experts, [r*W + e, r*W + W) the experts it helps with. Expert x's assignments,
   ordered by (source rank, token), are cut into contiguous pieces of the planned sizes
   (owner first, then helpers), so every helper gets exactly its planned rows; each source
   rank maps its assignments to slots on the device without a sync.
4. An ordinary backend built for R*W experts dispatches. The layer's experts compute the
   own-slot rows; the helper rows are computed inside ``dispatch`` by
   :class:`_HelperExperts`, which ships the helped experts' weights owner -> helper in one
   all-to-all and, in backward, their gradients helper -> owner in one all-to-all (added to
   the owner's gradients). Its backward sits between the combine's and the dispatch's
   backward on every rank, so the collectives keep the same order everywhere.

The result equals plain EP, forward and backward, up to floating-point summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..dispatch.base import Dispatcher, EPDispatcher
from ..dispatch.comm import GroupInfo, all_to_all_bytes, counters_of, finished_collective
from ..dispatch.registry import make_dispatcher
from ..moe.layer import moe_layers
from ..ops import count_experts
from ..plan.layout import Dims
from .llep import SpillPlan, plan_spill
from .replicas import rank_within_expert

_BIG = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class SpillLayout:
    """Host-side layout of one spilled step (identical on every rank).

    slots_per_rank W; helped[r]: experts rank r helps with (sorted, its helper slots in
    order); bounds_EM [E, M-1] global assignment index where each expert's next piece
    starts (padded with int64 max); slot_EM [E, M] slot of each piece; own_rows[r] rows of
    rank r's own slots; offset_RE[q, x] assignments of expert x on ranks before q.
    """

    slots_per_rank: int
    helped: tuple[tuple[int, ...], ...]
    bounds_EM: np.ndarray
    slot_EM: np.ndarray
    own_rows: tuple[int, ...]
    offset_RE: np.ndarray


def spill_layout(counts_RE: np.ndarray, plan: SpillPlan) -> SpillLayout:
    """Turn a spill plan into slots and piece boundaries (host, small numpy work)."""
    R, E = counts_RE.shape
    e = E // R
    rows: dict[tuple[int, int], int] = {}
    for sp in plan.spills:  # the planner may split one expert to the same helper twice
        rows[(sp.expert, sp.helper)] = rows.get((sp.expert, sp.helper), 0) + sp.rows
    helped = [sorted(x for (x, h) in rows if h == r) for r in range(R)]
    S = max(len(h) for h in helped)
    W = e + S
    total_E = counts_RE.sum(0)
    pieces: list[list[tuple[int, int]]] = []
    own_rows = np.zeros(R, dtype=np.int64)
    for x in range(E):
        owner = x // e
        helpers = sorted(h for (xx, h) in rows if xx == x)
        spilled = sum(rows[(x, h)] for h in helpers)
        own = int(total_E[x]) - spilled
        if own < 0:
            raise AssertionError(f"spill plan moves {spilled} rows of expert {x}, which has "
                                 f"{int(total_E[x])}")
        own_rows[owner] += own
        p = [(owner * W + (x - owner * e), own)]
        p += [(h * W + e + helped[h].index(x), rows[(x, h)]) for h in helpers]
        pieces.append(p)
    M = max(len(p) for p in pieces)
    bounds = np.full((E, max(M - 1, 1)), _BIG, dtype=np.int64)
    slots = np.zeros((E, M), dtype=np.int64)
    for x, p in enumerate(pieces):
        ends = np.cumsum([n for _, n in p])
        bounds[x, :len(p) - 1] = ends[:-1]
        slots[x, :len(p)] = [s for s, _ in p]
    offset = np.cumsum(counts_RE, axis=0) - counts_RE
    return SpillLayout(W, tuple(tuple(h) for h in helped), bounds, slots,
                       tuple(int(v) for v in own_rows), offset)


def assign_slots(topk_idx_TK: torch.Tensor, layout: SpillLayout, my_rank: int) -> torch.Tensor:
    """Physical slot [T, K] of each of this rank's assignments (-1 kept): the piece of
    its expert that the assignment's global index (source-rank offset + index in this
    rank's batch) falls in. No host sync."""
    E = layout.bounds_EM.shape[0]
    dev = topk_idx_TK.device
    key_A, j_A = rank_within_expert(topk_idx_TK, E)
    valid_A = key_A < E
    x_A = key_A.clamp(max=E - 1)
    off_E = torch.from_numpy(layout.offset_RE[my_rank]).to(dev)
    bounds_EM = torch.from_numpy(layout.bounds_EM).to(dev)
    slot_EM = torch.from_numpy(layout.slot_EM).to(dev)
    g_A = off_E[x_A] + j_A
    piece_A = (g_A.unsqueeze(1) >= bounds_EM[x_A]).sum(1)
    phys_A = slot_EM[x_A, piece_A]
    return torch.where(valid_A, phys_A, torch.full_like(phys_A, -1)).view_as(topk_idx_TK)


@dataclass(frozen=True)
class _Shipping:
    """Which expert weights travel: this rank sends its local experts ``send_local`` (in
    destination-rank order, ``send_splits`` per rank) and receives ``recv_splits``."""

    info: GroupInfo
    send_local: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    names: tuple[str, ...]


def _shipping(layout: SpillLayout, info: GroupInfo, e: int, names: tuple[str, ...]) -> _Shipping:
    R, me = info.size, info.index
    send, send_splits = [], []
    for h in range(R):
        mine = [x - me * e for x in layout.helped[h] if x // e == me]
        send += mine
        send_splits.append(len(mine))
    recv_splits = [sum(1 for x in layout.helped[me] if x // e == q) for q in range(R)]
    return _Shipping(info, torch.tensor(send, dtype=torch.int64), send_splits, recv_splits, names)


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t


class _HelperExperts(torch.autograd.Function):
    """Compute helper rows with the weights of other ranks' experts.

    Forward: one all-to-all of the helped experts' weights (owner -> helper), then the
    experts module's own forward with those weights. Backward: the local backward, then
    one all-to-all of the weight gradients (helper -> owner), scattered into the owner's
    weight gradients. Every rank runs both collectives, with empty parts where it neither
    helps nor is helped.
    """

    @staticmethod
    def forward(ctx, ship: _Shipping, experts: nn.Module, x_RD, tokens_per_slot_S, *weights):
        n_send = ship.send_local.numel()
        dev = weights[0].device
        idx = ship.send_local.to(dev)
        send = torch.cat([w.detach().index_select(0, idx).reshape(n_send, w[0].numel()).float()
                          for w in weights], 1) if weights else None
        recv, work = all_to_all_bytes(ship.info, send.contiguous(), ship.send_splits,
                                      ship.recv_splits)
        if work is not None:
            work.wait()
        n_recv = recv.shape[0]
        got, off = [], 0
        for w in weights:
            width = w[0].numel()
            got.append(recv[:, off:off + width].reshape((n_recv,) + tuple(w.shape[1:])).to(w.dtype))
            off += width
        ctx.ship, ctx.shapes = ship, [tuple(w.shape) for w in weights]
        ctx.w_dtypes = [w.dtype for w in weights]
        need_grad = any(ctx.needs_input_grad)  # forward itself runs with grad mode off
        # The inner graph keeps its own tensors, also inside a checkpointed block: else its
        # backward (on the helper ranks only) would set off the block's recomputation there,
        # with its collectives, while the other ranks are in this backward's all-to-all.
        with (torch.enable_grad() if need_grad else torch.no_grad()), \
                torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
            x_in = x_RD.detach().requires_grad_(x_RD.requires_grad)
            w_in = [g.requires_grad_(True) if need_grad else g for g in got]
            if n_recv and x_RD.shape[0]:
                from torch.func import functional_call

                y = functional_call(experts, dict(zip(ship.names, w_in)), (x_in, tokens_per_slot_S))
            else:
                y = x_RD.new_zeros((x_RD.shape[0], x_RD.shape[1]))
        ctx.graph = (x_in, w_in, y, n_recv)
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y):
        x_in, w_in, y, n_recv = ctx.graph
        ship: _Shipping = ctx.ship
        inputs = [x_in] + w_in
        grads = [None] * len(inputs)
        want = [i for i, t in enumerate(inputs) if t.requires_grad]
        if y.requires_grad and y.numel() and want:
            got = torch.autograd.grad(y, [inputs[i] for i in want], grad_y, allow_unused=True)
            for i, g in zip(want, got):
                grads[i] = g
        gx = grads[0] if grads[0] is not None else torch.zeros_like(x_in)
        gws = [g if g is not None else torch.zeros_like(w) for g, w in zip(grads[1:], w_in)]
        dev = grad_y.device
        send = (torch.cat([g.reshape(n_recv, int(np.prod(g.shape[1:]))).float() for g in gws], 1)
                if gws else torch.zeros((n_recv, 0), device=dev))
        back, work = all_to_all_bytes(ship.info, send.contiguous(), ship.recv_splits,
                                      ship.send_splits)
        if work is not None:
            work.wait()
        idx = ship.send_local.to(dev)
        out, off = [], 0
        for shape, dtype in zip(ctx.shapes, ctx.w_dtypes):
            width = int(np.prod(shape[1:]))
            g_full = torch.zeros((shape[0], width), dtype=torch.float32, device=dev)
            g_full.index_add_(0, idx, back[:, off:off + width])
            out.append(g_full.view(shape).to(dtype))
            off += width
        ctx.graph = None
        return (None, None, gx if x_in.requires_grad else None, None, *out)


@dataclass(frozen=True)
class SpillHandle:
    inner: Dispatcher        # the backend that dispatched (plain, or the W-slot one)
    inner_handle: Any
    y_help_RD: torch.Tensor | None   # helper rows' outputs (None: nothing spilled)


class SpillDispatcher(Dispatcher):
    """Wraps a plain EP backend (``plain``, E experts over the EP group) with per-step
    spill-over. ``experts``: the layer's experts module (its forward runs the helper rows
    with shipped weights). ``make_inner(num_slots)`` builds the same backend for a
    W-slot layout (cached per size). ``threshold``: spill when max/mean rank load exceeds
    it; ``min_rows``: the smallest piece worth shipping an expert for.

    ``last_plan`` holds the step's :class:`SpillPlan` (for metrics and tests).
    """

    name = "spill"

    def __init__(self, plain: Dispatcher, experts: nn.Module,
                 make_inner: Callable[[int], Dispatcher], info: GroupInfo,
                 threshold: float = 1.3, min_rows: int = 32):
        super().__init__(plain.num_experts, plain.num_local_experts, plain.expert_offset)
        if threshold < 1.0:
            raise ValueError(f"spill threshold={threshold} must be >= 1.0 (max/mean rank load)")
        if min_rows < 1:
            raise ValueError(f"spill min_rows={min_rows} must be >= 1")
        self.plain, self.experts, self.make_inner, self.info = plain, experts, make_inner, info
        self.threshold, self.min_rows = float(threshold), int(min_rows)
        self._inners: dict[int, Dispatcher] = {}
        self.last_plan: SpillPlan | None = None
        self.last_layout: SpillLayout | None = None

    def _inner(self, num_slots: int) -> Dispatcher:
        if num_slots not in self._inners:
            inner = self._inners[num_slots] = self.make_inner(num_slots)
            mine = self.info.counter  # the layer's communication switches hold for it too
            for counter in counters_of(inner):
                counter.blocking, counter.clock = mine.blocking, mine.clock
        return self._inners[num_slots]

    def _gather_counts(self, topk_idx_TK: torch.Tensor) -> np.ndarray:
        E, R = self.num_experts, self.info.size
        counts_E = count_experts(topk_idx_TK, E)[1][:E]
        out = counts_E.new_empty(R * E)
        self.info.counter.add(self.info.ranks, self.info.my_rank, [E * 8] * R,
                              self.info.ranks_per_node)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        counts_E = counts_E.contiguous()
        finished_collective(self.info, lambda async_op: gather(
            out, counts_E, group=self.info.group, async_op=async_op), (out, counts_E))
        return np.asarray(out.view(R, E).tolist(), dtype=np.int64)  # the extra host sync

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        counts_RE = self._gather_counts(topk_idx_TK)
        plan = plan_spill(counts_RE.sum(0), self.info.size, self.threshold, self.min_rows)
        self.last_plan = plan
        if not plan.active:
            self.last_layout = None
            recv_x_RD, tokens_e, h = self.plain.dispatch(x_TD, topk_idx_TK, topk_weight_TK)
            return recv_x_RD, tokens_e, SpillHandle(self.plain, h, None)
        layout = spill_layout(counts_RE, plan)
        self.last_layout = layout
        me, e = self.info.index, self.num_local_experts
        inner = self._inner(layout.slots_per_rank * self.info.size)
        phys_TK = assign_slots(topk_idx_TK, layout, me)
        recv_x_RD, tokens_W, h = inner.dispatch(x_TD, phys_TK, topk_weight_TK)
        n_own = layout.own_rows[me]          # known on the host from the plan: no sync
        n_help = len(layout.helped[me])
        names = tuple(n for n in ("w1", "w2", "w3") if getattr(self.experts, n, None) is not None)
        weights = [getattr(self.experts, n) for n in names]
        ship = _shipping(layout, self.info, e, names)
        y_help_RD = _HelperExperts.apply(ship, self.experts, recv_x_RD[n_own:],
                                         tokens_W[e:e + n_help], *weights)
        return recv_x_RD[:n_own], tokens_W[:e], SpillHandle(inner, h, y_help_RD)

    def _joined(self, y_RD, handle: SpillHandle):
        if handle.y_help_RD is None:
            return y_RD
        return torch.cat([y_RD, handle.y_help_RD.to(y_RD.dtype)])

    def combine(self, y_RD, handle: SpillHandle):
        return handle.inner.combine(self._joined(y_RD, handle), handle.inner_handle)

    def combine_overlapped(self, y_RD, handle: SpillHandle, side_work):
        return handle.inner.combine_overlapped(self._joined(y_RD, handle), handle.inner_handle,
                                               side_work)

    def bytes_sent(self) -> int:
        return self.plain.bytes_sent() + sum(d.bytes_sent() for d in self._inners.values())

    def spilled_rows(self) -> int | None:
        """Rows the last dispatch spilled (0 when its plan was inactive; None before the
        first dispatch)."""
        if self.last_plan is None:
            return None
        return sum(sp.rows for sp in self.last_plan.spills)

    def __repr__(self) -> str:
        return (f"SpillDispatcher(experts={self.num_experts}, threshold={self.threshold}, "
                f"min_rows={self.min_rows}, plain={self.plain!r})")


def apply_spill(module: nn.Module, dims: Dims, threshold: float = 1.3, min_rows: int = 32) -> nn.Module:
    """Give every MoE layer of an EP-parallelized ``module`` (``epscale.parallelize``)
    per-step spill-over, in place. Returns ``module``."""
    if dims.ep < 2:
        raise ValueError(f"apply_spill needs expert parallelism (ep >= 2), got ep={dims.ep}")
    for moe in moe_layers(module):
        plain = moe.dispatcher
        if isinstance(plain, SpillDispatcher):
            raise ValueError("apply_spill: this MoE layer already spills")
        if not isinstance(plain, EPDispatcher):
            raise ValueError(f"apply_spill: the layer's dispatcher {plain!r} is not an EP "
                             "backend; call epscale.parallelize(..., dispatcher='alltoall'|"
                             "'dedup'|'allgather'|'hierarchical') first")

        def make_inner(n, name=plain.name, payload=plain.payload, ws=plain.workspace,
                       shared=getattr(plain, "shared", None)):  # deepep's one buffer
            return make_dispatcher(name, n, dims, payload, 1, ws, deepep_buffer=shared)

        moe.dispatcher = SpillDispatcher(plain, moe.experts, make_inner, plain.info, threshold,
                                         min_rows)
    return module
