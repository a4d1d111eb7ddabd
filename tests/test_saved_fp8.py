"""fp8 storage of saved activations (``train.activation_storage: fp8``,
:mod:`epscale.moe.saved_fp8`): the 1 x 128 tile quantizer's rounding bound, the store's
rules (only marked tensors, each copied once, the original freed), and the config's
refusals. Memory against the estimate: tests/test_memory.py; training against one
process and against compute-dtype storage: tests/test_light_memory.py."""

from __future__ import annotations

import pytest
import torch

from epscale.moe.saved_fp8 import FP8_DTYPE, Fp8Storage, quantize, stored_bytes

pytestmark = pytest.mark.skipif(FP8_DTYPE is None, reason="this torch has no float8_e4m3fn")


@pytest.mark.parametrize("shape", [(7, 256), (5, 200), (3, 4, 64), (2, 1)])
def test_round_trip_is_within_e4m3_rounding_of_each_tile(shape):
    """Each value comes back within 2^-4 of itself (3 mantissa bits: half a step is 2^-4
    of the value at most) or within the tile's subnormal step near zero; a tile of zeros
    stays zero; the bytes are the payload plus one fp32 per tile."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * torch.logspace(
        -3, 3, shape[-1], dtype=torch.float64)
    x[0] = 0.0
    saved = quantize(x)
    back = saved.restore()
    assert back.dtype == x.dtype and back.shape == x.shape
    C = shape[-1]
    tiles = x.reshape(-1, C).split(128, dim=1)
    amax = torch.cat([t.abs().amax(1, keepdim=True).expand_as(t) for t in tiles], 1).view(shape)
    bound = x.abs() * 2.0 ** -4 + amax / 448 * 2.0 ** -9
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert (back.reshape(-1, C)[0] == 0).all()
    N = x.numel() // C
    assert saved.nbytes == stored_bytes(N, C) == N * C + 4 * N * (-(-C // 128))


def test_only_marked_tensors_are_stored_once_and_restored():
    """Two operations saving one marked tensor share its one fp8 copy; an unmarked saved
    tensor is kept as it is; outside a region marks are ignored. The gradient through
    the restored copy is the rounded one."""
    store = Fp8Storage()
    g = torch.Generator().manual_seed(1)
    a = torch.randn(16, 128, generator=g, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(128, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(128, 8, generator=g, dtype=torch.float64, requires_grad=True)
    packed = []
    with store.region():
        x = a * 1.0
        store.mark(x)
        out = (x @ w1).sum() + (x @ w2).sum()
        packed = list(store._copies.values())
    assert len(packed) == 1 and packed[0].q_NC.dtype == FP8_DTYPE
    out.backward()
    xq = packed[0].restore()
    assert torch.equal(w1.grad, xq.t() @ torch.ones(16, 8, dtype=torch.float64))
    assert not torch.equal(w1.grad, x.detach().t() @ torch.ones(16, 8, dtype=torch.float64))
    ref = torch.ones(16, 8, dtype=torch.float64) @ (w1 + w2).detach().t()
    assert torch.allclose(a.grad, ref, rtol=1e-12, atol=0)        # w: unmarked, as it was
    store.mark(x)                                                  # no region: ignored
    assert not store._marked and not store._copies


def test_held_tensors_give_their_memory_back_until_the_output_gradient():
    """:meth:`Fp8Storage.hold` on the GPU flash kernel's layout (the kernel's output
    [B, H, S, h] written as [B, S, H, h], the output projection's input a view of it): one
    fp8 copy for the shared memory, quantized per head's h channels (the storage's last
    dim), the memory given back when the region's forward ends and refilled with the
    rounded values when the output's gradient arrives, the version unchanged (autograd's
    check passes); a tensor that does not have its storage to itself (a slice) and a name
    not in ``held`` are not held; nothing outside a region."""
    B, S, H, h, D = 2, 3, 2, 64, 8
    g = torch.Generator().manual_seed(2)
    base = torch.randn(B, S, H, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(H * h, D, generator=g, dtype=torch.float64, requires_grad=True)
    store = Fp8Storage(("kernel_out", "proj_input"))
    with store.region():
        o_BHSh = (base * 1.0).transpose(1, 2)
        o_BSD = o_BHSh.transpose(1, 2).reshape(B, S, H * h)
        assert o_BSD.untyped_storage().data_ptr() == o_BHSh.untyped_storage().data_ptr()
        part = (base * 2.0)[:, :, 0]
        store.hold(kernel_out=o_BHSh, proj_input=o_BSD, other=base * 3.0)
        store.hold(proj_input=part)
        assert len(store._held) == 1
        out = o_BSD @ w + part.sum()
        store.swap(out)
    assert o_BSD.untyped_storage().nbytes() == 0 and part.untyped_storage().nbytes() > 0
    expected = quantize(base.detach()).restore().reshape(B * S, H * h)
    out.sum().backward()
    assert o_BSD.untyped_storage().nbytes() == o_BSD.numel() * 8
    assert torch.equal(o_BSD.detach().reshape(B * S, H * h), expected)
    assert torch.equal(w.grad, expected.t() @ torch.ones(B * S, D, dtype=torch.float64))
    store.hold(kernel_out=o_BHSh)                                  # no region: ignored
    assert not store._held


def test_fp8_storage_is_validated_by_key(tmp_path):
    from epscale.config import ConfigError
    from test_train import tiny_cfg

    with pytest.raises(ConfigError, match=r"train.activation_storage' = 'fp8' is invalid: "
                                          r"cannot be combined with train.activation_checkpointing"
                                          r" = 'full'"):
        tiny_cfg(tmp_path, **{"train.activation_storage": "fp8",
                              "train.activation_checkpointing": "full"})
    with pytest.raises(ConfigError, match=r"needs the grouped-GEMM experts.*cpu_fused"):
        tiny_cfg(tmp_path, **{"train.activation_storage": "fp8", "moe.experts_impl": "cpu_fused"})
    with pytest.raises(ConfigError, match=r"train.compile = true"):
        tiny_cfg(tmp_path, **{"train.activation_storage": "fp8", "train.compile": True})
    with pytest.raises(ConfigError, match=r"activation_storage' = 'fp4'.*'compute', 'fp8'"):
        tiny_cfg(tmp_path, **{"train.activation_storage": "fp4"})
    cfg = tiny_cfg(tmp_path, **{"train.activation_storage": "fp8",
                                "train.recompute_modules": "[moe_act]"})
    assert cfg.train.activation_storage == "fp8"


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_moe_act_keeps_the_gradients_on_the_loop_path(activation):
    """moe_act (the activation recomputed from its kept inputs) on the per-expert loop
    (moe.use_grouped_mm: never; the grouped-GEMM path is tests/test_memory.py's): the
    gradients are those without recomputation. The gate weights then scale the activation
    before the down projection instead of the output after it (the same function in
    another order of roundings): compared in float64, to 1e-6 of the largest gradient (the
    router keeps its scores and weights in fp32 in a float64 model, so the weights'
    gradient is rounded to fp32, 2^-24 relative, in both orders; seen: under 3e-7)."""
    from epscale.config import load_config
    from epscale.model import build_model
    from epscale.parallel.activation import apply_activation_checkpointing

    cfg = load_config(None, ["model.dim=32", "model.num_layers=2", "model.num_heads=2",
                             "model.seq_len=16", "model.vocab_size=64", "moe.hidden_dim=24",
                             "moe.num_experts=4", "moe.top_k=2", "moe.experts_impl=grouped_mm",
                             "moe.use_grouped_mm=never", f"moe.activation={activation}"])
    torch.manual_seed(0)
    net = build_model(cfg).double()
    assert net.moe_layers() and not any(m.experts.use_grouped_mm for m in net.moe_layers())
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (2, 16), generator=g) for _ in range(2))
    grads = []
    for mods in ([], ["moe_act"]):
        apply_activation_checkpointing(net, "none", mods)
        (net.loss(x, y) + net.aux_loss()).backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        net.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        scale = grads[0][n].abs().max().item()
        assert scale > 0, n
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-6, atol=1e-6 * scale), n


@pytest.mark.parametrize("use_grouped_mm", ["auto", "never"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_moe_act_gradients_bitwise_without_weights_and_weighted_in_float64(activation,
                                                                           use_grouped_mm):
    """The experts under moe_act: without gate weights, output and gradients are those
    without recomputation bit for bit (fp32); with the rows' gate weights applied to the
    activation (takes_gate_weights), those of the unweighted experts times the weights,
    the weights' gradient included, in float64 to 1e-12 of the largest value."""
    from epscale.moe.experts import GroupedExperts

    torch.manual_seed(0)
    counts_e = torch.tensor([3, 0, 5, 2])
    for dtype in (torch.float32, torch.float64):
        ex = GroupedExperts(4, 16, 8, activation, use_grouped_mm, "grouped_mm").to(dtype)
        x = torch.randn(10, 16, dtype=dtype, requires_grad=True)
        w_R = torch.rand(10, dtype=dtype, requires_grad=True)
        g = torch.randn(10, 16, dtype=dtype)
        outs = []
        for recompute, weighted in ((False, False), (True, False), (True, True)):
            ex.recompute_activation = recompute
            assert ex.takes_gate_weights(x) == recompute
            y = ex(x, counts_e, w_R) if weighted else ex(x, counts_e) * w_R.unsqueeze(1)
            outs.append([y, *torch.autograd.grad(y, [x, w_R, *ex.parameters()], g)])
        if dtype == torch.float32:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
        else:
            for a, b in zip(outs[0], outs[2]):
                assert torch.allclose(a, b, rtol=1e-10, atol=1e-12 * a.abs().max().item())
    ex.recompute_activation = False
    with pytest.raises(ValueError, match="takes_gate_weights"):
        ex(x, counts_e, w_R)


ATTENTION = {"mha": [], "mla": ["model.attention=mla", "model.q_lora_rank=16",
                                "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
                                "model.qk_rope_head_dim=8", "model.v_head_dim=16"]}


def _attention_step(net, x, y, capture: dict):
    """Loss and gradients of one step; ``capture``: the first block attention's output
    (its gradient kept) and its output projection's first input (the tensor and a copy)."""
    attn = net.layers["0"].attention
    seen = {}

    def out_hook(_, __, out):
        out.retain_grad()
        seen["out"] = out

    def in_hook(_, args):
        if "o" not in seen:          # the first forward (mla_up_proj rebuilds it in backward)
            seen["o"], seen["o_copy"] = args[0], args[0].detach().clone()
    handles = [attn.register_forward_hook(out_hook), attn.wo.register_forward_pre_hook(in_hook)]
    try:
        loss = net.loss(x, y) + net.aux_loss()
        capture["o_bytes_after_forward"] = seen["o"].untyped_storage().nbytes()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    capture.update(seen)
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    return loss.item(), grads


@pytest.mark.parametrize("case", ["mha", "mla", "mla mla_up_proj", "mha attention_core"])
def test_attention_output_is_held_in_fp8_until_backward(case):
    """fp8 storage of the attention (the input of the Linear after the attention kernel,
    DeepSeek-V3 section 3.3, and the kernel's output): without attention recomputation the
    output projection's input has given its memory back when the forward ends; backward
    reads it rounded: the projection's weight gradient is the output gradient times the
    round trip of its input, per tile of its H*v channels (under mla_up_proj: of the
    kernel's output, per head's v channels, the tensor the region caches), in float64
    within fp32 summation error, and not the unrounded one. The loss is compute-dtype
    storage's exactly (storage changes only what backward reads); every gradient is within
    2^-4 of compute storage's in norm (each value backward reads is within 2^-4 of its own
    and the gradients are linear in them; measured: up to 3%, the roundings partly cancel).
    Under attention_core nothing is held (the kernel runs again; the dense FFN behind it
    is still stored in fp8)."""
    from epscale.config import load_config
    from epscale.model import build_model
    from epscale.parallel.activation import apply_activation_checkpointing, apply_activation_storage

    kind, _, mods = case.partition(" ")
    cfg = load_config(None, ["model.dim=32", "model.num_layers=1", "model.num_heads=2",
                             "model.seq_len=16", "model.vocab_size=64", "moe.hidden_dim=24",
                             "model.num_dense_layers=1", "moe.experts_impl=grouped_mm"]
                      + ATTENTION[kind])
    torch.manual_seed(0)
    net = build_model(cfg)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (2, 16), generator=g) for _ in range(2))
    runs = {}
    for storage in ("compute", "fp8"):
        apply_activation_checkpointing(net, "none", [mods] if mods else [])
        apply_activation_storage(net, storage)
        cap = {}
        runs[storage] = (*_attention_step(net, x, y, cap), cap)
    (loss, grads, _), (loss8, grads8, cap) = runs["compute"], runs["fp8"]
    assert loss8 == loss
    for n, grad in grads.items():
        err = (grads8[n] - grad).double().norm()
        assert err <= 2.0 ** -4 * grad.double().norm(), (n, err)
    if mods == "attention_core":
        assert net.layers["0"].attention.fp8_storage is None
        assert cap["o_bytes_after_forward"] > 0
        return
    o = cap["o_copy"]
    B, S, HV = o.shape
    if mods == "mla_up_proj":
        H = cfg.model.num_heads
        kernel_out = o.view(B, S, H, HV // H).transpose(1, 2).contiguous()
        rounded = quantize(kernel_out).restore().transpose(1, 2).reshape(B, S, HV)
    else:
        assert cap["o_bytes_after_forward"] == 0
        rounded = quantize(o).restore()
    g_out = cap["out"].grad.reshape(B * S, -1).double()
    wo = grads8["layers.0.attention.wo.weight"].double()
    assert torch.allclose(wo, g_out.t() @ rounded.reshape(B * S, HV).double(), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(wo, g_out.t() @ o.reshape(B * S, HV).double(), rtol=1e-3, atol=0)
