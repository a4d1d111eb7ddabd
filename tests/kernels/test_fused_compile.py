"""moe.cpu.elementwise='inductor': the generated element-wise kernels against the reference
(same tolerances as the eager paths), no recompilation when the row counts change, and
the eager fallback (one warning) without a C++ compiler or when compilation fails.

Compiling costs seconds per graph, so this file keeps to a few variants; the eager
kernel is covered variant by variant in test_moe_layer.py.
"""

from __future__ import annotations

import pytest
import torch

from epscale import MoEConfig
from epscale.config import ConfigError, CpuKernelConfig, load_config
from epscale.kernels.cpu import inductor as compiled_kernels
from test_moe_layer import VARIANTS, compare, compare_warns_once, make_moe

pytestmark = pytest.mark.skipif(compiled_kernels.no_compiler_reason() is not None,
                                reason="no C++ compiler for torch.compile")


def compiled_moe(dtype=torch.float32, path="fused", **kw):
    moe = make_moe(dtype, path=path, elementwise="inductor", **kw)
    assert moe.experts.cpu_kernel.cfg.elementwise == "inductor"
    return moe


@pytest.mark.parametrize("path", ["fused", "rows"])
@pytest.mark.parametrize("name", ["softmax-norm", "gelu-cap-shared", "deepseek-like"])
def test_compiled_matches_reference_fp32(name, path):
    compare(compiled_moe(path=path, **VARIANTS[name]), (2, 12), tol=1e-5)


@pytest.mark.parametrize("path", ["fused", "rows"])
@pytest.mark.parametrize("name", ["softmax-norm", "gelu-cap-shared"])
def test_compiled_matches_reference_bf16(name, path):
    moe = compiled_moe(torch.bfloat16, path=path, **VARIANTS[name])
    compare(moe, (2, 12), tol=3e-2, dtype=torch.bfloat16)


def test_compiled_small_chunks_and_empty_expert():
    moe = compiled_moe(num_experts=8, top_k=3, chunk_bytes=200)
    moe.router.expert_bias[2] = -100.0
    compare(moe, (20,), tol=1e-5)


def test_no_recompile_when_rows_change():
    from torch._dynamo.utils import counters

    moe = compiled_moe()
    compare(moe, (24,), tol=1e-5)  # warm up: compiles
    compare(moe, (40,), tol=1e-5)  # a second size may add the dynamic-shape graphs
    before = counters["stats"]["unique_graphs"]
    for T in (31, 57, 90):
        compare(moe, (T,), tol=1e-5)
    assert counters["stats"]["unique_graphs"] == before


@pytest.fixture
def fresh_compiled(monkeypatch):
    """A fresh build state, so that a simulated failure does not leak into other tests."""
    state = compiled_kernels.Compiled()
    monkeypatch.setattr(compiled_kernels, "COMPILED", state)
    return state


def test_falls_back_without_compiler(monkeypatch, fresh_compiled):
    monkeypatch.setattr(compiled_kernels, "no_compiler_reason", lambda: "no C++ compiler found (test)")
    compare_warns_once(compiled_moe(), "eager.*no C\\+\\+ compiler")


def test_falls_back_when_compilation_fails(monkeypatch, fresh_compiled):
    def broken_compile(fn, **kw):
        def run(*args):
            raise RuntimeError("C++ compile error (simulated)")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    compare_warns_once(compiled_moe(), "compilation failed")
    assert fresh_compiled.failed is not None


def test_config_knob_validated():
    with pytest.raises(ValueError, match="moe.cpu.elementwise.*'auto', 'native', 'inductor', 'off'"):
        CpuKernelConfig(elementwise="yes")
    assert CpuKernelConfig(elementwise="on").elementwise == "inductor"  # its first name
    assert MoEConfig().cpu.elementwise == "auto"
    # the key's old place loads, under its new name, with a warning naming it
    with pytest.warns(FutureWarning, match="'moe.compile_kernels' has moved to 'moe.cpu.elementwise'"):
        cfg = load_config(None, ["moe.compile_kernels=on"])
    assert cfg.moe.cpu.elementwise == "inductor"
    with pytest.raises(ConfigError, match="'moe.compile_kernels' and 'moe.cpu.elementwise' are both set"):
        load_config(None, ["moe.compile_kernels=off", "moe.cpu.elementwise=auto"])


def test_kernels_built_per_thread_count(fresh_compiled):
    """Generated code runs on torch's thread count at the call: one build per count."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = compiled_kernels.get_kernels(True)
        torch.set_num_threads(2)
        two = compiled_kernels.get_kernels(True)
        assert one is not two and compiled_kernels.get_kernels(True) is two
        assert set(fresh_compiled.fns) == {1, 2}
    finally:
        torch.set_num_threads(threads)
