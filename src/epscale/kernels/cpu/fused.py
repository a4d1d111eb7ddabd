"""Chunked expert compute on CPU: gather -> GEMM -> activation -> GEMM -> combine, one
cache-sized chunk of experts at a time, with a hand-written backward.

Legend: T tokens, D model dim, F expert hidden dim, E experts (local), K top-k, R rows
(kept assignments, grouped by expert in ascending order), C rows of one chunk.

Why: on CPU the cost beside the GEMMs is memory traffic, page faults and per-op
overhead. Inputs are gathered one [C, D] chunk at a time into a buffer reused for every
chunk (and re-gathered in backward instead of saved); the [R, F] pre-activations are the
only per-row tensors kept for backward; large buffers come from a :class:`Workspace` that
keeps them mapped from step to step.

Two modes share one kernel:

* gathered mode (no expert parallelism): rows are gathered from ``x_TD`` by ``src_R``
  (the token of each row). The activation is multiplied by the row's gate weight
  ``weight_R`` before the second GEMM (w * (a W2) = (w * a) W2: a [C, F] pass instead of
  a [C, D] one), whose output goes straight into a [R + 1, D] rows buffer; the last row is
  zeros for dropped assignments. Then :func:`gather_combine` sums each token's K rows
  through ``pos_TK`` (the row of each assignment), in one ``embedding_bag`` pass: in
  fp32 with one rounding for bf16. ``weight_R`` gets its gradient here too:
  dL/dw_r = <dL/dy_t . W2_e^T, a_r>. The input gradient takes the same road back.
* row mode (after an EP dispatcher): input is ``x_RD`` itself, output is [R, D]. (The
  caller may run row mode over chunks of many small experts as gathered mode over the
  rows themselves, so that they can be padded and batched: see rows.py.)

The combine is a gather, not a scatter-add into an fp32 [T, D] accumulator: it reads each
row once, writes each token once, needs no zeroing and no fp32 [T, D] round trip, and a
gather parallelises over threads without atomics. It costs the [R + 1, D] rows buffer.

Matmuls run per expert with ``torch.mm(out=...)`` into views of the chunk buffers, as one
``bmm`` for a chunk of experts padded to equal rows, or with ``grouped_mm`` over a chunk
when asked for. The per-expert and per-chunk views are cut once per call
(``unbind``/``split``), not op by op in the loop: with 64-128 experts, Python and
dispatch overhead would otherwise be several percent of a step.

With two or more threads the chunks run side by side, one per thread, each with its own
scratch buffers (:mod:`.chunk_workers`); chunks write disjoint rows and disjoint weight
gradients, so the results are the same as one chunk at a time.

What each of these choices measured: benchmarks/RESULTS.md, MoE layer section.
"""


from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import native
from .chunk_workers import choose_workers, run_chunks
from .inductor import act_backward_eager, act_forward_eager, get_kernels, run_compiled
from .rows import gather_combine
from .workspace import Workspace, take_fresh

# Bytes of a chunk's widest per-row buffer ([C, D] or [C, F]) the planner aims for
# (``moe.cpu.chunk_bytes``): about one core's L2, so that a chunk is still cached between
# its GEMM and the element-wise passes around it. Small experts share a chunk.
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
    batched: tuple[bool, ...] = ()              # per chunk: every expert has the same rows
                                                # (padded), one bmm instead of a loop

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

    def batched_padding(self, max_waste: float) -> list[int] | None:
        """Rows per expert after padding every chunk of two or more experts to its
        largest expert, for chunks where that adds at most ``max_waste`` x their rows;
        None when no chunk qualifies. (See :func:`epscale.moe.rows.pad_expert_rows`.)"""
        padded, any_batched = list(self.counts), False
        for r0, r1, e0, e1 in self.chunks:
            m = max(self.counts[e0:e1])
            if e1 - e0 >= 2 and m * (e1 - e0) <= (1 + max_waste) * (r1 - r0):
                padded[e0:e1] = [m] * (e1 - e0)
                any_batched = True
        return padded if any_batched else None

    def with_counts(self, counts: list[int]) -> "ExpertPlan":
        """This plan's chunking (the same experts per chunk) over new row counts; a chunk
        is batched when all its experts have the same count and there are two or more."""
        starts, acc = [], 0
        for n in counts:
            starts.append(acc)
            acc += n
        chunks, batched = [], []
        for _, _, e0, e1 in self.chunks:
            chunks.append((starts[e0], starts[e1 - 1] + counts[e1 - 1], e0, e1))
            batched.append(e1 - e0 >= 2 and len(set(counts[e0:e1])) == 1 and counts[e0] > 0)
        return ExpertPlan(tuple(counts), tuple(starts), tuple(chunks), acc, self.grouped,
                          tuple(batched))


@dataclass(frozen=True)
class _Chunk:
    r0: int
    r1: int
    e0: int
    e1: int
    segs: tuple[tuple[int, int, int], ...]  # (expert, row offset in the chunk, rows), non-empty
    offs: torch.Tensor | None               # int32 [e1 - e0] cumulative rows (grouped GEMM)
    batched: bool = False                   # e1 - e0 experts of equal rows: one bmm


def _chunks(plan: ExpertPlan, device: torch.device) -> list[_Chunk]:
    offs_all = None
    if plan.grouped and plan.chunks:
        ends = [plan.starts[e] + plan.counts[e] - r0
                for r0, _, e0, e1 in plan.chunks for e in range(e0, e1)]
        offs_all = torch.tensor(ends, dtype=torch.int32, device=device)
    out, at = [], 0
    for i, (r0, r1, e0, e1) in enumerate(plan.chunks):
        segs = tuple((e, plan.starts[e] - r0, plan.counts[e]) for e in range(e0, e1)
                     if plan.counts[e])
        offs = offs_all[at:at + e1 - e0] if offs_all is not None else None
        at += e1 - e0
        out.append(_Chunk(r0, r1, e0, e1, segs, offs, bool(plan.batched and plan.batched[i])))
    return out


class _Weights:
    """One stacked expert weight [E, X, Y] (or its transpose) and its per-expert views,
    cut once per call."""

    def __init__(self, w_EXY: torch.Tensor, transpose: bool = False):
        self.stacked = w_EXY.transpose(1, 2) if transpose else w_EXY

    @functools.cached_property
    def per_expert(self) -> tuple[torch.Tensor, ...]:
        """Only the per-expert loop needs these (E view ops: 64 x 6 per step in a
        64-expert layer, which grouped and batched chunks do without)."""
        return self.stacked.unbind(0)


def _segments(t_CX: torch.Tensor, ch: _Chunk) -> list[torch.Tensor]:
    """Views of a chunk buffer, one per non-empty expert of the chunk (one split call)."""
    if len(ch.segs) == 1:
        return [t_CX]
    return list(t_CX.split([n for _, _, n in ch.segs]))


def _chunk_mm(a_CX: torch.Tensor, w: _Weights, out_CY: torch.Tensor, ch: _Chunk,
              accumulate: bool = False) -> None:
    """out[rows of e] (+)= a[rows of e] @ w[e] for every expert of a chunk."""
    if ch.batched:
        n = ch.e1 - ch.e0
        a, out = a_CX.view(n, -1, a_CX.shape[-1]), out_CY.view(n, -1, out_CY.shape[-1])
        w_e = w.stacked[ch.e0:ch.e1]
        out.baddbmm_(a, w_e) if accumulate else torch.bmm(a, w_e, out=out)
        return
    if ch.offs is not None:
        res = F.grouped_mm(a_CX, w.stacked[ch.e0:ch.e1], offs=ch.offs)
        out_CY.add_(res) if accumulate else out_CY.copy_(res)
        return
    experts = [e for e, _, _ in ch.segs]
    for a, out, e in zip(_segments(a_CX, ch), _segments(out_CY, ch), experts):
        if accumulate:
            out.addmm_(a, w.per_expert[e])
        else:
            torch.mm(a, w.per_expert[e], out=out)


def _weight_grad(a_CX: torch.Tensor, g_CY: torch.Tensor, grad: _Weights, ch: _Chunk) -> None:
    """grad[e] = a[rows of e]^T @ g[rows of e]; each expert appears in exactly one chunk."""
    if ch.batched:
        n = ch.e1 - ch.e0
        torch.bmm(a_CX.view(n, -1, a_CX.shape[-1]).transpose(1, 2),
                  g_CY.view(n, -1, g_CY.shape[-1]), out=grad.stacked[ch.e0:ch.e1])
        return
    if ch.offs is not None:
        grad.stacked[ch.e0:ch.e1].copy_(F.grouped_mm(a_CX.t(), g_CY, offs=ch.offs))
        return
    for a, g, (e, _, _) in zip(_segments(a_CX, ch), _segments(g_CY, ch), ch.segs):
        torch.mm(a.t(), g, out=grad.per_expert[e])


def _elementwise(mode: str, x: torch.Tensor):
    """(native, inductor) kernels for the element-wise work of one call, at most one of
    them not None; both None: eager ops. ``mode`` is ``moe.cpu.elementwise``: 'auto' and
    'native' take the native C kernels for CPU tensors in fp32 or bf16, 'inductor' the
    torch.compile ones, 'off' neither."""
    if mode in ("auto", "native") and native.NativeKernels.supports(x):
        return native.get(mode), None
    return None, get_kernels(mode == "inductor")


def _workers(device: torch.device, sizes: list[int], kern, max_workers: int | None) -> int:
    """Workers for the chunk loop; the torch.compile kernels (``kern``) stay in the
    calling thread, where they were compiled and are guarded."""
    return 1 if kern is not None else choose_workers(device, sizes, max_workers)


class _Scratch:
    """Per-worker [C, X] chunk buffers, allocated on a worker's first use of each name."""

    def __init__(self, workers: int, rows: int, dtype: torch.dtype, device: torch.device):
        self._bufs: list[dict[str, torch.Tensor]] = [{} for _ in range(workers)]
        self._rows, self._dtype, self._device = rows, dtype, device

    def get(self, worker: int, name: str, width: int) -> torch.Tensor:
        bufs = self._bufs[worker]
        if name not in bufs:
            bufs[name] = torch.empty((self._rows, width), dtype=self._dtype, device=self._device)
        return bufs[name]


class FusedExperts(torch.autograd.Function):
    """See the module docstring. Arguments of ``forward``:

    x: [T, D] (gathered mode) or [R, D] (row mode), fp32 or bf16.
    weight_R: fp32 [R] gate weights (gathered mode) or None.
    w1, w3, w2: [E, D, F], [E, D, F] or None (GELU), [E, F, D] in x's dtype.
    src_R: int64 [R] token of each row (gathered mode) or None.
    pos_TK: int64 [T, K] row of each assignment, R where dropped (gathered mode) or None.
    plan: :class:`ExpertPlan`. activation: 'swiglu' or 'gelu'.
    ws: a :class:`Workspace` to take the rows buffer, the saved pre-activations and the
    weight gradients from, or None (fresh buffers). kernels: ``moe.cpu.elementwise``, how
    the element-wise work runs (see :func:`_elementwise`). max_workers: at most this many
    single-threaded workers run the chunks side by side (see :mod:`chunk_workers`); None:
    as many as torch's intra-op threads where the layout gains from them.
    Returns [T, D] (gathered mode) or [R, D] (row mode) in x's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight_R, w1, w3, w2, src_R, pos_TK, plan: ExpertPlan, activation: str,
                ws: Workspace | None = None, kernels: str = "auto", max_workers: int | None = None):
        gathered = src_R is not None
        R, D, Fh = plan.num_rows, x.shape[-1], w1.shape[-1]
        dt, dev = x.dtype, x.device
        C = plan.max_chunk_rows
        take = ws.take if ws is not None else take_fresh
        chunks = _chunks(plan, dev)
        sizes = [ch.r1 - ch.r0 for ch in chunks]
        W1, W2 = _Weights(w1), _Weights(w2)
        W3 = _Weights(w3) if w3 is not None else None
        h1_RF = take("h1", (R, Fh), dt, dev)
        h3_RF = take("h3", (R, Fh), dt, dev) if W3 is not None else None
        h1s = h1_RF.split(sizes)
        h3s = h3_RF.split(sizes) if h3_RF is not None else None
        native, kern = _elementwise(kernels, x)
        if gathered:
            # Rows of weighted expert outputs, plus one zero row for dropped assignments.
            rows_RD = take("rows_RD", (R + 1, D), dt, dev)
            rows_RD[R].zero_()
            srcs, wts = src_R.split(sizes), weight_R.split(sizes)
        else:
            # The caller's combine consumes it before backward needs [R, D] for gx (same buffer).
            rows_RD = take("rows_RD", (R, D), dt, dev)
            xs = x.split(sizes)
        outs = rows_RD[:R].split(sizes)
        workers = _workers(dev, sizes, kern, max_workers)
        scratch = _Scratch(workers, C, dt, dev)

        def forward_chunk(i: int, w: int) -> None:
            n = sizes[i]
            ch = chunks[i]
            xc = (torch.index_select(x, 0, srcs[i], out=scratch.get(w, "x", D)[:n]) if gathered
                  else xs[i])
            _chunk_mm(xc, W1, h1s[i], ch)
            if W3 is not None:
                _chunk_mm(xc, W3, h3s[i], ch)
            if native is not None:  # one pass: activation times gate weight
                ac = native.forward(h1s[i], h3s[i] if W3 is not None else None,
                                    wts[i] if gathered else None, scratch.get(w, "a", Fh)[:n])
            elif kern is not None:  # one generated pass: activation times gate weight
                ac = run_compiled(kern[1], act_forward_eager, h1s[i],
                                  h3s[i] if W3 is not None else None, wts[i] if gathered else None)
            else:
                ac = scratch.get(w, "a", Fh)[:n]
                if W3 is not None:
                    torch.ops.aten.silu.out(h1s[i], out=ac)
                    ac.mul_(h3s[i])
                else:
                    torch.ops.aten.gelu.out(h1s[i], out=ac)
                if gathered:
                    ac.mul_(wts[i].unsqueeze(1))
            _chunk_mm(ac, W2, outs[i], ch)

        run_chunks(forward_chunk, sizes, workers)
        out = rows_RD
        if gathered:
            out = gather_combine(rows_RD, pos_TK)
        ctx.save_for_backward(x, weight_R, w1, w3, w2, src_R, pos_TK, h1_RF, h3_RF)
        ctx.plan = plan
        ctx.chunks = chunks
        ctx.ws = ws
        ctx.kernels = kernels
        ctx.workers = workers
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight_R, w1, w3, w2, src_R, pos_TK, h1_RF, h3_RF = ctx.saved_tensors
        plan: ExpertPlan = ctx.plan
        gathered = src_R is not None
        need_x, need_wt, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:5]
        dt, dev = x.dtype, x.device
        R, D, Fh = plan.num_rows, x.shape[-1], w1.shape[-1]
        C = plan.max_chunk_rows
        grad_out = grad_out.to(dt).contiguous()
        ws: Workspace | None = ctx.ws
        take = ws.take if ws is not None else take_fresh
        native, kern = _elementwise(ctx.kernels, x)
        chunks = ctx.chunks  # cut once in forward (segments, grouped-GEMM offsets)
        sizes = [ch.r1 - ch.r0 for ch in chunks]

        def weight_grad_buffer(name, w, needed):
            if not needed or w is None:
                return None
            g = take(name, w.shape, w.dtype, dev) if w.is_contiguous() else torch.empty_like(w)
            for e, n in enumerate(plan.counts):
                if n == 0:
                    g[e].zero_()  # an expert that got no rows gets an exact zero gradient
            return g

        gw1, gw3, gw2 = (weight_grad_buffer("gw1", w1, need_w1),
                         weight_grad_buffer("gw3", w3, need_w3),
                         weight_grad_buffer("gw2", w2, need_w2))
        GW1, GW3, GW2 = (_Weights(g) if g is not None else None for g in (gw1, gw3, gw2))
        W1T, W2T = _Weights(w1, transpose=True), _Weights(w2, transpose=True)
        W3T = _Weights(w3, transpose=True) if w3 is not None else None
        g_weight_R = torch.empty(R, dtype=torch.float32, device=dev) if need_wt and gathered else None
        gx_rows = None
        if need_x:
            # Gathered mode: per-row input gradients, then the same gather-combine as the
            # forward (the zero row again for dropped assignments). Row mode: the result.
            gx_rows = take("rows_RD", (R + 1 if gathered else R, D), dt, dev)
            if gathered:
                gx_rows[R].zero_()
        h1s = h1_RF.split(sizes)
        h3s = h3_RF.split(sizes) if h3_RF is not None else None
        gxs = gx_rows[:R].split(sizes) if gx_rows is not None else None
        gwts = g_weight_R.split(sizes) if g_weight_R is not None else None
        if gathered:
            srcs, wts = src_R.split(sizes), weight_R.split(sizes)
        else:
            xs, gys = x.split(sizes), grad_out.split(sizes)
        scratch = _Scratch(ctx.workers, C, dt, dev)

        def backward_chunk(i: int, w: int) -> None:
            n = sizes[i]
            ch = chunks[i]
            gyc = (torch.index_select(grad_out, 0, srcs[i], out=scratch.get(w, "gy", D)[:n])
                   if gathered else gys[i])
            h1c = h1s[i]
            h3c = h3s[i] if h3s is not None else None
            # dL/da (unweighted in gathered mode) = gy @ W2^T
            gac = scratch.get(w, "ga", Fh)[:n]
            _chunk_mm(gyc, W2T, gac, ch)
            if native is not None:  # one pass for everything element-wise
                ac, gh1c = scratch.get(w, "a", Fh)[:n], scratch.get(w, "gh1", Fh)[:n]
                gh3c = scratch.get(w, "gh3", Fh)[:n] if w3 is not None else None
                native.backward(gac, h1c, h3c, wts[i] if gathered else None,
                                gwts[i] if gwts is not None else None, ac, gh1c, gh3c)
            elif kern is not None:  # one generated pass for everything element-wise
                gwc, ac, gh1c, gh3c = run_compiled(kern[0], act_backward_eager, gac, h1c, h3c,
                                                   wts[i] if gathered else None)
                if gwts is not None:
                    gwts[i].copy_(gwc)
            else:
                # Recompute the activation from the saved pre-activations (cheap, [C, F]).
                ac = scratch.get(w, "a", Fh)[:n]
                if w3 is not None:
                    sc = torch.ops.aten.silu.out(h1c, out=scratch.get(w, "s", Fh)[:n])
                    torch.mul(sc, h3c, out=ac)
                else:
                    torch.ops.aten.gelu.out(h1c, out=ac)
                if gathered:
                    if gwts is not None:
                        torch.sum(gac * ac, dim=1, dtype=torch.float32, out=gwts[i])
                    wc_col = wts[i].to(dt).unsqueeze(1)
                    gac.mul_(wc_col)
                    if GW2 is not None:
                        ac.mul_(wc_col)  # w2's gradient sees the weighted activation
                # Back through the activation: gh1 (and gh3 for SwiGLU), in place in ga's buffer.
                gh1_out = scratch.get(w, "gh1", Fh)[:n]
                if w3 is not None:
                    gh3c = torch.mul(gac, sc, out=scratch.get(w, "gh3", Fh)[:n])
                    gac.mul_(h3c)
                    gh1c = torch.ops.aten.silu_backward.grad_input(gac, h1c, grad_input=gh1_out)
                else:
                    gh1c = torch.ops.aten.gelu_backward.grad_input(gac, h1c, grad_input=gh1_out)
                    gh3c = None
            if GW2 is not None:
                _weight_grad(ac, gyc, GW2, ch)
            if GW1 is not None or GW3 is not None:
                xc = (torch.index_select(x, 0, srcs[i], out=scratch.get(w, "x", D)[:n])
                      if gathered else xs[i])
                if GW1 is not None:
                    _weight_grad(xc, gh1c, GW1, ch)
                if GW3 is not None:
                    _weight_grad(xc, gh3c, GW3, ch)
            if gxs is not None:
                _chunk_mm(gh1c, W1T, gxs[i], ch)
                if gh3c is not None:
                    _chunk_mm(gh3c, W3T, gxs[i], ch, accumulate=True)

        run_chunks(backward_chunk, sizes, ctx.workers)
        gx = gx_rows
        if gx is not None and gathered:
            gx = gather_combine(gx_rows, pos_TK)
        return gx, g_weight_R, gw1, gw3, gw2, None, None, None, None, None, None, None
