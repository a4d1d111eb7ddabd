"""The fast MoE layer against the per-token reference, forward and backward, for every
router, capacity, activation and shared-expert variant; edge cases; statistics; bad input.

Legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k.
"""

from __future__ import annotations

import math

import warnings

import pytest
import torch

import dataclasses

from epscale import MoE, MoEConfig
from epscale.config import CpuKernelConfig
from epscale.dispatch.local import LocalDispatcher
from epscale.kernels.cpu.fused import CHUNK_BYTES, ExpertPlan
from epscale.moe.experts import GroupedExperts
from epscale.moe.reference import reference_forward
from epscale.moe.router import expert_capacity
from epscale.ops import count_ids, index_add_counts

SMALL = dict(dim=16, hidden_dim=24, num_experts=8, top_k=2)


# The ways the layer can compute: the fused no-EP CPU kernel (default on CPU), the
# generic dispatch -> experts(x_RD) -> combine path that EP dispatchers take, that path
# with plain-autograd grouped-GEMM experts (an independent second implementation), and the
# no-EP path with grouped-GEMM experts (moe.experts_impl=grouped_mm: the accelerators'
# default).
PATHS = ["fused", "rows", "autograd", "grouped"]
CPU_KEYS = {f.name for f in dataclasses.fields(CpuKernelConfig)}


def make_moe(dtype=torch.float32, bias_std: float = 0.0, path: str = "fused", **kw) -> MoE:
    """A small layer; keys of CpuKernelConfig (elementwise, gemm, chunk_bytes, ...) go to
    its ``moe.cpu`` section."""
    cpu = CpuKernelConfig(**{k: kw.pop(k) for k in list(kw) if k in CPU_KEYS})
    if path in ("autograd", "grouped"):
        kw.setdefault("experts_impl", "grouped_mm")
    cfg = MoEConfig(**{**SMALL, **kw}, cpu=cpu)
    moe = MoE(cfg).to(dtype)
    if path in ("rows", "autograd"):
        moe.dispatcher = LocalDispatcher(cfg.num_experts, fuse=False,
                                         workspace=moe.experts.row_buffers())
    if bias_std:
        moe.router.expert_bias.normal_(0.0, bias_std)
    return moe


def params_of(moe: MoE) -> dict[str, torch.nn.Parameter]:
    return dict(moe.named_parameters())


def run_fast(moe: MoE, x: torch.Tensor, gy: torch.Tensor):
    """Output, aux loss and grads (x and every parameter) of the fast layer."""
    x = x.detach().clone().requires_grad_(True)
    y = moe(x)
    aux = moe.aux_loss
    loss = (y.float() * gy).sum() + aux
    params = params_of(moe)
    grads = torch.autograd.grad(loss, [x, *params.values()], allow_unused=True)
    return y.detach(), aux.detach(), dict(zip(["x", *params], grads))


def run_reference(moe: MoE, x: torch.Tensor, gy: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    y, aux = reference_forward(moe, x)
    loss = (y.float() * gy).sum() + aux
    params = params_of(moe)
    grads = torch.autograd.grad(loss, [x, *params.values()], allow_unused=True)
    return y.detach(), aux.detach(), dict(zip(["x", *params], grads))


def assert_close_rel(got, want, tol: float, what: str):
    """max |got - want| <= tol * max |want| (norm-relative, robust to tiny entries)."""
    if want is None:
        assert got is None or not got.any(), f"{what}: expected no gradient"
        return
    assert got is not None, f"{what}: missing gradient"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= tol * scale + 1e-12, f"{what}: max err {err:.3g} > {tol} * {scale:.3g}"


def compare(moe: MoE, shape, tol: float, dtype=torch.float32):
    x = torch.randn(*shape, moe.cfg.dim, dtype=dtype)
    gy = torch.randn(*shape, moe.cfg.dim)
    y, aux, grads = run_fast(moe, x, gy)
    ry, raux, rgrads = run_reference(moe, x, gy)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close_rel(y, ry, tol, "output")
    torch.testing.assert_close(aux.float(), raux.float(), rtol=tol, atol=1e-7)
    for name, g in grads.items():
        assert_close_rel(g, rgrads[name], tol, f"grad {name}")
    return y, grads


def compare_warns_once(moe: MoE, match: str) -> None:
    """Matches the reference, warning (``match``) on the first call and not again."""
    with pytest.warns(RuntimeWarning, match=match):
        compare(moe, (2, 12), tol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not per call
        compare(moe, (2, 12), tol=1e-5)


# Each variant exercises one more feature; together they cover router x capacity x
# activation x shared experts x GEMM path.
VARIANTS = {
    "softmax-norm": dict(),
    "softmax-nonorm": dict(route_norm=False),
    "sigmoid-scale": dict(score_func="sigmoid", route_scale=2.5, bias_std=0.05),
    "sigmoid-nonorm": dict(score_func="sigmoid", route_norm=False),
    "groups": dict(score_func="sigmoid", num_groups=4, topk_groups=2, bias_std=0.05),
    "groups-k3": dict(num_experts=16, top_k=3, num_groups=8, topk_groups=3),
    "top1": dict(top_k=1, route_norm=False),  # with route_norm, K=1 weights are exactly 1
    "top4-e16": dict(num_experts=16, top_k=4),
    "cap-probs": dict(capacity_factor=1.0, drop_policy="probs"),
    "cap-position": dict(capacity_factor=0.75, drop_policy="position"),
    "gelu": dict(activation="gelu"),
    "gelu-cap-shared": dict(activation="gelu", capacity_factor=1.0, num_shared_experts=1),
    "shared": dict(num_shared_experts=1),
    "shared2-width": dict(num_shared_experts=2, shared_hidden_dim=12, score_func="sigmoid"),
    "losses": dict(aux_loss_coeff=0.1, seq_aux_loss_coeff=0.05, z_loss_coeff=0.01),
    "losses-sigmoid-cap": dict(score_func="sigmoid", aux_loss_coeff=0.1, seq_aux_loss_coeff=0.1,
                               z_loss_coeff=0.01, capacity_factor=0.5),
    "loop": dict(use_grouped_mm="never"),
    "loop-gelu-cap": dict(use_grouped_mm="never", activation="gelu", capacity_factor=0.5),
    "deepseek-like": dict(num_experts=16, top_k=4, score_func="sigmoid", num_groups=4,
                          topk_groups=2, route_scale=2.0, num_shared_experts=1,
                          seq_aux_loss_coeff=0.01, bias_std=0.02),
}


# moe.cpu.elementwise: 'auto' (native C kernels where they build) and 'off' (eager ops)
# run the element-wise work of the fused path in two independent ways.
KERNELS = ["auto", "off"]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_reference_fp32(name, kernels):
    moe = make_moe(elementwise=kernels, **VARIANTS[name])
    compare(moe, (2, 12), tol=1e-5)


@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("name", ["softmax-norm", "sigmoid-scale", "groups", "cap-probs",
                                  "cap-position", "gelu-cap-shared", "losses", "deepseek-like"])
def test_other_paths_match_reference_fp32(name, path):
    moe = make_moe(path=path, **VARIANTS[name])
    compare(moe, (2, 12), tol=1e-5)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["softmax-norm", "groups", "cap-probs", "gelu-cap-shared",
                                  "losses", "loop", "deepseek-like"])
def test_matches_reference_bf16(name, path, kernels):
    moe = make_moe(torch.bfloat16, path=path, elementwise=kernels, **VARIANTS[name])
    compare(moe, (2, 12), tol=3e-2, dtype=torch.bfloat16)


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["grouped", "autograd"])
@pytest.mark.parametrize("name", ["softmax-norm", "cap-probs", "gelu-cap-shared", "losses",
                                  "deepseek-like"])
def test_device_code_path_matches_reference(name, path, dtype):
    """CPU tensors through the code CUDA runs (no host shortcuts: tests/test_host_syncs.py
    counts its syncs): grouped GEMM with device offsets in bf16, the per-group loop in fp32;
    the dropless row count and the capacity path's one host read."""
    from epscale.ops import device_code_path

    moe = make_moe(dtype, path=path, **VARIANTS[name])
    with device_code_path(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp32 takes the loop, and says so
        compare(moe, (2, 12), tol=1e-5 if dtype == torch.float32 else 3e-2, dtype=dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dims_not_multiple_of_8(dtype, path):
    """bf16 grouped GEMM needs 16-byte strides; odd widths must fall back, not crash."""
    moe = make_moe(dtype, dim=12, hidden_dim=20, num_experts=6, top_k=2, path=path)
    compare(moe, (10,), tol=1e-5 if dtype == torch.float32 else 3e-2, dtype=dtype)


@pytest.mark.parametrize("gemm", ["loop", "grouped"])
@pytest.mark.parametrize("path", ["fused", "rows"])
@pytest.mark.parametrize("chunk_bytes", [1, 200, 1 << 30])
def test_many_small_chunks(chunk_bytes, path, gemm):
    """Chunk boundaries (one expert per chunk, or a few) and the GEMM form change nothing."""
    moe = make_moe(path=path, num_experts=8, top_k=3, num_shared_experts=1,
                   chunk_bytes=chunk_bytes, gemm=gemm)
    moe.router.expert_bias[2] = -100.0  # an empty expert inside a chunk
    compare(moe, (20,), tol=1e-5)


def test_expert_plan_chunks_whole_experts():
    counts = [3, 0, 5, 1, 0, 0, 7, 2]
    plan = ExpertPlan.build(counts, row_bytes=10, chunk_bytes=40)  # target 4 rows
    assert plan.num_rows == 18 and plan.starts == (0, 3, 3, 8, 9, 9, 9, 16)
    rows = [r for r0, r1, _, _ in plan.chunks for r in range(r0, r1)]
    assert rows == list(range(18))  # in order, no gaps, no overlap
    experts = [e for _, _, e0, e1 in plan.chunks for e in range(e0, e1)]
    assert experts == sorted(set(experts)) and set(experts) >= {0, 2, 3, 6, 7}
    for r0, r1, e0, e1 in plan.chunks:
        assert r0 == plan.starts[e0] and r1 == plan.starts[e1 - 1] + counts[e1 - 1]
    assert plan.chunks == ((0, 3, 0, 2), (3, 8, 2, 3), (8, 9, 3, 6), (9, 16, 6, 7), (16, 18, 7, 8))
    for r0, r1, e0, e1 in plan.chunks:  # within the target, or one expert too big for it
        assert r1 - r0 <= 4 or sum(1 for e in range(e0, e1) if counts[e]) == 1
    assert plan.max_chunk_rows == 7
    assert ExpertPlan.build([0, 0], 10).chunks == ()


@pytest.mark.cpu_only
def test_chunks_are_cache_sized_and_the_cpu_kernel_stays_on_cpu(monkeypatch):
    """1 MB chunks by default (moe.cpu.chunk_bytes overrides it); the chunked kernel is
    the CPU path only: 'auto' runs grouped GEMMs on other devices (meta stands in for an
    accelerator), and 'cpu_fused' asked for there says so instead of running."""
    assert CHUNK_BYTES == 1 << 20
    counts, row_bytes = [512] * 64, 1024 * 2
    assert len(ExpertPlan.build(counts, row_bytes, CHUNK_BYTES).chunks) == 64
    seen = []
    real = ExpertPlan.build
    monkeypatch.setattr(ExpertPlan, "build", staticmethod(
        lambda counts, row_bytes, chunk_bytes, grouped=False:
        seen.append(chunk_bytes) or real(counts, row_bytes, chunk_bytes, grouped)))
    make_moe()(torch.randn(6, 16))
    make_moe(chunk_bytes=200)(torch.randn(6, 16))
    assert seen == [CHUNK_BYTES, 200]
    auto = GroupedExperts(4, 8, 16)
    assert auto.impl_for(torch.empty(1, device="meta")) == "grouped_mm"
    assert auto.impl_for(torch.empty(1)) == "cpu_fused"
    assert GroupedExperts(4, 8, 16, impl="grouped_mm").cpu_kernel is None
    fused = GroupedExperts(4, 8, 16, impl="cpu_fused")
    with pytest.raises(RuntimeError, match="cpu_fused' runs on CPU tensors only.*'auto' or 'grouped_mm'"):
        fused(torch.empty(3, 8, device="meta"), torch.tensor([3, 0, 0, 0]))


# ------------------------------------------------------------------ edge cases

@pytest.mark.parametrize("path", PATHS)
def test_expert_with_no_tokens(path):
    moe = make_moe(path=path)
    moe.router.expert_bias[3] = -100.0  # expert 3 is never selected
    _, grads = compare(moe, (16,), tol=1e-5)
    assert moe.last_stats["tokens_per_expert"][3] == 0
    for name in ("experts.w1", "experts.w2", "experts.w3"):
        assert torch.count_nonzero(grads[name][3]) == 0
        assert grads[name].abs().sum() > 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_to_one_expert(top_k, path):
    moe = make_moe(top_k=top_k, route_norm=top_k > 1, path=path)
    moe.router.expert_bias[5] = 100.0
    compare(moe, (16,), tol=1e-5)
    counts = moe.last_stats["tokens_per_expert"]
    assert counts[5] == 16 and counts.sum() == 16 * top_k


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=0.1), dict(num_shared_experts=1)])
def test_single_token(kw, path):
    compare(make_moe(path=path, **kw), (1,), tol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_capacity_that_drops_most_tokens(path):
    moe = make_moe(capacity_factor=0.1, drop_policy="probs", aux_loss_coeff=0.1, path=path)
    y, _ = compare(moe, (32,), tol=1e-5)
    cap = expert_capacity(32, 2, 8, 0.1)
    kept = 64 - moe.last_stats["num_dropped"]
    assert cap == 1 and kept <= 8 and moe.last_stats["num_dropped"] >= 56
    # Tokens whose both assignments were dropped produce exactly zero (the residual carries them).
    assert (y.abs().sum(-1) == 0).sum() >= 32 - 8


@pytest.mark.parametrize("fuse", [True, False])
def test_dropless_dispatcher_refuses_dropped_assignments(fuse):
    """A dispatcher told the router never drops counts its rows without a host read; a
    dropped assignment reaching it is an error (checked on the device), not wrong rows."""
    disp = LocalDispatcher(4, fuse=fuse, dropless=True)
    experts = GroupedExperts(4, 8, 16)
    idx = torch.tensor([[0, 1], [2, -1], [3, 0]])
    w = torch.full((3, 2), 0.5)
    with pytest.raises(RuntimeError, match="a dropless dispatcher got dropped ones"):
        disp.dispatch_compute_combine(torch.randn(3, 8), idx, w, experts)
    idx[1, 1] = 1  # nothing dropped: fine
    assert disp.dispatch_compute_combine(torch.randn(3, 8), idx, w, experts).shape == (3, 8)


def test_all_assignments_dropped_dispatcher():
    """The dispatcher contract: -1 everywhere -> nothing sent, zero output, zero grads."""
    disp = LocalDispatcher(4)
    experts = GroupedExperts(4, 8, 16)
    x_TD = torch.randn(5, 8, requires_grad=True)
    idx_TK = torch.full((5, 2), -1, dtype=torch.long)
    w_TK = torch.zeros(5, 2, requires_grad=True)
    recv_x_RD, counts_e, handle = disp.dispatch(x_TD, idx_TK, w_TK)
    assert recv_x_RD.shape == (0, 8) and counts_e.sum() == 0
    y_TD = disp.combine(experts(recv_x_RD, counts_e), handle)
    assert y_TD.shape == (5, 8) and not y_TD.any()
    y_TD.sum().backward()
    assert not x_TD.grad.any() and not experts.w1.grad.any()


@pytest.mark.parametrize("other", [dict(path="autograd", use_grouped_mm="never"),
                                   dict(path="autograd"), dict(path="rows"), dict(path="grouped"),
                                   dict(path="grouped", use_grouped_mm="never")])
def test_paths_agree_with_fused(other):
    torch.manual_seed(1)
    a = make_moe(num_experts=8, top_k=3)
    b = make_moe(num_experts=8, top_k=3, **other)
    b.load_state_dict(a.state_dict())
    x = torch.randn(40, 16)
    gy = torch.randn(40, 16)
    ya, _, ga = run_fast(a, x, gy)
    yb, _, gb = run_fast(b, x, gy)
    assert_close_rel(ya, yb, 1e-6, "output")
    for name in ga:
        assert_close_rel(ga[name], gb[name], 1e-6, name)


def test_autocast_bf16_close_to_fp32():
    moe = make_moe(num_shared_experts=1)
    x = torch.randn(24, 16)
    want = moe(x)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        got = moe(x)
    assert got.dtype == torch.float32
    assert_close_rel(got, want, 5e-2, "autocast output")


# ------------------------------------------------------------------ losses and statistics

def test_aux_loss_zero_tensor_without_coefficients():
    moe = make_moe()
    moe(torch.randn(8, 16))
    assert isinstance(moe.aux_loss, torch.Tensor) and moe.aux_loss.dim() == 0
    assert moe.aux_loss.item() == 0.0


def test_aux_loss_reaches_gate():
    moe = make_moe(aux_loss_coeff=1.0, z_loss_coeff=0.1)
    moe(torch.randn(32, 16))
    assert moe.aux_loss.item() > 0
    moe.aux_loss.backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0
    assert moe.experts.w1.grad is None


def test_balance_loss_is_one_when_uniform():
    """Switch loss E * sum f_e P_e = 1 when scores and choices are uniform."""
    moe = make_moe(num_experts=4, top_k=1, aux_loss_coeff=1.0)
    with torch.no_grad():
        moe.router.gate.weight.zero_()  # every score 1/E
    # Zero logits tie everywhere; biases spread the choices round-robin over experts.
    x = torch.randn(8, 16)
    moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0]))
    moe(x)
    counts = moe.last_stats["tokens_per_expert"].float()
    f = counts / counts.sum()
    torch.testing.assert_close(moe.aux_loss, 4 * (f * 0.25).sum())


def test_token_counts_accumulate_until_reset():
    moe = make_moe(capacity_factor=0.5)
    moe(torch.randn(16, 16))
    first = moe.tokens_per_expert.clone()
    dropped1 = moe.last_stats["num_dropped"]
    moe(torch.randn(16, 16))
    second = moe.last_stats["tokens_per_expert"]
    torch.testing.assert_close(moe.tokens_per_expert, first + second.float())
    assert moe.tokens_per_expert.sum() == 2 * 16 * 2  # routed, before drops
    assert moe.dropped_assignments.item() == dropped1 + moe.last_stats["num_dropped"]
    moe.reset_token_counts()
    assert moe.tokens_per_expert.sum() == 0 and moe.dropped_assignments.item() == 0


def test_stats_contents():
    moe = make_moe(num_experts=8)
    x = torch.randn(20, 16)
    moe(x)
    s = moe.last_stats
    assert s["num_tokens"] == 20 and s["num_dropped"] == 0
    assert int(s["tokens_per_expert"].sum()) == 40
    scores = (x @ moe.router.gate.weight.t()).softmax(-1)
    want = -(scores * scores.log()).sum(-1).mean()
    torch.testing.assert_close(torch.as_tensor(s["router_entropy"]).float(), want)
    assert 0 < float(s["router_entropy"]) <= math.log(8)
    assert int(s["num_nonfinite_inputs"]) == 0


def test_timer_hook_sees_every_section():
    moe = make_moe(num_shared_experts=1)
    seen = []

    class Section:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            seen.append(self.name)

        def __exit__(self, *exc):
            return False

    moe.timer = Section
    moe(torch.randn(4, 16))
    assert seen == ["router", "dispatch", "experts", "combine"]


# ------------------------------------------------------------------ bad input

def test_wrong_last_dim():
    moe = make_moe()
    with pytest.raises(ValueError, match=r"input shape \(4, 15\) must end in moe.dim=16"):
        moe(torch.randn(4, 15))


def test_scalar_input():
    with pytest.raises(ValueError, match=r"input shape \(\) must end in moe.dim=16"):
        make_moe()(torch.tensor(1.0))


def test_integer_input():
    with pytest.raises(ValueError, match="dtype torch.int64 must be floating point"):
        make_moe()(torch.ones(4, 16, dtype=torch.long))


def test_dtype_mismatch():
    moe = make_moe()
    with pytest.raises(ValueError, match=r"torch.bfloat16 differs from the parameters' torch.float32"):
        moe(torch.randn(4, 16, dtype=torch.bfloat16))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="expects a torch.Tensor, got list"):
        make_moe()([[0.0] * 16])


def test_config_of_wrong_type():
    with pytest.raises(TypeError, match="MoE expects an epscale.MoEConfig, got dict"):
        MoE({"dim": 16})


def test_nan_raises_in_debug_mode():
    moe = make_moe(debug=True)
    x = torch.randn(2, 3, 16)
    x[1, 2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite input value at index \[1, 2, 5\]"):
        moe(x)


def test_nan_counted_otherwise():
    moe = make_moe()
    x = torch.randn(6, 16)
    x[2, 3] = float("nan")
    x[4, 0] = float("inf")
    y = moe(x)
    assert int(moe.last_stats["num_nonfinite_inputs"]) == 2
    assert int(moe.last_stats["num_nonfinite_tokens"]) == 2
    assert torch.isfinite(y[[0, 1, 3, 5]]).all()


def test_grouped_experts_inconsistent_counts():
    experts = GroupedExperts(4, 8, 16)
    with pytest.raises(ValueError, match=r"tokens_per_expert has 4 entries summing to 5; "
                                         r"expected 4 local experts and 6 rows"):
        experts(torch.randn(6, 8), torch.tensor([1, 2, 2, 0]))
    with pytest.raises(ValueError, match="has 3 entries"):
        experts(torch.randn(6, 8), torch.tensor([1, 2, 3]))


def test_count_ids_without_bincount_matches_bincount():
    """The accelerator form of count_ids (no host sync) counts what bincount counts, ids
    that never occur and the last id included."""
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    ids = torch.randint(0, 9, (7, 5), generator=g)
    ids[0, 0] = 11  # the last id of n = 12; 9 and 10 never occur
    want = torch.bincount(ids.reshape(-1), minlength=12)
    assert torch.equal(index_add_counts(ids.reshape(-1), 12), want)
    assert torch.equal(count_ids(ids, 12), want)
    assert count_ids(ids[:0], 3).tolist() == [0, 0, 0]


@pytest.mark.parametrize("moe_act", [False, True])
def test_split_backward_computes_each_gradient_once(moe_act, monkeypatch):
    """The zero-bubble and V pipeline schedules split a stage's backward in two parts
    over one graph: the inputs' gradients, then the weights' (torch's own
    ``stage_backward_input`` / ``stage_backward_weight``). The experts' grouped GEMMs,
    the moe_act step and the router's fp32 product are custom autograd functions: each
    part computes only its own gradients (as many grouped GEMMs in both parts together as
    in one plain backward, not twice as many), and the gradients are the plain ones."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    import epscale

    torch.manual_seed(0)
    cfg = epscale.MoEConfig(dim=32, hidden_dim=16, num_experts=4, top_k=2,
                            experts_impl="grouped_mm")
    moe = epscale.MoE(cfg)
    moe.experts.recompute_activation = moe_act
    x = torch.randn(24, 32, requires_grad=True)
    g = torch.randn(24, 32)
    params = list(moe.parameters())
    calls = []
    grouped_mm = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm",
                        lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))

    def backward_gemms(run):
        y = moe(x) * 1.0           # a stage output of its own (torch detaches it in place)
        del calls[:]
        run(y)
        return len(calls)

    plain = backward_gemms(lambda y: y.backward(g))
    want = [x.grad.clone()] + [p.grad.clone() for p in params]
    x.grad = None
    moe.zero_grad(set_to_none=True)
    parts = {}

    def split(y):
        (dx,), groups = stage_backward_input([y], [g], [x], iter(params))
        parts["input"] = len(calls)
        stage_backward_weight(iter(params), groups)
        x.grad = dx
    total = backward_gemms(split)
    assert plain == 6 and total == plain and parts["input"] == 3, (plain, total, parts)
    got = [x.grad] + [p.grad for p in params]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
