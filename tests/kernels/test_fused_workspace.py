"""The fused kernel's workspace (buffers kept across steps): reused only when nothing else
holds them, so gradients stay right under accumulation, retain_graph and callers that
keep a gradient.

Legend: T tokens, D model dim.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from epscale import MoE, MoEConfig
from epscale.config import CpuKernelConfig
from epscale.dispatch.local import LocalDispatcher
from epscale.kernels.cpu import Workspace

SMALL = dict(dim=16, hidden_dim=24, num_experts=4, top_k=2)

# The workspace keeps buffers on CPU only (an accelerator's caching allocator already
# reuses memory); on other devices these tests would check nothing.
pytestmark = pytest.mark.cpu_only


def make(path: str = "fused", workspace: bool = True) -> MoE:
    """A layer keeping its buffers (moe.cpu.keep_buffers) or allocating fresh ones."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(**SMALL, cpu=CpuKernelConfig(keep_buffers=workspace)))
    if path == "rows":
        moe.dispatcher = LocalDispatcher(moe.cfg.num_experts, fuse=False,
                                         workspace=moe.experts.row_buffers())
    assert (moe.experts.cpu_kernel.workspace is not None) == workspace
    assert (moe.dispatcher.workspace is not None) == workspace
    return moe


def step(moe: MoE, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, SMALL["dim"], generator=g)
    moe(x).square().sum().backward()


def grads(moe: MoE) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("path", ["fused", "rows"])
def test_buffers_reused_after_set_to_none(path):
    moe = make(path)
    step(moe, 0)
    ptr = moe.experts.w1.grad.data_ptr()
    moe.zero_grad(set_to_none=True)
    step(moe, 1)
    assert moe.experts.w1.grad.data_ptr() == ptr


@pytest.mark.parametrize("path", ["fused", "rows"])
def test_gradient_accumulation_matches_fresh_buffers(path):
    ref, moe = make(path, workspace=False), make(path)
    for m in (ref, moe):
        for seed in (0, 1, 2):  # no zero_grad in between: grads accumulate
            step(m, seed)
    for name, g in grads(ref).items():
        torch.testing.assert_close(grads(moe)[name], g, msg=name)


def test_retain_graph_and_held_gradient():
    ref, moe = make(workspace=False), make()
    for m in (ref, moe):
        x = torch.randn(32, SMALL["dim"], generator=torch.Generator().manual_seed(3))
        loss = m(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()  # the saved pre-activations must still be intact
    torch.testing.assert_close(grads(moe), grads(ref))
    held = moe.experts.w2.grad  # a caller keeps the gradient and drops it from the param
    kept = held.clone()
    moe.zero_grad(set_to_none=True)
    step(moe, 4)
    assert moe.experts.w2.grad.data_ptr() != held.data_ptr()
    assert torch.equal(held, kept)


def test_copies_and_pickles_start_empty():
    moe = make()
    step(moe, 0)
    assert "buffers" in repr(moe.experts.cpu_kernel.workspace)
    other = copy.deepcopy(moe)
    assert isinstance(other.experts.cpu_kernel.workspace, Workspace)
    assert other.experts.cpu_kernel.workspace._store == {}
    step(other, 1)
    experts = pickle.loads(pickle.dumps(moe.experts))  # MoE itself holds a lambda (timer)
    assert experts.cpu_kernel.workspace._store == {}


def test_accelerator_buffers_are_not_kept():
    """Off CPU the caching allocator reuses memory: the workspace keeps nothing there.
    (The meta device stands in for an accelerator.)"""
    ws = Workspace()
    t = ws.take("b", (4, 8), torch.bfloat16, torch.device("meta"))
    assert t.device.type == "meta" and t.shape == (4, 8) and ws._store == {}


def test_take_grows_and_respects_dtype():
    ws = Workspace()
    a = ws.take("b", (4, 8), torch.bfloat16, torch.device("cpu"))
    ptr = a.data_ptr()
    del a
    b = ws.take("b", (2, 8), torch.float32, torch.device("cpu"))  # same bytes: reused
    assert b.data_ptr() == ptr and b.dtype == torch.float32 and b.shape == (2, 8)
    c = ws.take("b", (4, 8), torch.float32, torch.device("cpu"))  # b still alive: fresh
    assert c.data_ptr() != ptr


def test_rows_output_held_by_caller_is_not_overwritten():
    moe = make()
    experts = moe.experts
    g = torch.Generator().manual_seed(5)
    x1, x2 = (torch.randn(12, SMALL["dim"], generator=g) for _ in range(2))
    counts = torch.tensor([3, 0, 5, 4])
    y1 = experts(x1, counts)
    kept = y1.clone()
    y2 = experts(x2, counts)
    assert torch.equal(y1, kept) and y1.data_ptr() != y2.data_ptr()
    del y1, y2
    y3 = experts(x1, counts)  # nothing holds the buffer now: reused, same result
    torch.testing.assert_close(y3, kept)


def test_dispatcher_row_buffers_reused_and_gradients_unchanged():
    """The rows path's dispatcher keeps its gathered rows and the combine's gradient rows
    from step to step; inputs and gradients match fresh buffers."""
    ref, moe = make("rows", workspace=False), make("rows")
    ptrs = []
    for seed in (0, 1, 2):
        outs = []
        for m in (ref, moe):
            m.zero_grad(set_to_none=True)
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(32, SMALL["dim"], generator=g, requires_grad=True)
            y = m(x)
            y.square().sum().backward()
            outs.append((y.detach(), x.grad))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=0)
        for name, g_ in grads(ref).items():
            torch.testing.assert_close(grads(moe)[name], g_, rtol=0, atol=0, msg=name)
        store = moe.dispatcher.workspace._store
        ptrs.append({k: store[k].data_ptr() for k in ("gather_rows", "combine_grad")})
    assert ptrs[0] == ptrs[1] == ptrs[2]
