"""Optional generated element-wise kernels of the fused expert kernel, forward and backward
(``moe.cpu.elementwise='inductor'``), built with torch.compile on first use, with an eager
fallback (one warning) when there is no C++ compiler or compilation fails.

Legend: C rows of one chunk, F expert hidden dim.
"""

from __future__ import annotations

import shutil
import threading
import warnings

import torch
import torch.nn.functional as F

# Optional generated kernels (moe.cpu.elementwise='inductor'): torch.compile (inductor, C++ on
# CPU) fuses the element-wise work of one chunk into a single pass. Forward: the
# activation times the gate weight (one pass instead of three). Backward: recompute
# SwiGLU/GELU, the gate-weight gradient, the weighted activation for dW2, dL/dh1 (and
# dL/dh3); one pass instead of ~9 eager ones, one exp per element instead of two.
# Compiled with dynamic shapes, so a new number of rows per chunk does not recompile.
# Internally fp32 (bf16 inputs are widened once, results rounded once).


def act_forward_eager(h1_CF, h3_CF, w_C):
    """The activation [C, F] (times the gate weight when ``w_C`` is given) from the
    pre-activations; fp32 inside, one rounding."""
    h1 = h1_CF.float()
    a = h1 * torch.sigmoid(h1) * h3_CF.float() if h3_CF is not None else F.gelu(h1)
    if w_C is not None:
        a = a * w_C.float().unsqueeze(1)
    return a.to(h1_CF.dtype)


def act_backward_eager(ga_CF, h1_CF, h3_CF, w_C):
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


class Compiled:
    """The compiled kernels, built on first use; eager (with one warning) when there is no
    C++ compiler or compilation fails."""

    def __init__(self):
        self._lock = threading.Lock()
        self.fns: dict[int, tuple] = {}   # threads -> (act_backward, act_forward)
        self.failed: str | None = None

    def get(self):
        """The kernels for torch's current thread count, built on first use."""
        threads = torch.get_num_threads()
        if threads not in self.fns and self.failed is None:
            with self._lock:
                if threads not in self.fns and self.failed is None:
                    self._build(threads)
        return self.fns.get(threads)

    def _build(self, threads: int) -> None:
        why = no_compiler_reason()
        if why is not None:
            self.fail(why)
            return
        # The generated code runs on as many threads as torch's own ops at the time of
        # the call (one build per thread count): more would oversubscribe the cores,
        # fewer leaves cores idle beside eager ops that use them all.
        opts = {"cpp.threads": threads}
        self.fns[threads] = (torch.compile(act_backward_eager, dynamic=True, options=opts),
                             torch.compile(act_forward_eager, dynamic=True, options=opts))

    def fail(self, why: str) -> None:
        self.failed, self.fns = why, {}
        warnings.warn(f"moe.cpu.elementwise='inductor': running the eager element-wise kernels "
                      f"instead ({why})", RuntimeWarning, stacklevel=3)


def no_compiler_reason() -> str | None:
    try:
        import torch._inductor.config as ic
        cxx = ic.cpp.cxx[-1] if isinstance(ic.cpp.cxx, tuple) else ic.cpp.cxx
    except Exception as e:  # noqa: BLE001 - an inductor that does not import
        return f"torch._inductor unavailable: {type(e).__name__}: {e}"
    if not cxx or shutil.which(cxx) is None:
        return f"no C++ compiler found (looked for {cxx!r}; set CXX or install g++)"
    return None


COMPILED = Compiled()


def get_kernels(compiled: bool):
    """(act_backward, act_forward) to use: compiled when asked for and available, else
    None (the eager kernel's own multi-pass code in FusedExperts)."""
    return COMPILED.get() if compiled else None


def run_compiled(fn, eager, *args):
    """Run a compiled kernel; if it cannot compile, warn once and stay eager from then on
    (also for the remaining chunks of the call in progress)."""
    if COMPILED.failed is not None:
        return eager(*args)
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - backend/compiler errors of any kind
        if COMPILED.failed is None:
            first = (str(e).splitlines() or [""])[0]
            COMPILED.fail(f"compilation failed: {type(e).__name__}: {first}")
        return eager(*args)
