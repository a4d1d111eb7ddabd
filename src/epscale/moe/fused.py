"""Chunked expert compute: gather -> GEMM -> activation -> GEMM -> weighted scatter, one
cache-sized chunk of experts at a time, with a hand-written backward.

Legend: T tokens, D model dim, F expert hidden dim, E experts (local), R rows (kept
assignments, grouped by expert in ascending order), C rows of one chunk.

Why: on CPU the cost beside the GEMMs is memory traffic and page faults. The plain
autograd formulation materialises several [R, D] tensors per step (gathered inputs,
expert outputs, their gradients); at R = T*K these are tens of MB each, freshly
allocated (mmap + page faults) every step. Here only [C, D] chunk buffers exist, reused
for every chunk, and the gathered input is re-gathered in backward instead of saved.
The [R, F] pre-activations are the only per-row tensors kept for backward.

Two modes share one kernel:

* scatter mode (no expert parallelism): rows are gathered from ``x_TD`` by ``src_R``
  (the token of each row) and results are multiplied by ``weight_R`` and summed back
  into [T, D] (fp32 accumulation for bf16), so the layer never builds [R, D] at all.
  ``weight_R`` gets its gradient here too: dL/dw_r = <dL/dy_t . W2_e^T, a_r>.
* row mode (after an EP dispatcher): input is ``x_RD`` itself, output is [R, D].

Matmuls run per expert with ``torch.mm(out=...)`` into slices of the chunk buffers, or
with ``grouped_mm`` over a chunk when that is available and allowed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

HAS_GROUPED_MM = hasattr(F, "grouped_mm")

# Bytes of one [C, D] chunk buffer the planner aims for: about one core's L2, so that a
# chunk is still cached between its GEMM and the element-wise passes around it. 1 MB
# measured slightly faster than 4 or 16 MB on CPU (2-3%); small experts share a chunk.
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ExpertPlan:
    """Host-side layout of the rows: which expert owns which row range, cut into chunks
    of whole experts. Built once per forward from the counts (the layer's host sync)."""

    counts: tuple[int, ...]                     # rows per expert, len E
    starts: tuple[int, ...]                     # first row of each expert
    chunks: tuple[tuple[int, int, int, int], ...]  # (row0, row1, expert0, expert1)
    num_rows: int
    grouped: bool = False                       # grouped_mm per chunk instead of a loop

    @staticmethod
    def build(counts: list[int], row_bytes: int, chunk_bytes: int = CHUNK_BYTES,
              grouped: bool = False) -> "ExpertPlan":
        starts, acc = [], 0
        for n in counts:
            starts.append(acc)
            acc += n
        target = max(1, chunk_bytes // max(row_bytes, 1))
        chunks, e0, r0, rows = [], 0, 0, 0
        for e, n in enumerate(counts):
            # Close the chunk before an expert that would overflow it. An expert larger
            # than the target gets a chunk of its own: experts are never split, which
            # keeps one GEMM per expert and each weight gradient written once.
            if rows > 0 and rows + n > target:
                chunks.append((r0, r0 + rows, e0, e))
                e0, r0, rows = e, r0 + rows, 0
            rows += n
        if rows > 0:
            chunks.append((r0, r0 + rows, e0, len(counts)))
        return ExpertPlan(tuple(counts), tuple(starts), tuple(chunks), acc, grouped)

    @property
    def max_chunk_rows(self) -> int:
        return max((r1 - r0 for r0, r1, _, _ in self.chunks), default=0)


@dataclass(frozen=True)
class _Chunk:
    r0: int
    r1: int
    e0: int
    e1: int
    segs: tuple[tuple[int, int, int], ...]  # (expert, row offset in the chunk, rows), non-empty
    offs: torch.Tensor | None               # int32 [e1 - e0] cumulative rows (grouped GEMM)


def _chunks(plan: ExpertPlan, device: torch.device) -> list[_Chunk]:
    offs_all = None
    if plan.grouped and plan.chunks:
        ends = [plan.starts[e] + plan.counts[e] - r0
                for r0, _, e0, e1 in plan.chunks for e in range(e0, e1)]
        offs_all = torch.tensor(ends, dtype=torch.int32).to(device)  # one small copy
    out, at = [], 0
    for r0, r1, e0, e1 in plan.chunks:
        segs = tuple((e, plan.starts[e] - r0, plan.counts[e]) for e in range(e0, e1)
                     if plan.counts[e])
        offs = offs_all[at:at + e1 - e0] if offs_all is not None else None
        at += e1 - e0
        out.append(_Chunk(r0, r1, e0, e1, segs, offs))
    return out


def _chunk_mm(a_CX: torch.Tensor, w_EXY: torch.Tensor, out_CY: torch.Tensor, ch: _Chunk,
              transpose_w: bool = False, accumulate: bool = False) -> None:
    """out[rows of e] (+)= a[rows of e] @ w[e] (or w[e]^T) for every expert of a chunk."""
    if ch.offs is not None:
        w = w_EXY[ch.e0:ch.e1]
        res = F.grouped_mm(a_CX, w.transpose(1, 2) if transpose_w else w, offs=ch.offs)
        out_CY.add_(res) if accumulate else out_CY.copy_(res)
        return
    for e, off, n in ch.segs:
        w = w_EXY[e].t() if transpose_w else w_EXY[e]
        if accumulate:
            out_CY[off:off + n].addmm_(a_CX[off:off + n], w)
        else:
            torch.mm(a_CX[off:off + n], w, out=out_CY[off:off + n])


def _weight_grad(a_CX: torch.Tensor, g_CY: torch.Tensor, grad_EXY: torch.Tensor, ch: _Chunk) -> None:
    """grad[e] = a[rows of e]^T @ g[rows of e]; each expert appears in exactly one chunk."""
    if ch.offs is not None:
        grad_EXY[ch.e0:ch.e1].copy_(F.grouped_mm(a_CX.t(), g_CY, offs=ch.offs))
        return
    for e, off, n in ch.segs:
        torch.mm(a_CX[off:off + n].t(), g_CY[off:off + n], out=grad_EXY[e])


_WORKSPACE = threading.local()


def _accumulator(key: str, shape, acc_dtype, out_dtype, device) -> torch.Tensor:
    """A zeroed [T, D] accumulator. When it is only a temporary (it gets converted to
    ``out_dtype`` before returning), it is reused across calls: a fresh 10+ MB buffer
    costs page faults on every step, more than zeroing one that is already mapped.
    Per thread, so that concurrent callers never share one."""
    if acc_dtype == out_dtype:  # the accumulator is the result itself: must be fresh
        return torch.zeros(shape, dtype=acc_dtype, device=device)
    bufs = getattr(_WORKSPACE, "bufs", None)
    if bufs is None:
        bufs = _WORKSPACE.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.shape != torch.Size(shape) or buf.dtype != acc_dtype or buf.device != device:
        buf = bufs[key] = torch.empty(shape, dtype=acc_dtype, device=device)
    return buf.zero_()


class FusedExperts(torch.autograd.Function):
    """See the module docstring. Arguments of ``forward``:

    x: [T, D] (scatter mode) or [R, D] (row mode), fp32 or bf16.
    weight_R: fp32 [R] gate weights (scatter mode) or None.
    w1, w3, w2: [E, D, F], [E, D, F] or None (GELU), [E, F, D] in x's dtype.
    src_R: int64 [R] token of each row (scatter mode) or None.
    plan: :class:`ExpertPlan`. activation: 'swiglu' or 'gelu'.
    Returns [T, D] (scatter mode) or [R, D] (row mode) in x's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight_R, w1, w3, w2, src_R, plan: ExpertPlan, activation: str):
        scatter = src_R is not None
        R, D, Fh = plan.num_rows, x.shape[-1], w1.shape[-1]
        dt, dev = x.dtype, x.device
        C = plan.max_chunk_rows
        h1_RF = torch.empty((R, Fh), dtype=dt, device=dev)
        h3_RF = torch.empty((R, Fh), dtype=dt, device=dev) if w3 is not None else None
        a_CF = torch.empty((C, Fh), dtype=dt, device=dev)
        if scatter:
            x_CD = torch.empty((C, D), dtype=dt, device=dev)
            y_CD = torch.empty((C, D), dtype=dt, device=dev)
            acc_dtype = torch.float32 if dt != torch.float64 else dt
            out = _accumulator("fwd", (x.shape[0], D), acc_dtype, dt, dev)
            y32_CD = y_CD if acc_dtype == dt else torch.empty((C, D), dtype=acc_dtype, device=dev)
        else:
            out = torch.empty((R, D), dtype=dt, device=dev)
        for ch in _chunks(plan, dev):
            r0, r1 = ch.r0, ch.r1
            n = r1 - r0
            if scatter:
                xc = torch.index_select(x, 0, src_R[r0:r1], out=x_CD[:n])
            else:
                xc = x[r0:r1]
            h1c = h1_RF[r0:r1]
            _chunk_mm(xc, w1, h1c, ch)
            ac = a_CF[:n]
            if h3_RF is not None:
                h3c = h3_RF[r0:r1]
                _chunk_mm(xc, w3, h3c, ch)
                torch.ops.aten.silu.out(h1c, out=ac)
                ac.mul_(h3c)
            else:
                torch.ops.aten.gelu.out(h1c, out=ac)
            if scatter:
                yc = y_CD[:n]
                _chunk_mm(ac, w2, yc, ch)
                y32 = y32_CD[:n]
                if y32 is not yc:
                    y32.copy_(yc)  # widen to fp32 (two passes beat one mixed-dtype mul)
                y32.mul_(weight_R[r0:r1].to(y32.dtype).unsqueeze(1))
                out.index_add_(0, src_R[r0:r1], y32)
            else:
                _chunk_mm(ac, w2, out[r0:r1], ch)
        ctx.save_for_backward(x, weight_R, w1, w3, w2, src_R, h1_RF, h3_RF)
        ctx.plan = plan
        ctx.activation = activation
        return out.to(dt) if out.dtype != dt else out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight_R, w1, w3, w2, src_R, h1_RF, h3_RF = ctx.saved_tensors
        plan: ExpertPlan = ctx.plan
        scatter = src_R is not None
        need_x, need_wt, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:5]
        dt, dev = x.dtype, x.device
        R, D, Fh = plan.num_rows, x.shape[-1], w1.shape[-1]
        C = plan.max_chunk_rows
        grad_out = grad_out.to(dt).contiguous()

        def weight_grad_buffer(w, needed):
            if not needed or w is None:
                return None
            g = torch.empty_like(w)
            for e, n in enumerate(plan.counts):
                if n == 0:
                    g[e].zero_()  # an expert that got no rows gets an exact zero gradient
            return g

        gw1, gw3, gw2 = (weight_grad_buffer(w1, need_w1), weight_grad_buffer(w3, need_w3),
                         weight_grad_buffer(w2, need_w2))
        g_weight_R = torch.empty(R, dtype=torch.float32, device=dev) if need_wt and scatter else None
        acc_dtype = torch.float32 if dt != torch.float64 else dt
        if need_x:
            gx = (_accumulator("bwd", (x.shape[0], D), acc_dtype, dt, dev) if scatter
                  else torch.empty((R, D), dtype=dt, device=dev))
        else:
            gx = None
        s_CF = torch.empty((C, Fh), dtype=dt, device=dev)
        a_CF = torch.empty((C, Fh), dtype=dt, device=dev)
        ga_CF = torch.empty((C, Fh), dtype=dt, device=dev)
        gh1_CF = torch.empty((C, Fh), dtype=dt, device=dev)
        gh3_CF = torch.empty((C, Fh), dtype=dt, device=dev) if w3 is not None else None
        if scatter:
            x_CD = torch.empty((C, D), dtype=dt, device=dev)
            gy_CD = torch.empty((C, D), dtype=dt, device=dev)
            gx_CD = torch.empty((C, D), dtype=dt, device=dev)
            gx32_CD = gx_CD if acc_dtype == dt else torch.empty((C, D), dtype=acc_dtype, device=dev)

        for ch in _chunks(plan, dev):
            r0, r1 = ch.r0, ch.r1
            n = r1 - r0
            gyc = (torch.index_select(grad_out, 0, src_R[r0:r1], out=gy_CD[:n]) if scatter
                   else grad_out[r0:r1])
            h1c = h1_RF[r0:r1]
            # Recompute the activation from the saved pre-activations (cheap, [C, F]).
            ac = a_CF[:n]
            if w3 is not None:
                h3c = h3_RF[r0:r1]
                sc = torch.ops.aten.silu.out(h1c, out=s_CF[:n])
                torch.mul(sc, h3c, out=ac)
            else:
                torch.ops.aten.gelu.out(h1c, out=ac)
            # dL/da (unweighted in scatter mode) = gy @ W2^T
            gac = ga_CF[:n]
            _chunk_mm(gyc, w2, gac, ch, transpose_w=True)
            if scatter:
                wc = weight_R[r0:r1]
                if g_weight_R is not None:
                    torch.sum(gac * ac, dim=1, dtype=torch.float32, out=g_weight_R[r0:r1])
                wc_col = wc.to(dt).unsqueeze(1)
                gac.mul_(wc_col)
                if gw2 is not None:
                    ac.mul_(wc_col)  # w2's gradient sees the weighted activation
            if gw2 is not None:
                _weight_grad(ac, gyc, gw2, ch)
            # Back through the activation: gh1 (and gh3 for SwiGLU), in place in ga's buffer.
            if w3 is not None:
                gh3c = torch.mul(gac, sc, out=gh3_CF[:n])
                gac.mul_(h3c)
                gh1c = torch.ops.aten.silu_backward.grad_input(gac, h1c, grad_input=gh1_CF[:n])
            else:
                gh1c = torch.ops.aten.gelu_backward.grad_input(gac, h1c, grad_input=gh1_CF[:n])
                gh3c = None
            if gw1 is not None or gw3 is not None:
                xc = (torch.index_select(x, 0, src_R[r0:r1], out=x_CD[:n]) if scatter
                      else x[r0:r1])
                if gw1 is not None:
                    _weight_grad(xc, gh1c, gw1, ch)
                if gw3 is not None:
                    _weight_grad(xc, gh3c, gw3, ch)
            if gx is not None:
                gxc = gx_CD[:n] if scatter else gx[r0:r1]
                _chunk_mm(gh1c, w1, gxc, ch, transpose_w=True)
                if gh3c is not None:
                    _chunk_mm(gh3c, w3, gxc, ch, transpose_w=True, accumulate=True)
                if scatter:
                    g32 = gx32_CD[:n]
                    if g32 is not gxc:
                        g32.copy_(gxc)
                    gx.index_add_(0, src_R[r0:r1], g32)
        if gx is not None and gx.dtype != dt:
            gx = gx.to(dt)
        return gx, g_weight_R, gw1, gw3, gw2, None, None, None
