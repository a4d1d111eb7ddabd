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

import shutil
import threading
import warnings
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


# ------------------------------------------------------------------ compiled element-wise

# Optional generated kernels (moe.compile_kernels='on'): torch.compile (inductor, C++ on
# CPU) fuses the element-wise work around the GEMMs of one chunk into single passes:
#   backward: recompute SwiGLU/GELU, the gate-weight gradient, the weighted activation
#             for dW2, dL/dh1 (and dL/dh3): one pass instead of ~9 eager ones, one exp
#             per element instead of two;
#   combine:  widen to fp32, weight and scatter-add into the [T, D] accumulator in one
#             pass (eager: copy, multiply, index_add_).
# Compiled with dynamic shapes, so a new number of rows per chunk does not recompile.
# Internally fp32 (bf16 inputs are widened once, results rounded once). Generated
# single-threaded (see _build), so the scatter-add is sequential and deterministic.


def _act_backward_eager(ga_CF, h1_CF, h3_CF, w_C):
    """(dL/dw [C] fp32 or None, activation (weighted when w is given) [C, F],
    dL/dh1 [C, F], dL/dh3 [C, F] or None) from dL/da (unweighted) and the
    pre-activations. Written for the compiler: fp32 inside, one rounding at the end."""
    dt = h1_CF.dtype
    g, h1 = ga_CF.float(), h1_CF.float()
    if h3_CF is not None:
        h3 = h3_CF.float()
        sig = torch.sigmoid(h1)
        silu = h1 * sig
        a = silu * h3
    else:
        a = F.gelu(h1)
    gw = None
    if w_C is not None:
        gw = (g * a).sum(1)
        w = w_C.float().unsqueeze(1)
        g = g * w
        a = a * w
    if h3_CF is not None:
        gh3 = (g * silu).to(dt)
        gh1 = (g * h3 * sig * (1 + h1 * (1 - sig))).to(dt)
    else:
        gh3 = None
        gh1 = torch.ops.aten.gelu_backward(g, h1).to(dt)
    return gw, a.to(dt), gh1, gh3


def _combine_eager(acc_TD, idx_C, y_CD, w_C):
    """acc[idx[c]] += w[c] * y[c] (w None: weight 1), y widened to acc's dtype."""
    y = y_CD.to(acc_TD.dtype)
    if w_C is not None:
        y = y * w_C.to(acc_TD.dtype).unsqueeze(1)
    acc_TD.index_add_(0, idx_C, y)


class _Compiled:
    """The compiled kernels, built on first use; eager (with one warning) when there is no
    C++ compiler or compilation fails."""

    def __init__(self):
        self._lock = threading.Lock()
        self.fns = None          # (act_backward, combine) once ready
        self.failed: str | None = None

    def get(self):
        if self.fns is None and self.failed is None:
            with self._lock:
                if self.fns is None and self.failed is None:
                    self._build()
        return self.fns

    def _build(self) -> None:
        why = _no_compiler_reason()
        if why is not None:
            self.fail(why)
            return
        # Single-threaded generated code: a chunk's element-wise pass is ~0.1 ms, too
        # short for an OpenMP fork/join, and the generated scatter-add then needs no
        # atomics (deterministic). Parallel code measured up to 1.5x slower per step.
        opts = {"cpp.threads": 1}
        self.fns = (torch.compile(_act_backward_eager, dynamic=True, options=opts),
                    torch.compile(_combine_eager, dynamic=True, options=opts))

    def fail(self, why: str) -> None:
        self.failed, self.fns = why, None
        warnings.warn(f"moe.compile_kernels='on': running the eager element-wise kernels "
                      f"instead ({why})", RuntimeWarning, stacklevel=3)


def _no_compiler_reason() -> str | None:
    try:
        import torch._inductor.config as ic
        cxx = ic.cpp.cxx[-1] if isinstance(ic.cpp.cxx, tuple) else ic.cpp.cxx
    except Exception as e:  # noqa: BLE001 - an inductor that does not import
        return f"torch._inductor unavailable: {type(e).__name__}: {e}"
    if not cxx or shutil.which(cxx) is None:
        return f"no C++ compiler found (looked for {cxx!r}; set CXX or install g++)"
    return None


_COMPILED = _Compiled()


def _kernels(compiled: bool):
    """(act_backward, combine) to use: compiled when asked for and available, else eager
    (None: the eager kernel's own multi-pass code in FusedExperts)."""
    return _COMPILED.get() if compiled else None


def _call(fn, eager, *args):
    """Run a compiled kernel; if it cannot compile, warn once and stay eager from then on
    (also for the remaining chunks of the call in progress)."""
    if _COMPILED.failed is not None:
        return eager(*args)
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - backend/compiler errors of any kind
        if _COMPILED.failed is None:
            first = (str(e).splitlines() or [""])[0]
            _COMPILED.fail(f"compilation failed: {type(e).__name__}: {first}")
        return eager(*args)


_WORKSPACE = threading.local()

_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Workspace:
    """Large buffers one :class:`GroupedExperts` keeps from step to step: the weight
    gradients, the saved [R, F] pre-activations and, in row mode, one [R, D] buffer for
    the output (consumed by the caller's combine) and later the input gradient.

    Why: on CPU a fresh buffer of tens of MB is mmap'ed and page-faulted in on every
    step (glibc serves allocations above 32 MB with mmap and unmaps them on free); on the
    fine-grained benchmark shape that kernel time was ~9% of the step. A buffer is handed
    out again only when nothing but this workspace still references its storage (the
    storage's use count), i.e. after ``zero_grad(set_to_none=True)`` dropped the previous
    gradient and the previous backward released its saved tensors. Otherwise (gradient
    accumulation, ``retain_graph``, a caller holding on to a gradient) a fresh buffer is
    allocated, exactly as without a workspace. Memory: the cached buffers stay allocated
    between steps (like gradients kept by ``zero_grad(set_to_none=False)``).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._store: dict[str, torch.UntypedStorage] = {}

    @staticmethod
    def _free(s: torch.UntypedStorage) -> bool:
        return _use_count is not None and _use_count(s._cdata) == 1  # only our reference

    def take(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of ``shape``, reusing the cached storage when it is free."""
        shape = torch.Size(shape)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            s = self._store.get(name)
            free = s is not None and self._free(s)
            if free and s.device == device and s.nbytes() >= nbytes:
                return torch.empty(0, dtype=dtype, device=device).set_(s, 0, shape)
            t = torch.empty(shape, dtype=dtype, device=device)
            if _use_count is not None and (s is None or free):
                self._store[name] = t.untyped_storage()
            return t

    def clear(self) -> None:
        with self._lock:
            self._store.clear()

    # Copies and pickles of a module start with an empty workspace (it is a cache).
    def __deepcopy__(self, memo):
        return Workspace()

    def __reduce__(self):
        return (Workspace, ())

    def __repr__(self) -> str:
        mb = sum(s.nbytes() for s in self._store.values()) / 2 ** 20
        return f"Workspace({len(self._store)} buffers, {mb:.0f} MB)"


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


def _take_fresh(name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


class FusedExperts(torch.autograd.Function):
    """See the module docstring. Arguments of ``forward``:

    x: [T, D] (scatter mode) or [R, D] (row mode), fp32 or bf16.
    weight_R: fp32 [R] gate weights (scatter mode) or None.
    w1, w3, w2: [E, D, F], [E, D, F] or None (GELU), [E, F, D] in x's dtype.
    src_R: int64 [R] token of each row (scatter mode) or None.
    plan: :class:`ExpertPlan`. activation: 'swiglu' or 'gelu'.
    ws: a :class:`Workspace` to take the saved pre-activations and weight gradients
    from, or None (fresh buffers). compiled: use the generated element-wise kernels
    (see ``_Compiled``) where they can be built.
    Returns [T, D] (scatter mode) or [R, D] (row mode) in x's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight_R, w1, w3, w2, src_R, plan: ExpertPlan, activation: str,
                ws: Workspace | None = None, compiled: bool = False):
        scatter = src_R is not None
        R, D, Fh = plan.num_rows, x.shape[-1], w1.shape[-1]
        dt, dev = x.dtype, x.device
        C = plan.max_chunk_rows
        take = ws.take if ws is not None else _take_fresh
        kern = _kernels(compiled)
        h1_RF = take("h1", (R, Fh), dt, dev)
        h3_RF = take("h3", (R, Fh), dt, dev) if w3 is not None else None
        a_CF = torch.empty((C, Fh), dtype=dt, device=dev)
        if scatter:
            x_CD = torch.empty((C, D), dtype=dt, device=dev)
            y_CD = torch.empty((C, D), dtype=dt, device=dev)
            acc_dtype = torch.float32 if dt != torch.float64 else dt
            out = _accumulator("fwd", (x.shape[0], D), acc_dtype, dt, dev)
            y32_CD = y_CD if acc_dtype == dt else torch.empty((C, D), dtype=acc_dtype, device=dev)
        else:
            # The caller's combine consumes it before backward needs [R, D] for gx (same buffer).
            out = take("rows_RD", (R, D), dt, dev)
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
                if kern is not None:
                    _call(kern[1], _combine_eager, out, src_R[r0:r1], yc, weight_R[r0:r1])
                else:
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
        ctx.ws = ws
        ctx.compiled = compiled
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

        ws: Workspace | None = ctx.ws
        kern = _kernels(ctx.compiled)

        def weight_grad_buffer(name, w, needed):
            if not needed or w is None:
                return None
            g = (ws.take(name, w.shape, w.dtype, w.device) if ws is not None and w.is_contiguous()
                 else torch.empty_like(w))
            for e, n in enumerate(plan.counts):
                if n == 0:
                    g[e].zero_()  # an expert that got no rows gets an exact zero gradient
            return g

        gw1, gw3, gw2 = (weight_grad_buffer("gw1", w1, need_w1),
                         weight_grad_buffer("gw3", w3, need_w3),
                         weight_grad_buffer("gw2", w2, need_w2))
        g_weight_R = torch.empty(R, dtype=torch.float32, device=dev) if need_wt and scatter else None
        acc_dtype = torch.float32 if dt != torch.float64 else dt
        if need_x:
            gx = (_accumulator("bwd", (x.shape[0], D), acc_dtype, dt, dev) if scatter
                  else (ws.take("rows_RD", (R, D), dt, dev) if ws is not None
                        else torch.empty((R, D), dtype=dt, device=dev)))
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
            h3c = h3_RF[r0:r1] if w3 is not None else None
            # dL/da (unweighted in scatter mode) = gy @ W2^T
            gac = ga_CF[:n]
            _chunk_mm(gyc, w2, gac, ch, transpose_w=True)
            if kern is not None:  # one generated pass for everything element-wise
                gwc, ac, gh1c, gh3c = _call(kern[0], _act_backward_eager, gac, h1c, h3c,
                                            weight_R[r0:r1] if scatter else None)
                if g_weight_R is not None:
                    g_weight_R[r0:r1].copy_(gwc)
                if gw2 is not None:
                    _weight_grad(ac, gyc, gw2, ch)
            else:
                # Recompute the activation from the saved pre-activations (cheap, [C, F]).
                ac = a_CF[:n]
                if w3 is not None:
                    sc = torch.ops.aten.silu.out(h1c, out=s_CF[:n])
                    torch.mul(sc, h3c, out=ac)
                else:
                    torch.ops.aten.gelu.out(h1c, out=ac)
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
                if scatter and kern is not None:
                    _call(kern[1], _combine_eager, gx, src_R[r0:r1], gxc, None)
                elif scatter:
                    g32 = gx32_CD[:n]
                    if g32 is not gxc:
                        g32.copy_(gxc)
                    gx.index_add_(0, src_R[r0:r1], g32)
        if gx is not None and gx.dtype != dt:
            gx = gx.to(dt)
        return gx, g_weight_R, gw1, gw3, gw2, None, None, None, None, None
