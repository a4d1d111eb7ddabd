"""Chunks of the fused expert kernel run side by side on CPU threads
(epscale.kernels.cpu.chunk_workers): the same results as one chunk at a time, the reference's
results, every chunk once, errors and autograd modes carried over.

Legend: T tokens, D model dim.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from epscale import MoE, MoEConfig
from epscale.config import CpuKernelConfig
from epscale.dispatch.local import LocalDispatcher
from epscale.kernels.cpu import chunk_workers, fused
from epscale.kernels.cpu import native as native_kernels
from epscale.kernels.cpu.chunk_workers import choose_workers, longest_share, run_chunks

from test_moe_layer import compare

pytestmark = pytest.mark.cpu_only

CPU = torch.device("cpu")


def _team_available() -> bool:
    lib = native_kernels.BUILDER.get()
    return lib is not None and lib.openmp


needs_team = pytest.mark.skipif(not _team_available(),
                                reason="the native library (C compiler with OpenMP) did not build")


@pytest.fixture
def threads():
    """Sets torch's intra-op thread count for one test (tests run with 1 by default)."""
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


def test_longest_share_takes_largest_first():
    assert longest_share([5, 4, 3, 3, 3], 2) == 10  # 5+3 | 4+3+3
    assert longest_share([4, 4, 4, 4], 2) == 8
    assert longest_share([10, 1, 1], 2) == 10
    assert longest_share([7], 3) == 7


@needs_team
def test_choose_workers(threads, monkeypatch):
    threads(2)
    even = [100] * 8
    assert choose_workers(CPU, even) == 2
    assert choose_workers(CPU, even, requested=1) == 1
    assert choose_workers(CPU, [800]) == 1                   # one chunk: split its ops
    assert choose_workers(CPU, [700, 50, 50]) == 1           # one worker would hold up the call
    assert choose_workers(torch.device("meta"), even) == 1   # accelerators: one launch stream
    threads(4)
    assert choose_workers(CPU, [100, 100]) == 2               # no more workers than chunks
    assert choose_workers(CPU, even, requested=3) == 3
    threads(1)
    assert choose_workers(CPU, even) == 1
    threads(2)
    assert chunk_workers._one_openmp_runtime()  # torch's libgomp, which the library links to
    monkeypatch.setattr(chunk_workers, "_one_openmp_runtime", lambda: False)
    assert choose_workers(CPU, even) == 1                     # torch would not see the team
    monkeypatch.undo()
    monkeypatch.setattr(native_kernels.BUILDER, "get", lambda: None)
    assert choose_workers(CPU, even) == 1                     # no native library: no team


@needs_team
def test_every_chunk_once_largest_first_on_the_team(threads):
    threads(2)
    sizes = [3, 9, 1, 7, 5, 2, 8, 4]
    seen, lock = [], threading.Lock()

    def fn(chunk, worker):
        with lock:
            seen.append((chunk, worker, threading.get_ident()))
        time.sleep(0.05)  # releases the GIL: both threads take chunks (and record them in
        # the order taken, unless one stalls for 50 ms between taking and recording)

    run_chunks(fn, sizes, 2)
    assert sorted(c for c, _, _ in seen) == list(range(len(sizes)))
    assert {w for _, w, _ in seen} == {0, 1}
    assert len({t for _, _, t in seen}) == 2
    # The first two taken are the two largest (9 and 8); a third is taken only after one
    # of them is done.
    assert {c for c, _, _ in seen[:2]} == {1, 6}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_chunks_error_reaches_the_caller(workers, threads):
    if workers > 1 and not _team_available():
        pytest.skip("the native library (C compiler with OpenMP) did not build")
    threads(2)
    ran = []

    def fn(chunk, worker):
        ran.append(chunk)
        if chunk == 0:  # the largest: taken first
            raise ValueError("chunk 0 failed")
        time.sleep(0.01)

    with pytest.raises(ValueError, match="chunk 0 failed"):
        run_chunks(fn, [50, 1, 1, 1, 1, 1, 1, 1], workers)
    assert len(ran) < 8  # chunks not yet started are skipped


@needs_team
def test_chunks_run_under_the_callers_grad_and_inference_modes(threads):
    threads(2)
    modes = set()

    def fn(chunk, worker):
        modes.add((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        time.sleep(0.005)

    with torch.no_grad():
        run_chunks(fn, [1] * 4, 2)
    assert modes == {(False, False)}
    modes.clear()
    with torch.inference_mode():
        run_chunks(fn, [1] * 4, 2)
    assert modes == {(False, True)}
    modes.clear()
    run_chunks(fn, [1] * 4, 2)
    assert modes == {(True, False)}
    # The team's threads are left as they were found.
    modes.clear()
    with torch.no_grad():
        run_chunks(fn, [1] * 4, 2)
    run_chunks(fn, [1] * 4, 2)
    assert (True, False) in modes


def _layer(path: str, dtype, workers: int | None = None, elementwise: str = "auto",
           **kw) -> MoE:
    torch.manual_seed(0)
    # a few experts per chunk: several chunks
    cpu = CpuKernelConfig(chunk_bytes=400, chunk_workers=workers, elementwise=elementwise)
    moe = MoE(MoEConfig(**{**dict(dim=32, hidden_dim=48, num_experts=8, top_k=3), **kw},
                        cpu=cpu)).to(dtype)
    if path == "rows":
        moe.dispatcher = LocalDispatcher(moe.cfg.num_experts, fuse=False,
                                         workspace=moe.experts.row_buffers())
    return moe


def _spy_workers(monkeypatch) -> list[int]:
    used = []
    real = fused.run_chunks
    monkeypatch.setattr(fused, "run_chunks",
                        lambda fn, sizes, workers: used.append(workers) or real(fn, sizes, workers))
    return used


def _output_and_grads(moe: MoE, x_TD: torch.Tensor, gy_TD: torch.Tensor):
    moe.zero_grad(set_to_none=True)
    x = x_TD.clone().requires_grad_(True)
    y = moe(x)
    y.backward(gy_TD)
    return [y.detach(), x.grad, *(p.grad for p in moe.parameters())]


@needs_team
@pytest.mark.parametrize("kernels", ["auto", "off"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["fused", "rows"])
def test_side_by_side_equals_one_at_a_time(path, dtype, activation, kernels, threads, monkeypatch):
    """Bit for bit: each chunk's work is the same single-threaded or not (row-split
    element-wise kernels, GEMMs that do not split their reduction at these sizes)."""
    threads(2)
    used = _spy_workers(monkeypatch)
    layers = [_layer(path, dtype, workers, activation=activation, elementwise=kernels,
                     capacity_factor=1.0 if activation == "gelu" else None) for workers in (None, 1)]
    for moe in layers:
        moe.router.expert_bias[5] = -100.0  # an expert with no rows
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 32, generator=g).to(dtype)
    gy = torch.randn(96, 32, generator=g).to(dtype)
    side_by_side = _output_and_grads(layers[0], x, gy)
    assert used and all(w == 2 for w in used), used
    used.clear()
    one_at_a_time = _output_and_grads(layers[1], x, gy)
    assert used and all(w == 1 for w in used), used
    for a, b in zip(side_by_side, one_at_a_time):
        assert (a is None and b is None) or torch.equal(a, b)


@needs_team
@pytest.mark.parametrize("path", ["fused", "rows"])
@pytest.mark.parametrize("name,kw", [
    ("softmax", dict()),
    ("sigmoid-groups-shared", dict(score_func="sigmoid", num_groups=4, topk_groups=2,
                                   num_shared_experts=1, route_scale=2.0)),
    ("capacity-gelu", dict(activation="gelu", capacity_factor=0.5, drop_policy="probs")),
])
def test_side_by_side_matches_reference(name, kw, path, threads, monkeypatch):
    threads(2)
    used = _spy_workers(monkeypatch)
    moe = _layer(path, torch.float32, **kw)
    compare(moe, (4, 24), tol=1e-5)
    assert used and all(w == 2 for w in used), used


@needs_team
def test_inference_forward_and_workspace_reuse_on_the_team(threads, monkeypatch):
    threads(2)
    used = _spy_workers(monkeypatch)
    moe = _layer("fused", torch.float32)
    x = torch.randn(96, 32)
    with torch.inference_mode():
        y_inf = moe(x)
    with torch.no_grad():
        assert torch.equal(moe(x), y_inf)
    # The weight gradients come from the workspace, step after step: nothing the team
    # ran holds on to them.
    moe(x).square().sum().backward()
    ptr = moe.experts.w1.grad.data_ptr()
    moe.zero_grad(set_to_none=True)
    moe(x).square().sum().backward()
    assert moe.experts.w1.grad.data_ptr() == ptr
    assert used and all(w == 2 for w in used), used


def test_accelerators_and_single_thread_run_in_the_caller(threads):
    threads(1)
    callers = set()
    run_chunks(lambda c, w: callers.add((threading.get_ident(), w)), [4, 4, 4],
               chunk_workers.choose_workers(CPU, [4, 4, 4]))
    assert callers == {(threading.get_ident(), 0)}


def test_describe_says_how_chunks_run(threads, monkeypatch):
    threads(1)
    assert chunk_workers.describe("cpu") == "one after another (1 thread)"
    assert chunk_workers.describe("meta").startswith("one after another")
    threads(2)
    if _team_available():
        assert chunk_workers.describe("cpu") == "side by side, one chunk per thread on 2 threads"
    monkeypatch.setattr(native_kernels.BUILDER, "get", lambda: None)
    assert chunk_workers.describe("cpu").startswith("one after another, each op over 2 threads (")


@needs_team
def test_accumulation_and_retain_graph_on_the_team(threads, monkeypatch):
    """Two micro-batches accumulated, the second backward run twice (retain_graph): the
    gradients equal one chunk at a time's (the workspace hands out fresh buffers while
    a gradient is held, with or without the team)."""
    threads(2)
    used = _spy_workers(monkeypatch)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(96, 32, generator=g) for _ in range(2)]

    def grads(workers):
        moe = _layer("fused", torch.float32, workers)
        moe(xs[0]).square().sum().backward()
        y = moe(xs[1]).square().sum()
        y.backward(retain_graph=True)
        y.backward()
        return [p.grad.clone() for p in moe.parameters()]

    side_by_side = grads(None)
    assert used and all(w == 2 for w in used), used
    for a, b in zip(side_by_side, grads(1)):
        assert torch.equal(a, b)
