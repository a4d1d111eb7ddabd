"""The native element-wise kernels (moe.cpu.elementwise='auto'/'native'): against an fp64
truth and against the eager ops they replace, forward and backward, SwiGLU and GELU, bf16
and fp32; non-finite values; thread-count independence; the build cache; and the eager
fallback (with a clear message) when they cannot be built.

The layer-level tests against the reference (test_moe_layer.py) run with 'auto', which
takes these kernels, and with 'off', which takes the eager ops.
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import pytest
import torch

from epscale import MoEConfig
from epscale.kernels.cpu import native as native_kernels
from epscale.kernels.cpu.inductor import act_backward_eager, act_forward_eager
from test_moe_layer import VARIANTS, compare, compare_warns_once, make_moe

needs_compiler = pytest.mark.skipif(native_kernels.find_compiler() is None,
                                    reason="no C compiler")

ACTS = ["swiglu", "gelu"]
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture
def fresh_builder(monkeypatch, tmp_path):
    """A builder of its own with an empty cache, so that builds and failures here do not
    leak into other tests."""
    monkeypatch.setenv("EPSCALE_KERNEL_CACHE", str(tmp_path / "cache"))
    builder = native_kernels._Builder()
    monkeypatch.setattr(native_kernels, "BUILDER", builder)
    monkeypatch.setattr(native_kernels, "_warned", set())
    return builder


@pytest.fixture(scope="module", params=["default", "generic"])
def kernels(request, tmp_path_factory):
    """Each test runs on the default build (AVX-512 BF16 loops for bf16 where the CPU has
    them) and on the generic loops."""
    if request.param == "generic":
        k = native_kernels.build_generic(tmp_path_factory.mktemp("generic"))
        assert not k.vector_bf16
        return k
    k = native_kernels.get("native")
    assert k is not None, native_kernels.BUILDER.failed
    return k


def inputs(act, dtype, rows=67, cols=130, seed=0):
    g = torch.Generator().manual_seed(seed)
    h1 = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    h3 = torch.randn(rows, cols, generator=g).to(dtype) if act == "swiglu" else None
    ga = torch.randn(rows, cols, generator=g).to(dtype)
    w = torch.rand(rows, generator=g)
    return ga, h1, h3, w


def truth(ga, h1, h3, w):
    """fp64 (gw, weighted activation, dL/dh1, dL/dh3) of the rounded inputs."""
    x, g, wc = h1.double(), ga.double(), w.double()[:, None]
    if h3 is not None:
        s = torch.sigmoid(x)
        silu, v3 = x * s, h3.double()
        act, gh1, gh3 = silu * v3, g * wc * v3 * s * (1 + x * (1 - s)), g * wc * silu
    else:
        cdf = 0.5 * torch.special.erfc(-x / math.sqrt(2))
        act = x * cdf
        gh1, gh3 = g * wc * (cdf + x * torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)), None
    return (g * act).sum(1), act * wc, gh1, gh3


def run_native(k, ga, h1, h3, w):
    a = torch.empty_like(h1)
    k.forward(h1, h3, w, a)
    gw, aw, gh1 = torch.empty(h1.shape[0]), torch.empty_like(h1), torch.empty_like(h1)
    gh3 = torch.empty_like(h1) if h3 is not None else None
    k.backward(ga, h1, h3, w, gw, aw, gh1, gh3)
    return a, gw, aw, gh1, gh3


def max_rel_err(got, want):
    """Largest relative error over the elements that are not tiny against the largest
    (there the error of either side is a cancellation in the formula, not the kernel)."""
    big = want.abs() > 1e-3 * want.abs().max()
    return ((got.double() - want).abs() / want.abs())[big].max().item()


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_against_fp64_and_eager(kernels, act, dtype):
    ga, h1, h3, w = inputs(act, dtype)
    a, gw, aw, gh1, gh3 = run_native(kernels, ga, h1, h3, w)
    tgw, ta, tgh1, tgh3 = truth(ga, h1, h3, w)
    egw, ea, egh1, egh3 = act_backward_eager(ga, h1, h3, w)
    # bf16: rounded once from fp32, so within one bf16 ulp (2^-8 relative at worst) of the
    # truth. fp32: a few hundred fp32 ulps at worst (GELU's derivative; eager is worse).
    bound = 2 ** -8 if dtype == torch.bfloat16 else 5e-5
    pairs = [("a", a, ta, act_forward_eager(h1, h3, w)), ("aw", aw, ta, ea),
             ("gh1", gh1, tgh1, egh1)] + ([("gh3", gh3, tgh3, egh3)] if h3 is not None else [])
    for name, got, want, eager in pairs:
        assert got.dtype == dtype and got.shape == h1.shape
        err, eager_err = max_rel_err(got, want), max_rel_err(eager, want)
        assert err <= bound, f"{act} {dtype} {name}: {err:.3g} relative error"
        assert err <= max(eager_err * 1.5, bound / 4), f"{name}: worse than eager ({eager_err:.3g})"
    torch.testing.assert_close(gw.double(), tgw, rtol=1e-5, atol=1e-5 * tgw.abs().max().item())
    torch.testing.assert_close(gw, egw, rtol=1e-4, atol=1e-4 * egw.abs().max().item())


@needs_compiler
def test_bf16_swiglu_forward_is_eager_fp32_formula_rounded_once(kernels):
    """The same fp32 formula, rounded once: bitwise equal but for the rare element where
    the fp32 values straddle a bf16 rounding boundary (then one ulp apart)."""
    _, h1, h3, w = inputs("swiglu", torch.bfloat16, rows=256, cols=512)
    a = kernels.forward(h1, h3, w, torch.empty_like(h1))
    want = act_forward_eager(h1, h3, w)
    differ = a != want
    assert differ.float().mean() < 1e-3
    ulp = want.float().abs() * 2 ** -7
    assert ((a.float() - want.float()).abs()[differ] <= ulp[differ]).all()


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_non_finite_and_extreme_values(kernels, act, dtype):
    vals = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 88.8, -88.8, 100.0,
            -100.0, 30.0, -30.0, 5.0, -5.0]
    h1 = torch.tensor([vals], dtype=dtype)
    h3 = torch.ones_like(h1) if act == "swiglu" else None
    a = kernels.forward(h1, h3, None, torch.empty_like(h1))
    want = act_forward_eager(h1, h3, None)
    fin = torch.isfinite(want)
    # Every input the eager ops map to a finite value maps to nearly the same one (eager
    # GELU loses its far tail to cancellation, hence the absolute slack), NaN stays NaN.
    torch.testing.assert_close(a[fin].float(), want[fin].float(), rtol=2 ** -7, atol=2e-6)
    assert torch.isnan(a[0, 0]) and a[0, 1] == math.inf
    assert not torch.isfinite(a[0, 2])  # -inf * 0: NaN, as eager gives
    g = torch.ones_like(h1)
    gh1 = torch.empty_like(h1)
    kernels.backward(g, h1, h3, None, None, torch.empty_like(h1), gh1,
                     torch.empty_like(h1) if h3 is not None else None)
    _, _, egh1, _ = act_backward_eager(g, h1, h3, None)
    fin = torch.isfinite(egh1)
    torch.testing.assert_close(gh1[fin].float(), egh1[fin].float(), rtol=2 ** -7, atol=2e-6)
    assert torch.isnan(gh1[0, 0])


@needs_compiler
@pytest.mark.parametrize("act", ACTS)
def test_vector_loops_agree_with_generic_loops(act, tmp_path):
    """Where the default build has the AVX-512 BF16 loops, bf16 results are those of the
    generic loops but for rare one-ulp differences (the same formulas, other rounding
    order inside fp32)."""
    default = native_kernels.get("native")
    if not default.vector_bf16:
        pytest.skip("this CPU or build has no AVX-512 BF16 loops")
    generic = native_kernels.build_generic(tmp_path)
    ga, h1, h3, w = inputs(act, torch.bfloat16, rows=97, cols=333)  # a partial last vector
    for got, want in zip(run_native(default, ga, h1, h3, w), run_native(generic, ga, h1, h3, w)):
        if got is None:
            continue
        if got.dtype == torch.float32:  # the gate weight's gradient, summed in another order
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            continue
        differ = got != want
        assert differ.float().mean() < 1e-3
        ulp = want.float().abs() * 2 ** -7
        assert ((got.float() - want.float()).abs()[differ] <= ulp[differ]).all()


@needs_compiler
def test_results_do_not_depend_on_thread_count(kernels):
    ga, h1, h3, w = inputs("swiglu", torch.bfloat16, rows=301, cols=96)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_native(kernels, ga, h1, h3, w)
        torch.set_num_threads(2)
        two = run_native(kernels, ga, h1, h3, w)
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(one, two):
        assert torch.equal(x, y)


@needs_compiler
def test_rejects_what_it_cannot_read(kernels):
    _, h1, h3, w = inputs("swiglu", torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.forward(h1.t(), h3.t(), None, torch.empty_like(h1.t()))
    with pytest.raises(ValueError, match="float32"):
        kernels.forward(h1, h3.double(), None, torch.empty_like(h1))
    with pytest.raises(ValueError, match="expected 67 gate weights"):
        kernels.forward(h1, h3, w[:5], torch.empty_like(h1))
    with pytest.raises(ValueError, match="float16 is not supported"):
        kernels.forward(h1.half(), h3.half(), None, torch.empty_like(h1.half()))
    with pytest.raises(ValueError, match="gate-weight gradient"):
        kernels.backward(h1, h1, h3, w, torch.empty(3), torch.empty_like(h1),
                         torch.empty_like(h1), torch.empty_like(h1))


def build_in_new_process() -> tuple[int, str]:
    """(compiler runs, library path) of a fresh process that loads the kernels (with this
    process's environment, so the same cache)."""
    code = ("from epscale.kernels.cpu import native as nk; k = nk.get('native'); "
            "print(nk.BUILDER.builds, k.path if k else nk.BUILDER.failed)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    builds, path = out.stdout.split(maxsplit=1)
    return int(builds), path.strip()


@needs_compiler
def test_build_is_cached(fresh_builder):
    k = native_kernels.get("native")
    assert k is not None and fresh_builder.builds == 1
    assert k.path.parent == native_kernels.cache_dir() and k.path.exists()
    assert build_in_new_process() == (0, str(k.path))  # loaded from the cache


@needs_compiler
def test_corrupt_cache_entry_is_rebuilt(fresh_builder):
    path = native_kernels.get("native").path
    path.unlink()  # a new file: truncating the one this process has mapped would crash it
    path.write_bytes(b"not a shared library")
    assert build_in_new_process() == (1, str(path))
    assert path.read_bytes()[:4] == b"\x7fELF"


def test_no_compiler_falls_back_with_one_warning(fresh_builder, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    compare_warns_once(make_moe(elementwise="native"), "eager.*no C compiler found.*set CC")


def test_auto_falls_back_silently(fresh_builder, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    moe = make_moe(**VARIANTS["gelu-cap-shared"])
    assert moe.cfg.cpu.elementwise == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compare(moe, (2, 12), tol=1e-5)
    assert "no C compiler" in fresh_builder.failed


@needs_compiler
def test_compile_error_is_reported(fresh_builder, monkeypatch, tmp_path):
    broken = tmp_path / "act_kernels.c"
    broken.write_text("this is not C;\n")
    monkeypatch.setattr(native_kernels, "SOURCE", broken)
    with pytest.warns(RuntimeWarning, match="could not build act_kernels.c"):
        assert native_kernels.get("native") is None
    assert fresh_builder.builds == len(native_kernels.FLAG_SETS)  # every flag set tried


def test_unwritable_home_cache_falls_back_to_private_temp_dir(fresh_builder, monkeypatch,
                                                             tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.delenv("EPSCALE_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))  # cannot be created
    monkeypatch.setattr(native_kernels.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    where = native_kernels.cache_dir()
    assert where.parent == tmp_path / "tmp" and where.stat().st_mode & 0o777 == 0o700
    if native_kernels.find_compiler() is not None:
        assert native_kernels.get("native").path.parent == where


def test_unwritable_cache_is_reported(fresh_builder, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("EPSCALE_KERNEL_CACHE", str(blocker / "cache"))
    if native_kernels.find_compiler() is None:
        pytest.skip("no C compiler")
    with pytest.warns(RuntimeWarning, match="cannot write the kernel cache.*EPSCALE_KERNEL_CACHE"):
        assert native_kernels.get("native") is None


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16])
def test_other_dtypes_run_eager(dtype):
    """fp16 has no native kernel: the fused path takes the eager ops for it."""
    moe = make_moe(dtype, elementwise="native")
    x = torch.randn(2, 12, moe.cfg.dim, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = moe(x)
    assert y.dtype == dtype and torch.isfinite(y).all()


def test_config_default_is_auto():
    assert MoEConfig().cpu.elementwise == "auto"
    assert make_moe().experts.cpu_kernel.cfg.elementwise == "auto"
