"""The MoE layer: router -> dispatcher.dispatch -> grouped experts -> dispatcher.combine
(+ shared experts, overlapped with the combine where the backend can).

Without expert parallelism (the ``local`` dispatcher, ``fuse=True``) the three middle
steps run as one chunked kernel (moe/fused.py) that gathers, computes and combines
chunk by chunk into buffers kept from step to step; any other dispatcher takes the
generic path. Both are tested against moe/reference.py.

Legend: T tokens, D model dim, E experts, e local experts, K top-k, R received rows.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch import nn

from ..config import MoEConfig
from ..dispatch.base import Dispatcher
from ..dispatch.local import LocalDispatcher
from .counts import count_ids
from .experts import FeedForward, GroupedExperts
from .losses import load_balance_loss, router_entropy, sequence_balance_loss, z_loss
from .router import TopKRouter


def _nonfinite_rows(x_TD: torch.Tensor) -> torch.Tensor:
    """Bool [T]: rows holding a NaN or inf. One row sum instead of an element-wise
    isfinite pass (the sum is non-finite iff an element is, barring overflow of finite
    values past the fp32 range, which is bad input too). bf16 and fp32 share fp32's
    range and are summed as they are (the CPU reduction accumulates bf16 in fp32);
    widening all of x first would be a fresh [T, D] fp32 copy every step. fp16 is summed
    in fp32, as its own range would overflow on finite rows."""
    dtype = torch.float32 if x_TD.dtype == torch.float16 else None
    return ~torch.isfinite(torch.sum(x_TD, dim=-1, dtype=dtype))


class MoE(nn.Module):
    """Mixture-of-Experts feed-forward layer.

    ``forward(x)``: x is [..., dim] (fp32 or bf16); returns the same shape and dtype.
    A 3-D input [B, S, D] is read as B sequences for the sequence-wise balance loss;
    any other shape counts as one sequence.

    After each forward: ``aux_loss`` (scalar tensor, the weighted sum of the configured
    router losses; zero when all coefficients are zero) and ``last_stats`` (dict of plain
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
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.hidden_dim,
                                      cfg.activation, cfg.use_grouped_mm, cfg.compile_kernels)
        self.shared_experts = (FeedForward(cfg.dim, cfg.shared_width, cfg.activation)
                               if cfg.num_shared_experts > 0 else None)
        self.dispatcher: Dispatcher = LocalDispatcher(cfg.num_experts)
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("dropped_assignments", torch.zeros(()), persistent=False)
        self.aux_loss = torch.zeros(())
        self.last_stats: dict = {}
        # Step-time breakdown hook: the trainer sets this to its timer's ``section(name)``;
        # sections used here: 'router', 'dispatch', 'experts', 'combine'.
        self.timer: Callable[[str], ContextManager] = lambda name: contextlib.nullcontext()

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
        wdtype = self.experts.w1.dtype
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
        fused = getattr(self.dispatcher, "dispatch_compute_combine", None)
        if fused is not None and getattr(self.dispatcher, "fuse", False):
            # One call for dispatch -> experts -> combine: without EP a chunked fused kernel
            # (moe/fused.py); with EP (dedup/hierarchical, overlap_chunks > 1) a pipeline that
            # keeps the next chunk's exchange in flight during expert compute. Backends that
            # accept side_work run the shared experts while the last combines are in flight
            # and add their output to y_TD themselves.
            if shared is not None and getattr(self.dispatcher, "accepts_side_work", False):
                y_TD, _ = fused(x_TD, route.topk_idx_TK, route.topk_weight_TK, self.experts,
                                timer=self.timer, side_work=shared)
                shared_y_TD = None
            else:
                y_TD, _ = fused(x_TD, route.topk_idx_TK, route.topk_weight_TK, self.experts,
                                timer=self.timer)
                with self.timer("combine"):
                    shared_y_TD = shared() if shared is not None else None
        else:
            with self.timer("dispatch"):
                recv_x_RD, tokens_per_local_expert_e, handle = self.dispatcher.dispatch(
                    x_TD, route.topk_idx_TK, route.topk_weight_TK)
            with self.timer("experts"):
                recv_y_RD = self.experts(recv_x_RD, tokens_per_local_expert_e)
            with self.timer("combine"):
                y_TD, shared_y_TD = self.dispatcher.combine_overlapped(recv_y_RD, handle, shared)
        if shared_y_TD is not None:
            y_TD = y_TD + shared_y_TD
        self.aux_loss = self._aux_loss(route, num_sequences)
        self._record_stats(x_TD, route)
        return y_TD.to(x.dtype).view(shape)

    def _aux_loss(self, route, num_sequences: int) -> torch.Tensor:
        cfg, E = self.cfg, self.cfg.num_experts
        loss = route.scores_TE.new_zeros(())
        if cfg.aux_loss_coeff > 0:
            if cfg.aux_loss_scope == "global":
                from ..balancing import global_batch_balance_loss

                # f_e over every rank's batch (one all-reduce of E+1 numbers)
                balance = global_batch_balance_loss(route.scores_TE, route.chosen_TK, E)
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
        from ..balancing import is_recomputing

        if is_recomputing():  # activation recomputation: these tokens were counted already
            return
        counts_E = count_ids(route.chosen_TK, self.cfg.num_experts)
        bad_T = _nonfinite_rows(x_TD)
        if x_TD.device.type == "cpu":
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

    def reset_token_counts(self) -> None:
        self.tokens_per_expert.zero_()
        self.dropped_assignments.zero_()

    def extra_repr(self) -> str:
        return f"dispatcher={self.dispatcher!r}"
