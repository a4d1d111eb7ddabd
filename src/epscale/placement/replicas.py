"""Redundant experts at run time (EPLB-style): physical expert slots, a dispatcher that
spreads each logical expert's tokens over its replicas, replica gradient sync, and live
re-placement that moves expert weights and their optimizer state between ranks without
changing the model's function.

Legend: T tokens, K top-k, A = T*K assignments, E logical experts, P physical slots in the
EP group, s = P/R slots per rank, R ranks of the EP group, L MoE layers, M max replicas.

Layout: EP rank r holds the physical slots [r*s, (r+1)*s) of every MoE layer; slot p of
layer l holds a full copy of logical expert ``phy2log[l, p]`` (the experts module's leading
dim becomes s). The router, its bias, the token counters and the aux losses stay logical;
only the dispatcher sees physical ids: it rewrites every logical id to one of the expert's
slots (the j-th assignment of expert x in this rank's batch goes to replica
``(j + rank) mod count_x``, so each rank spreads its tokens evenly and the ranks start at
different replicas) and hands them to an ordinary backend built for P experts. No host
sync is added; the backend's own one remains the layer's only one.

Replicas of an expert see different tokens, so their gradients differ; summing them over
the replicas (:func:`sync_replica_gradients`, one all-reduce over the EP group of the
replicated experts' gradients only) gives every copy the full gradient, and identical
optimizer steps keep the copies identical.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..dispatch.base import Dispatcher
from ..dispatch.comm import Exchange, group_info
from ..moe.balance import step_loads
from ..moe.layer import moe_layers
from ..ops import count_experts, count_ids
from ..plan.layout import Dims
from .eplb import Placement, _build, plan_placement

_PLACEMENT_ATTR = "_epscale_placement"     # the module-level Placement after parallelize
_EXPERT_PARAMS = ("w1", "w2", "w3")


# --------------------------------------------------------------------------------------
# The dispatcher
# --------------------------------------------------------------------------------------


def rank_within_expert(topk_idx_TK: torch.Tensor, num_experts: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """For the flattened assignments: ``key_A`` (the expert id, ``num_experts`` where
    dropped) and ``j_A``, the assignment's index among this batch's assignments of the same
    expert in token order. One stable sort, no host sync."""
    key_A, counts = count_experts(topk_idx_TK, num_experts)
    order_A = torch.argsort(key_A, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    j_sorted = torch.arange(key_A.numel(), device=key_A.device) - starts[key_A[order_A]]
    j_A = torch.empty_like(j_sorted)
    j_A[order_A] = j_sorted
    return key_A, j_A


def spread_over_replicas(topk_idx_TK: torch.Tensor, slots_by_logical: torch.Tensor,
                         first_slot_E: torch.Tensor, replicas_E: torch.Tensor,
                         rotate: int = 0) -> torch.Tensor:
    """Physical slot ids [T, K] for logical ids ``topk_idx_TK`` (-1 stays -1).

    slots_by_logical: [P] slot ids grouped by logical expert; expert x's replicas are
    ``slots_by_logical[first_slot_E[x] : first_slot_E[x] + replicas_E[x]]``.
    The j-th assignment (token order) of expert x takes replica (j + rotate) % count.
    Vectorised: one stable sort of the assignments, no host sync.
    """
    E = replicas_E.numel()
    key_A, j_A = rank_within_expert(topk_idx_TK, E)
    valid_A = key_A < E
    x_A = key_A.clamp(max=E - 1)
    rep_A = (j_A + rotate) % replicas_E[x_A]
    phys_A = slots_by_logical[first_slot_E[x_A] + rep_A]
    return torch.where(valid_A, phys_A, torch.full_like(phys_A, -1)).view_as(topk_idx_TK)


class PlacedDispatcher(Dispatcher):
    """Logical expert ids in, physical slots out: wraps ``inner``, a backend built for
    ``P`` experts over the EP group (slot p on group rank p // s).

    phy2log_P: int64 [P] logical expert of each slot (this layer's row of the placement).
    num_experts: E logical experts. rotate: this rank's offset into every replica list.
    ``set_layout`` swaps the layout (re-placement); everything else is the inner backend's.
    """

    name = "placed"

    def __init__(self, inner: Dispatcher, phy2log_P: torch.Tensor, num_experts: int,
                 rotate: int = 0):
        super().__init__(num_experts, inner.num_local_experts, inner.expert_offset)
        self.inner = inner
        self.rotate = int(rotate)
        self.set_layout(phy2log_P)

    def set_layout(self, phy2log_P: torch.Tensor) -> None:
        phy2log_P = torch.as_tensor(phy2log_P, dtype=torch.int64).reshape(-1)
        if phy2log_P.numel() != self.inner.num_experts:
            raise ValueError(f"PlacedDispatcher: {phy2log_P.numel()} slots, the inner dispatcher "
                             f"is built for {self.inner.num_experts}")
        counts_E = count_ids(phy2log_P, self.num_experts)
        if counts_E.numel() != self.num_experts or int(counts_E.min()) < 1:
            raise ValueError("PlacedDispatcher: every logical expert needs at least one slot "
                             f"(replica counts {counts_E.tolist()})")
        self.phy2log_P = phy2log_P.clone()
        self.slots_by_logical = torch.argsort(phy2log_P, stable=True)
        self.replicas_E = counts_E
        self.first_slot_E = torch.cumsum(counts_E, 0) - counts_E
        self._device_cache: dict = {}

    def _tables(self, device: torch.device):
        if device not in self._device_cache:
            self._device_cache[device] = tuple(t.to(device) for t in (
                self.slots_by_logical, self.first_slot_E, self.replicas_E))
        return self._device_cache[device]

    def map_ids(self, topk_idx_TK: torch.Tensor) -> torch.Tensor:
        """Logical ids [T, K] -> physical slot ids [T, K] (-1 kept)."""
        return spread_over_replicas(topk_idx_TK, *self._tables(topk_idx_TK.device), self.rotate)

    # -- the Dispatcher contract, on physical ids
    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        return self.inner.dispatch(x_TD, self.map_ids(topk_idx_TK), topk_weight_TK)

    def combine(self, y_RD, handle):
        return self.inner.combine(y_RD, handle)

    def combine_overlapped(self, y_RD, handle, side_work):
        return self.inner.combine_overlapped(y_RD, handle, side_work)

    def dispatch_compute_combine(self, x_TD, topk_idx_TK, topk_weight_TK, experts,
                                 timer=None, side_work=None):
        """The inner backend's own (pipelined, fused) form, on physical ids."""
        return self.inner.dispatch_compute_combine(x_TD, self.map_ids(topk_idx_TK),
                                                   topk_weight_TK, experts, timer, side_work)

    def bytes_sent(self) -> int:
        return self.inner.bytes_sent()

    def inter_node_bytes_sent(self) -> int:
        return self.inner.inter_node_bytes_sent()

    def __repr__(self) -> str:
        return (f"PlacedDispatcher(logical={self.num_experts}, slots={self.inner.num_experts}, "
                f"max_replicas={int(self.replicas_E.max())}, inner={self.inner!r})")


# --------------------------------------------------------------------------------------
# Applying a placement
# --------------------------------------------------------------------------------------


def get_placement(module: nn.Module) -> Placement | None:
    """The placement ``parallelize(..., placement=...)`` (or a re-placement) put on
    ``module``, or None."""
    return getattr(module, _PLACEMENT_ATTR, None)


def set_placement(module: nn.Module, placement: Placement) -> None:
    setattr(module, _PLACEMENT_ATTR, placement)


def check_placement(layers, dims: Dims, placement: Placement) -> None:
    """ValueError when ``placement`` does not fit the MoE ``layers`` over ``dims``' EP group."""
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be an epscale.placement.Placement (from plan_placement), "
                        f"got {type(placement).__name__}")
    L, P = placement.phy2log.shape
    if L != len(layers):
        raise ValueError(f"placement has {L} layer(s), the module has {len(layers)} MoE layer(s)")
    if placement.num_ranks != dims.ep:
        raise ValueError(f"placement was planned for {placement.num_ranks} ranks, the EP group "
                         f"has ep={dims.ep}")
    E = placement.replica_count.shape[1]
    for i, m in enumerate(layers):
        if m.cfg.num_experts != E:
            raise ValueError(f"placement is for {E} experts, MoE layer {i} has "
                             f"{m.cfg.num_experts}")


def local_slots(placement: Placement, layer: int, ep_rank: int) -> torch.Tensor:
    """Logical expert of each of ``ep_rank``'s slots in ``layer`` (int64 [s])."""
    s = placement.slots_per_rank
    return placement.phy2log[layer, ep_rank * s:(ep_rank + 1) * s]


# --------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------


def _placed_layers(module: nn.Module):
    placement = get_placement(module)
    if placement is None:
        return None, []
    return placement, moe_layers(module)


def sync_replica_gradients(module: nn.Module, dims: Dims) -> None:
    """Sum the gradients of every replicated logical expert over its copies, so each copy
    holds the full gradient. ONE all-reduce over the EP group, of the replicated experts'
    gradients only (experts with a single copy send nothing). A no-op without a placement
    or without replicas. ``epscale.parallel.sync_gradients`` calls it first; call it
    directly only when not using that (the two sums commute).
    """
    placement, layers = _placed_layers(module)
    if placement is None:
        return
    counts_LE = placement.replica_count
    parts, plan = [], []
    for i, moe in enumerate(layers):
        rep_ids = torch.nonzero(counts_LE[i] > 1).flatten()
        if rep_ids.numel() == 0:
            continue
        pos_E = torch.full((counts_LE.shape[1],), -1, dtype=torch.int64)
        pos_E[rep_ids] = torch.arange(rep_ids.numel())
        slot_pos = pos_E[local_slots(placement, i, dims.ep_rank)]       # [s], -1: not replicated
        mine = torch.nonzero(slot_pos >= 0).flatten()
        for pname in _EXPERT_PARAMS:
            p = getattr(moe.experts, pname, None)
            if p is None or not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad.reshape(p.shape[0], -1)
            buf = g.new_zeros((rep_ids.numel(), g.shape[1]))
            dev_mine = mine.to(g.device)
            buf.index_add_(0, slot_pos[mine].to(g.device), g.index_select(0, dev_mine))
            parts.append(buf.reshape(-1))
            plan.append((p, buf.shape, dev_mine, slot_pos[mine].to(g.device)))
    if not parts:
        return
    flat = torch.cat(parts)
    if dims.ep > 1:
        dist.all_reduce(flat, group=dims.ep_group)  # the one collective
    off = 0
    for p, shape, dev_mine, pos in plan:
        n = shape[0] * shape[1]
        buf = flat[off:off + n].view(shape)
        off += n
        g = p.grad.reshape(p.shape[0], -1)
        g.index_copy_(0, dev_mine, buf.index_select(0, pos))


def expert_grad_sq_norm(module: nn.Module, dims: Dims | None = None) -> torch.Tensor:
    """This rank's share of the squared norm of the *logical* expert gradients: each slot's
    squared norm divided by its expert's replica count, so the sum over the EP group counts
    every logical expert once (what a model without replicas would report). Without a
    placement: the plain squared norm of the expert gradients."""
    placement, layers = _placed_layers(module)
    total = None
    for i, moe in enumerate(layers or moe_layers(module)):
        if placement is not None and dims is not None:
            weight_s = 1.0 / placement.replica_count[i][local_slots(placement, i, dims.ep_rank)]
        else:
            weight_s = None
        for pname in _EXPERT_PARAMS:
            p = getattr(moe.experts, pname, None)
            if p is None or p.grad is None:
                continue
            sq_s = p.grad.float().pow(2).reshape(p.shape[0], -1).sum(1)
            if weight_s is not None:
                sq_s = sq_s * weight_s.to(sq_s.device, sq_s.dtype)
            total = sq_s.sum() if total is None else total + sq_s.sum()
    return total if total is not None else torch.zeros(())


# --------------------------------------------------------------------------------------
# Live re-placement
# --------------------------------------------------------------------------------------


def _sources(src_p2l: np.ndarray, dst_p2l: np.ndarray, R: int) -> np.ndarray:
    """Where each destination slot's contents come from, for two layouts of the same
    logical experts over R ranks (rank r holds a layout's slots [r*n, (r+1)*n), n = len/R;
    the lengths may differ, e.g. a placement and the plain logical layout).

    Returns [len(dst), 2]: (source rank, source local row) per destination slot: the
    destination rank itself when it already holds the expert, else one of the expert's
    source copies, chosen by the destination rank so that the senders are spread.
    """
    s_src, s_dst = len(src_p2l) // R, len(dst_p2l) // R
    by_logical: dict[int, list[int]] = {}
    for p, x in enumerate(src_p2l):
        by_logical.setdefault(int(x), []).append(p)
    src = np.empty((len(dst_p2l), 2), dtype=np.int64)
    for p, x in enumerate(dst_p2l):
        d = p // s_dst
        olds = by_logical.get(int(x))
        if not olds:
            raise ValueError(f"relayout: logical expert {int(x)} has no copy in the source layout")
        here = [q for q in olds if q // s_src == d]
        q = here[0] if here else olds[d % len(olds)]
        src[p] = (q // s_src, q % s_src)
    return src


@torch.no_grad()
def relayout_rows(tensors: Sequence[torch.Tensor], src_p2l, dst_p2l, dims: Dims
                  ) -> tuple[list[torch.Tensor], int, int]:
    """This rank's rows of ``tensors`` (each [n_src, ...], row i = slot ``ep_rank*n_src + i``
    of the layout ``src_p2l``) rearranged into the layout ``dst_p2l`` (new tensors
    [n_dst, ...]). Rows this rank already holds are copied locally; the rest travel in ONE
    all-to-all over the EP group for all tensors together. Collective over the EP group.

    Returns (new tensors, rows sent, rows received) for this rank.
    """
    src_p2l, dst_p2l = np.asarray(src_p2l), np.asarray(dst_p2l)
    R, me = dims.ep, dims.ep_rank
    s = len(dst_p2l) // R
    src = _sources(src_p2l, dst_p2l, R)
    dst_rank = np.arange(len(dst_p2l)) // s
    # Sends: (dest rank, dest slot) order; receives: (source rank, my slot) order, which is
    # the order each source sends them in.
    send = sorted((int(d), p) for p, d in enumerate(dst_rank) if src[p, 0] == me and d != me)
    recv = sorted((int(src[p, 0]), p) for p in range(me * s, (me + 1) * s) if src[p, 0] != me)
    local = [(p - me * s, int(src[p, 1])) for p in range(me * s, (me + 1) * s)
             if src[p, 0] == me]
    dev = tensors[0].device
    send_rows = torch.tensor([int(src[p, 1]) for _, p in send], dtype=torch.int64, device=dev)
    recv_slots = torch.tensor([p - me * s for _, p in recv], dtype=torch.int64, device=dev)
    local_dst = torch.tensor([a for a, _ in local], dtype=torch.int64, device=dev)
    local_src = torch.tensor([b for _, b in local], dtype=torch.int64, device=dev)
    fields = [t.index_select(0, send_rows) for t in tensors]
    if R > 1:
        send_splits = np.bincount([d for d, _ in send], minlength=R).tolist()
        recv_splits = np.bincount([q for q, _ in recv], minlength=R).tolist()
        got = Exchange(group_info(dims, "ep"), send_splits, recv_splits)(*fields)
    else:
        got = fields
    out = []
    for t, g in zip(tensors, got):
        new_t = t.new_empty((s, *t.shape[1:]))
        if local_dst.numel():
            new_t.index_copy_(0, local_dst, t.index_select(0, local_src))
        if recv_slots.numel():
            new_t.index_copy_(0, recv_slots, g.to(t.dtype))
        out.append(new_t)
    return out, len(send), len(recv)


def expert_state(moe: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 keys: Sequence[str] | None = None) -> list[tuple[str, str, torch.Tensor]]:
    """(weight name, 'param' or optimizer-state key, tensor) for one MoE layer's expert
    weights and, when ``optimizer`` holds state for them, every state tensor shaped like
    the weight (AdamW's exp_avg / exp_avg_sq; ``keys`` restricts to those), in a fixed
    order. Scalar entries such as 'step' are shared by all experts and left out."""
    out = []
    for pname in _EXPERT_PARAMS:
        p = getattr(moe.experts, pname, None)
        if p is None:
            continue
        out.append((pname, "param", p.data))
        st = optimizer.state.get(p) if optimizer is not None else None
        for key in sorted(st or ()):
            t = st[key]
            if (isinstance(t, torch.Tensor) and t.shape == p.shape
                    and (keys is None or key in keys)):
                out.append((pname, key, t))
    return out


def logical_layout(num_experts: int) -> np.ndarray:
    """The layout without redundancy: slot x holds logical expert x (E/ep per rank)."""
    return np.arange(num_experts, dtype=np.int64)


@torch.no_grad()
def move_to_placement(module: nn.Module, dims: Dims, new: Placement,
                      optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Re-place the experts of a module parallelized with a placement: every rank's
    slots take the weights, and the optimizer's per-parameter state (every state tensor
    shaped like the parameter, e.g. AdamW's exp_avg / exp_avg_sq; scalar 'step' entries are
    shared by all slots and stay), of the logical experts ``new`` puts there.

    An expert that a rank already holds is copied locally; the others travel in ONE
    all-to-all per layer over the EP group. The model's function is unchanged (the copies of
    an expert are identical), and so is training when the optimizer state moves along.
    Collective: every rank of the world calls it with the same ``new``.
    Returns {'copies_sent': n, 'copies_received': n} for this rank.
    """
    old = get_placement(module)
    if old is None:
        raise ValueError("move_to_placement: the module has no placement; parallelize it with "
                         "placement=... first")
    layers = moe_layers(module)
    check_placement(layers, dims, new)
    if new.num_physical_experts != old.num_physical_experts:
        raise ValueError(f"move_to_placement: the new placement has {new.num_physical_experts} "
                         f"slots, the module {old.num_physical_experts}; the slot count is fixed")
    sent = received = 0
    for i, moe in enumerate(layers):
        old_p2l, new_p2l = old.phy2log[i].numpy(), new.phy2log[i].numpy()
        if np.array_equal(old_p2l, new_p2l):
            continue
        tensors = [t for _, _, t in expert_state(moe, optimizer)]
        moved, n_sent, n_recv = relayout_rows(tensors, old_p2l, new_p2l, dims)
        for t, m in zip(tensors, moved):
            t.copy_(m)
        sent += n_sent
        received += n_recv
        disp = moe.dispatcher
        if isinstance(disp, PlacedDispatcher):
            disp.set_layout(new.phy2log[i])
    setattr(module, _PLACEMENT_ATTR, new)
    return {"copies_sent": sent, "copies_received": received}


def broadcast_placement(placement: Placement, src: int = 0, group=None) -> Placement:
    """Rank ``src``'s placement on every rank (one broadcast of phy2log): insurance that all
    ranks move to exactly the same layout even if their load windows differed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return placement
    buf = placement.phy2log.clone()
    dist.broadcast(buf, src=src, group=group)
    if torch.equal(buf, placement.phy2log):
        return placement
    E = placement.replica_count.shape[1]
    counts = np.stack([np.bincount(row, minlength=E) for row in buf.numpy()])
    return _build(buf.numpy(), counts, placement.num_ranks, placement.num_nodes)


class Rebalancer:
    """Live re-placement every ``every`` steps from a moving window of observed loads.

    module: parallelized with a placement. dims: the ParallelDims. every: steps between
    re-plans. window: steps of loads the plan uses (default ``every``). optimizer: moved
    along with the weights. num_groups: expert groups for the hierarchical policy.

    Each step call ``observe()`` (or ``observe(loads_LE)`` with the step's loads from
    :func:`epscale.moe.balance.step_loads` when they are at hand), then
    ``maybe_replace(step)``; it returns the new Placement when it moved, else None.
    """

    def __init__(self, module: nn.Module, dims: Dims, every: int, window: int | None = None,
                 optimizer: torch.optim.Optimizer | None = None, num_groups: int = 1):
        if get_placement(module) is None:
            raise ValueError("Rebalancer: the module has no placement; parallelize it with "
                             "placement=... first")
        if every < 1:
            raise ValueError(f"Rebalancer: every={every} must be >= 1")
        self.module, self.dims, self.every, self.optimizer = module, dims, every, optimizer
        self.num_groups = num_groups
        self.loads: deque = deque(maxlen=window or every)
        self.num_moves = 0

    def observe(self, counts_LE: Any = None) -> None:
        """Add the step's logical loads [L, E] (all-reduced, identical on every rank) to
        the window; None reads them from the layers' counters (one all-reduce)."""
        if counts_LE is None:
            counts_LE = step_loads(self.module, self.dims)
        self.loads.append(np.asarray(counts_LE.tolist() if isinstance(counts_LE, torch.Tensor)
                                     else counts_LE, dtype=np.float64))

    def state_dict(self) -> dict[str, Any]:
        """The load window and move count (for checkpoints): {'loads': float64 [W, L, E],
        'num_moves': int}."""
        loads = (torch.from_numpy(np.stack(list(self.loads))) if self.loads
                 else torch.zeros((0,), dtype=torch.float64))
        return {"loads": loads, "num_moves": self.num_moves}

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore :meth:`state_dict`; False (and nothing changed) when its loads are for
        another number of layers or experts."""
        loads = state.get("loads")
        cur = get_placement(self.module)
        shape = tuple(cur.replica_count.shape)
        if not isinstance(loads, torch.Tensor) or (loads.numel() and tuple(loads.shape[1:]) != shape):
            return False
        self.loads.clear()
        for row in loads.numpy() if loads.numel() else []:
            self.loads.append(np.asarray(row, dtype=np.float64))
        self.num_moves = int(state.get("num_moves", 0))
        return True

    def plan(self) -> Placement:
        cur = get_placement(self.module)
        load_LE = np.sum(self.loads, axis=0)
        return plan_placement(load_LE, cur.num_physical_experts, self.dims.ep_num_nodes,
                              self.dims.ep, self.num_groups)

    def maybe_replace(self, step: int) -> Placement | None:
        if step % self.every or not self.loads:
            return None
        new = broadcast_placement(self.plan())
        if torch.equal(new.phy2log, get_placement(self.module).phy2log):
            return None
        move_to_placement(self.module, self.dims, new, self.optimizer)
        self.num_moves += 1
        return new


def placement_to_dict(placement: Placement) -> dict[str, Any]:
    """JSON-able form (for checkpoint metadata): phy2log rows and the layout."""
    return {"phy2log": placement.phy2log.tolist(), "num_ranks": placement.num_ranks,
            "num_nodes": placement.num_nodes,
            "num_experts": int(placement.replica_count.shape[1])}


def placement_from_dict(d: dict[str, Any]) -> Placement:
    phy2log = np.asarray(d["phy2log"], dtype=np.int64)
    E = int(d["num_experts"])
    counts = np.stack([np.bincount(row, minlength=E) for row in phy2log])
    return _build(phy2log, counts, int(d["num_ranks"]), int(d["num_nodes"]))
