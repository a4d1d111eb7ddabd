"""The MoE layer: router -> dispatcher.dispatch_compute_combine(experts) (+ shared
experts, overlapped with the combine where the backend can) -> losses and statistics;
and finding the MoE layers of a model.

The dispatcher moves each token's rows to its experts and back (``epscale.dispatch``;
without expert parallelism the ``local`` one, which on CPU runs gather, experts and
combine as one chunked kernel). Every path is tested against moe/reference.py.

Legend: T tokens, D model dim, E experts, e local experts, K top-k, R received rows.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable, ContextManager

import torch
from torch import nn

from ..config import MoEConfig
from ..dispatch.base import Dispatcher
from ..dispatch.local import LocalDispatcher
from ..ops import count_ids, host_shortcuts
from .experts import FeedForward, GroupedExperts
from .losses import (global_batch_balance_loss, load_balance_loss, router_entropy,
                     sequence_balance_loss, z_loss)
from .router import TopKRouter


_RECOMPUTING = {"on": False}  # what a compiled block's caller saw (see recomputing)


def is_recomputing() -> bool:
    """True while a forward runs inside a backward pass, i.e. it is an activation
    recomputation (``torch.utils.checkpoint``, reentrant or not). Counters that must see
    each routed token once (``MoE.tokens_per_expert``, the step statistics) skip then.
    Inside a compiled region (``train.compile``) the autograd engine cannot be asked: the
    answer is what the eager caller set with :func:`recomputing`, and the compiled graph is
    guarded on it (one graph for the first forward, one for the recomputation)."""
    if torch.compiler.is_compiling():
        return _RECOMPUTING["on"]
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


@contextlib.contextmanager
def recomputing(flag: bool):
    """Tell the compiled forward run inside whether it is a recomputation
    (:func:`is_recomputing`; epscale.parallel.compile enters it around each call)."""
    before = _RECOMPUTING["on"]
    _RECOMPUTING["on"] = flag
    try:
        yield
    finally:
        _RECOMPUTING["on"] = before


def _nonfinite_rows(x_TD: torch.Tensor) -> torch.Tensor:
    """Bool [T]: rows holding a NaN or inf. One row sum instead of an element-wise
    isfinite pass (the sum is non-finite iff an element is, barring overflow of finite
    values past the fp32 range, which is bad input too). bf16 and fp32 share fp32's
    range and are summed as they are (the CPU reduction accumulates bf16 in fp32);
    widening all of x first would be a fresh [T, D] fp32 copy every step. fp16 is summed
    in fp32, as its own range would overflow on finite rows."""
    dtype = torch.float32 if x_TD.dtype == torch.float16 else None
    return ~torch.isfinite(torch.sum(x_TD, dim=-1, dtype=dtype))


def _run(fn: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
    return fn(*args, **kwargs)


@torch.compiler.disable
def _run_eagerly(fn: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
    """``fn(*args, **kwargs)`` outside any compiled graph (``MoE.dispatch_eagerly``)."""
    return fn(*args, **kwargs)


class MoE(nn.Module):
    """Mixture-of-Experts feed-forward layer.

    ``forward(x)``: x is [..., dim] (fp32 or bf16); returns the same shape and dtype.
    A 3-D input [B, S, D] is read as B sequences for the sequence-wise balance loss;
    any other shape counts as one sequence.

    After each forward (not after an eager recomputation in backward, which may run while
    another micro-batch's forward is half-way: ``parallel.overlap_micro_batches``): ``aux_loss``
    (scalar tensor, the weighted sum of the configured router losses; zero when all
    coefficients are zero) and ``last_stats`` (dict of plain
    numbers and tensors: tokens_per_expert, num_dropped, router_entropy, ...).
    Buffer ``tokens_per_expert`` [E] accumulates routed assignments (before capacity
    drops, the router's own decisions) across micro-batches until
    ``reset_token_counts()``; the loss-free bias update and the balance metrics read it.
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"MoE expects an epscale.MoEConfig, got {type(cfg).__name__}; "
                            "build one with MoEConfig(...) or config.from_dict(MoEConfig, d)")
        self.cfg = cfg
        self.router = TopKRouter(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.hidden_dim, cfg.activation,
                                      cfg.use_grouped_mm, cfg.experts_impl, cfg.cpu)
        self.shared_experts = (FeedForward(cfg.dim, cfg.shared_width, cfg.activation)
                               if cfg.num_shared_experts > 0 else None)
        # Replaced by epscale.parallelize with an expert-parallel backend.
        self.dispatcher: Dispatcher = LocalDispatcher(
            cfg.num_experts, workspace=self.experts.row_buffers(),
            dropless=cfg.capacity_factor is None)
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("dropped_assignments", torch.zeros(()), persistent=False)
        self.aux_loss = torch.zeros(())
        self.last_stats: dict = {}
        # Step-time breakdown hook: the trainer sets this to its timer's ``section(name)``;
        # sections used here: 'router', 'dispatch', 'experts', 'combine'.
        self.timer: Callable[[str], ContextManager] = lambda name: contextlib.nullcontext()
        # True: dispatch -> experts -> combine run eagerly inside a compiled block
        # (epscale.parallel.compile: a graph break around the exchanges and host reads)
        self.dispatch_eagerly = False
        # the ranks the global-batch balance loss (aux_loss_scope: global) reduces over:
        # None is the default group; epscale.parallelize sets this pipeline stage's ranks
        self.balance_group = None

    # ------------------------------------------------------------------ checks
    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoE.forward expects a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.cfg.dim:
            raise ValueError(f"MoE.forward: input shape {tuple(x.shape)} must end in "
                             f"moe.dim={self.cfg.dim}")
        if not x.is_floating_point():
            raise ValueError(f"MoE.forward: input dtype {x.dtype} must be floating point "
                             "(float32 or bfloat16)")
        # The router's weight: under FSDP mixed precision it is already in the compute dtype
        # here (its block is gathered), the experts' only once their own forward starts.
        wdtype = self.router.gate.weight.dtype
        if x.dtype != wdtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(f"MoE.forward: input dtype {x.dtype} differs from the parameters' "
                             f"{wdtype}; cast the module with .to({x.dtype}) or run under autocast")
        if self.cfg.debug and bool(_nonfinite_rows(x.reshape(-1, x.shape[-1])).any()):
            bad = (~torch.isfinite(x)).nonzero()[0].tolist()
            raise ValueError(f"MoE.forward: non-finite input value at index {bad} "
                             "(moe.debug=true raises; set it false to count it in last_stats)")

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        shape = x.shape
        num_sequences = shape[0] if x.dim() == 3 else 1
        x_TD = x.reshape(-1, self.cfg.dim)
        if torch.is_autocast_enabled(x.device.type):
            x_TD = x_TD.to(torch.get_autocast_dtype(x.device.type))
        with self.timer("router"):
            route = self.router(x_TD)
        shared = (lambda: self.shared_experts(x_TD)) if self.shared_experts is not None else None
        # dispatch -> experts -> combine; the shared experts run while the combine is in
        # flight where the backend can overlap them, and their output is added to y_TD.
        run = _run_eagerly if self.dispatch_eagerly else _run
        y_TD = run(self.dispatcher.dispatch_compute_combine,
                   x_TD, route.topk_idx_TK, route.topk_weight_TK, self.experts, timer=self.timer,
                   side_work=shared)
        aux_loss = self._aux_loss(route, num_sequences)
        # A recomputation (in a backward, maybe while another micro-batch's forward is
        # half-way: parallel.overlap_micro_batches) leaves the last forward's in place. A
        # compiled block sets it either way: its recomputed graph must save what the
        # forward's saved (compiled blocks are never paired).
        if torch.compiler.is_compiling() or not is_recomputing():
            self.aux_loss = aux_loss
        self._record_stats(x_TD, route)
        return y_TD.to(x.dtype).view(shape)

    def _aux_loss(self, route, num_sequences: int) -> torch.Tensor:
        cfg, E = self.cfg, self.cfg.num_experts
        loss = route.scores_TE.new_zeros(())
        if cfg.aux_loss_coeff > 0:
            if cfg.aux_loss_scope == "global":
                # f_e over every rank's batch (one all-reduce of E+1 numbers)
                balance = global_batch_balance_loss(route.scores_TE, route.chosen_TK, E,
                                                    group=self.balance_group)
            else:
                balance = load_balance_loss(route.scores_TE, route.chosen_TK, E)
            loss = loss + cfg.aux_loss_coeff * balance
        if cfg.seq_aux_loss_coeff > 0:
            loss = loss + cfg.seq_aux_loss_coeff * sequence_balance_loss(
                route.scores_TE, route.chosen_TK, E, num_sequences)
        if cfg.z_loss_coeff > 0:
            loss = loss + cfg.z_loss_coeff * z_loss(route.logits_TE)
        return loss

    @torch.no_grad()
    def _record_stats(self, x_TD: torch.Tensor, route) -> None:
        if is_recomputing():  # activation recomputation: these tokens were counted already
            return
        counts_E = count_ids(route.chosen_TK, self.cfg.num_experts)
        bad_T = _nonfinite_rows(x_TD)
        if host_shortcuts(x_TD.device):
            # A host branch is free on CPU; isfinite over all of x is not (slow for bf16).
            num_bad = (~torch.isfinite(x_TD[bad_T])).sum() if bool(bad_T.any()) else bad_T.sum()
        else:
            num_bad = (~torch.isfinite(x_TD)).sum()  # no host sync on accelerators
        self.tokens_per_expert += counts_E.to(self.tokens_per_expert.dtype)
        self.dropped_assignments += route.num_dropped
        self.last_stats = {
            "tokens_per_expert": counts_E,
            "num_tokens": x_TD.shape[0],
            "num_dropped": route.num_dropped,
            "router_entropy": router_entropy(route.scores_TE),
            "num_nonfinite_inputs": num_bad,
            "num_nonfinite_tokens": bad_T.sum(),
        }

    def drop_kept_buffers(self) -> None:
        """Allocate fresh buffers every step in the CPU kernel and the dispatcher (what
        ``moe.cpu.keep_buffers: false`` does) from now on."""
        if self.experts.cpu_kernel is not None:
            self.experts.cpu_kernel.workspace = None
        self.dispatcher.workspace = None

    def reset_buffers(self) -> None:
        """Zero token counters, as at construction (after ``to_empty``)."""
        self.reset_token_counts()

    def reset_token_counts(self) -> None:
        self.tokens_per_expert.zero_()
        self.dropped_assignments.zero_()

    def extra_repr(self) -> str:
        return f"dispatcher={self.dispatcher!r}"


def moe_layers(module: nn.Module) -> list[MoE]:
    """The epscale MoE layers inside ``module`` (or ``module`` itself), in registration
    (depth) order."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def named_moe_layers(module: nn.Module) -> list[tuple[int, str, MoE]]:
    """Every MoE layer of ``module`` as (layer id, qualified name, module).

    The layer id is the first integer in the qualified name (``layers.3.ffn`` -> 3), the
    block index of a usual transformer; where names carry no (or no unique) integers, the
    MoE layers are numbered 0.. in registration order.
    """
    found = [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]
    ids = []
    for name, _m in found:
        match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
        ids.append(int(match.group(1)) if match else None)
    if None in ids or len(set(ids)) != len(ids):
        ids = list(range(len(found)))
    return [(i, name, m) for i, (name, m) in zip(ids, found)]
