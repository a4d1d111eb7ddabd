"""The fused, chunked output head + cross-entropy (``epscale.head_loss``) against the plain
``F.cross_entropy(F.linear(h, W).float(), y)``: the loss and both gradients in float64
(ignored targets, a chunk size that does not divide T, every target ignored), the model's
loss tied and untied with document masking, bf16 under both of the trainer's rules, the
split backward of the zero-bubble schedules (each gradient GEMM once), and the bytes a
forward keeps (the [T, V] logits no longer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from epscale.config import load_config
from epscale.head_loss import head_loss
from epscale.metrics.held import forward_kept_bytes
from epscale.model import build_model, next_token_loss

T, D, V = 37, 16, 50


def _inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    w = torch.randn(V, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    y = torch.randint(0, V, (T,), generator=g)
    y[::4] = -100
    return h, w, y


def _loss_and_grads(fn, h, w):
    loss = fn()
    gh, gw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), gh, gw


@pytest.mark.parametrize("chunk_rows", [1, 8, 37, 64])   # 8 leaves a last chunk of 5
def test_matches_cross_entropy_in_float64(chunk_rows):
    """float64 all through: the chunked sums differ from the plain ones in summation order
    only (rounding ~1e-16 relative), so rtol 1e-10 leaves room and still fails on any
    real difference (a wrong scale, a row off, an ignored target counted)."""
    h, w, y = _inputs(torch.float64)
    got = _loss_and_grads(lambda: head_loss(h, w, y, chunk_rows=chunk_rows), h, w)
    want = _loss_and_grads(lambda: F.cross_entropy(F.linear(h, w), y), h, w)
    assert got[0].dtype == torch.float64
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    assert got[1][::4].abs().max() == 0        # ignored rows get no gradient


def test_every_target_ignored_gives_nan_and_zero_gradients_as_cross_entropy():
    h, w, _ = _inputs(torch.float64)
    y = torch.full((T,), -100)
    got = _loss_and_grads(lambda: head_loss(h, w, y, chunk_rows=8), h, w)
    want = _loss_and_grads(lambda: F.cross_entropy(F.linear(h, w), y), h, w)
    assert got[0].isnan() and want[0].isnan()
    assert got[1].abs().max() == want[1].abs().max() == 0
    assert got[2].abs().max() == want[2].abs().max() == 0


SMALL = ["model.dim=32", "model.num_layers=2", "model.num_heads=4", "model.seq_len=16",
         "model.dense_hidden_dim=64", "model.num_dense_layers=1", "model.vocab_size=96",
         "moe.hidden_dim=32", "moe.num_experts=4", "moe.top_k=2"]


@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_is_the_plain_loss_in_float64(tied):
    """Transformer.loss (the fused head) against the plain head and cross-entropy,
    every parameter's gradient included (the tied embedding gets the head's gradient and
    the lookup's), with document masking (targets after an EOS skipped). float64: see
    test_matches_cross_entropy_in_float64 for the tolerance."""
    cfg = load_config(None, SMALL + [f"model.tie_embeddings={str(tied).lower()}"])
    net = build_model(cfg).double()
    net.set_document_masking(eos_id=3, kind="dense")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 96, (2, 16), generator=g), torch.randint(0, 96, (2, 16), generator=g)
    x[0, 5] = x[1, 9] = 3
    params = [p for p in net.parameters() if p.requires_grad]

    def run(fn):
        loss = fn()
        return [loss.detach()] + list(torch.autograd.grad(loss, params, allow_unused=True))

    got = run(lambda: net.loss(x, y))
    # the plain head in float64 (Transformer.logits rounds to fp32)
    want = run(lambda: F.cross_entropy(F.linear(net.norm(net.hidden(x)), net.head_weight())
                                       .flatten(0, 1), net.loss_targets(x, y).reshape(-1)))
    assert net.loss_targets(x, y)[0, 5] == -100
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("rule", ["bf16 autocast", "bf16 weights"])
def test_bf16_matches_the_plain_path(rule):
    """bf16 products: autocast over fp32 h and W, or bf16 h and W (FSDP's rule). The
    logits are the same bf16 GEMM outputs, so the loss agrees to fp32 rounding; grad_h is
    one GEMM either way; grad_W sums the chunks' bf16 products in fp32 where the plain
    path rounds one product to bf16 once: each element within a few bf16 ulps (2^-8
    relative) of the largest, hence rtol = atol/scale = 2^-6."""
    dtype = torch.float32 if rule == "bf16 autocast" else torch.bfloat16
    h, w, y = _inputs(dtype, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rule == "bf16 autocast"):
        got = _loss_and_grads(lambda: head_loss(h, w, y, chunk_rows=8), h, w)
        want = _loss_and_grads(lambda: F.cross_entropy(F.linear(h, w).float(), y), h, w)
    assert got[0].dtype == torch.float32 and (got[1].dtype, got[2].dtype) == (dtype, dtype)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6,
                                   atol=2 ** -6 * b.float().abs().max().item())


class _GemmShapes(TorchDispatchMode):
    """Records the output shape of every matrix product (mm, addmm) run under it."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.shapes.append(tuple(out.shape))
        return out


def test_split_backward_computes_each_gradient_once():
    """torch's split backward (``stage_backward_input`` then ``stage_backward_weight``,
    as the zero-bubble and V schedules run a stage's): the input part computes grad_h
    only, the weight part grad_W only, each chunk's GEMM once (both parts recompute the
    chunk's logits), and the gradients are a plain backward's."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    h_in, w, y = _inputs(torch.float32, seed=3)
    w = torch.nn.Parameter(w.detach())
    chunks = 5                                  # 37 rows by 8

    def forward():
        return head_loss(h_in * 1.0, w, y, chunk_rows=8)   # h: an intermediate, as in a stage

    with _GemmShapes() as plain:
        forward().backward()
    want = (h_in.grad.clone(), w.grad.clone())
    h_in.grad = w.grad = None
    loss = forward()
    with _GemmShapes() as first:
        (dh,), groups = stage_backward_input([loss], None, [h_in], iter([w]))
    with _GemmShapes() as second:
        stage_backward_weight(iter([w]), groups)

    def count(rec, shape_of):
        return sum(1 for s in rec.shapes if shape_of(s))

    def is_gh(s):
        return s[1] == D and s[0] != V

    def is_gw(s):
        return s == (V, D)

    assert (count(plain, is_gh), count(plain, is_gw)) == (chunks, chunks)
    assert (count(first, is_gh), count(first, is_gw)) == (chunks, 0), first.shapes
    assert (count(second, is_gh), count(second, is_gw)) == (0, chunks), second.shapes
    torch.testing.assert_close(dh, want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.grad, want[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rule", ["fp32", "bf16 autocast"])
def test_forward_keeps_no_logits(rule):
    """The head's forward keeps T x V x 4 bytes fewer than the plain path (the fp32
    log-softmax the cross-entropy keeps) and, under autocast, also not the weight's bf16
    copy (V x D x 2): the fused head casts it again in backward. Measured as
    tests/test_memory.py measures (torch's profiler)."""
    cfg = load_config(None, SMALL + ["model.vocab_size=512", "model.seq_len=64"])
    net = build_model(cfg)
    Tm, Vm, Dm = 2 * 64, 512, 32
    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, 64, Dm, generator=g, requires_grad=True)
    y = torch.randint(0, Vm, (2, 64), generator=g)

    def kept(fn):
        samples = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rule != "fp32"):
                k, loss = forward_kept_bytes(fn)
            loss.backward()
            samples.append(k)
        return sorted(samples)[1]

    fused = kept(lambda: net.head_loss(h, y))
    plain = kept(lambda: next_token_loss(net.logits(h), y))
    saved = Tm * Vm * 4 + (Vm * Dm * 2 if rule != "fp32" else 0)
    assert plain - fused == pytest.approx(saved, rel=0.005), (plain, fused, saved)
