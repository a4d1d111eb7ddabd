"""AdamW's kernel choice and its pre-created state: CUDA runs the fused kernel, whose step
count lives on the parameter's device; the state that ``ensure_optimizer_state`` creates
before the first step (so that a checkpoint has every entry) must be what that kernel
would have created itself. The fused kernel also runs on CPU, which lets this be checked
here, and benchmarks/gpu_check.sh runs this file on the GPU."""

from __future__ import annotations

import pytest
import torch

from epscale.training.optim import adamw_kernel, ensure_optimizer_state


def test_cuda_runs_fused_adamw_and_the_cpu_keeps_its_default():
    assert adamw_kernel(torch.device("cuda", 0)) == {"fused": True}
    assert adamw_kernel(torch.device("cpu")) == {}


def _params() -> list[torch.nn.Parameter]:
    """On the default device: the GPU under benchmarks/gpu_check.sh (where the step count's
    device is the point), the CPU here, and benchmarks/gpu_check.sh runs this file on the GPU."""
    return [torch.nn.Parameter(torch.linspace(-1, 1, 12).reshape(4, 3)),
            torch.nn.Parameter(torch.linspace(0.5, 2, 5))]


def _steps(opt: torch.optim.AdamW, params, n: int = 3) -> None:
    for i in range(n):
        for j, p in enumerate(params):
            p.grad = torch.full_like(p, 0.1 * (i + 1) * (j + 1))
        opt.step()


def test_precreated_state_steps_like_the_fused_kernels_own():
    fresh, pre = _params(), _params()
    opt_fresh = torch.optim.AdamW(fresh, lr=1e-2, fused=True)
    opt_pre = torch.optim.AdamW(pre, lr=1e-2, fused=True)
    ensure_optimizer_state(opt_pre)
    for p in pre:  # where and how the fused kernel keeps the count
        assert opt_pre.state[p]["step"].device == p.device
        assert opt_pre.state[p]["step"].dtype == torch.float32
    _steps(opt_fresh, fresh)
    _steps(opt_pre, pre)
    for a, b in zip(fresh, pre):
        assert torch.equal(a, b)
    for a, b in zip(fresh, pre):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_fresh.state[a][key], opt_pre.state[b][key]), key


# ---------------------------------------------------------------- bf16 moments

def _tiny(*over):
    from epscale.config import load_config

    return load_config(None, ["model.dim=32", "model.num_layers=2", "model.num_heads=2",
                              "model.seq_len=32", "model.vocab_size=64", "moe.hidden_dim=32",
                              "moe.num_experts=4", "moe.top_k=2", "train.warmup_steps=20",
                              "train.steps=300", "train.lr=3e-3", *over])


def _train_losses(state_dtype: str, steps: int) -> list[float]:
    """Losses of ``steps`` AdamW steps on a tiny model learning 16 fixed sequences."""
    from epscale.model import build_model
    from epscale.training.optim import build_optimizer, lr_at, set_lr

    cfg = _tiny(f"train.optimizer_state_dtype={state_dtype}")
    model = build_model(cfg, seed=0)
    opt = build_optimizer(model, cfg.train)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (16, 33), generator=g)
    losses = []
    for step in range(1, steps + 1):
        rows = data[torch.randint(0, 16, (4,), generator=g)]
        loss = model.loss(rows[:, :-1], rows[:, 1:]) + model.aux_loss()
        loss.backward()
        set_lr(opt, lr_at(step, cfg.train))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_bf16_moments_step_is_torchs_fp32_update_rounded():
    """Each step: torch's own AdamW update on the moments upcast to fp32, then the moments
    rounded to bf16; the fp32 weights take the update exactly. Also in chunks smaller than
    one tensor's neighbours (UPCAST_CHUNK)."""
    from epscale.training import optim

    for chunk in (optim.UPCAST_CHUNK, 5):
        ours, ref = _params(), _params()
        opt = optim.AdamW(ours, state_dtype=torch.bfloat16, lr=1e-2, weight_decay=0.1)
        torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
        old, optim.UPCAST_CHUNK = optim.UPCAST_CHUNK, chunk
        try:
            for i in range(4):
                for j, (p, q) in enumerate(zip(ours, ref)):
                    p.grad = torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (i + j + 1)
                    q.grad = p.grad.clone()
                ensure_optimizer_state(opt)
                ensure_optimizer_state(torch_opt)
                for p, q in zip(ours, ref):   # the reference starts from our rounded moments
                    for key in ("exp_avg", "exp_avg_sq"):
                        torch_opt.state[q][key].copy_(opt.state[p][key].float())
                opt.step()
                torch_opt.step()
                for p, q in zip(ours, ref):
                    assert torch.equal(p, q)
                    for key in ("exp_avg", "exp_avg_sq"):
                        assert opt.state[p][key].dtype == torch.bfloat16
                        assert torch.equal(opt.state[p][key], torch_opt.state[q][key].bfloat16())
        finally:
            optim.UPCAST_CHUNK = old


def test_bf16_moments_train_like_fp32_moments():
    """200 steps of a tiny MoE learning 16 sequences (the loss falls from 4.1 to ~0.7):
    the loss curve with bf16 moments follows the fp32 one. Per-step losses are compared in
    windows of 25 steps: a moment rounded to bf16 is off by up to 2^-9 of itself, which
    moves an update by about as much; in a 2-layer top-2 MoE such a nudge flips some
    routing decisions after a few dozen steps, so single losses wander (up to ~25% late in
    training, the same as any other 0.2% perturbation of the update) while the averages
    stay within 2% (seen: 1.7%). 5% leaves room for other CPUs' summation orders and would
    still catch a moment that stalls or is mis-scaled (those stop the loss falling)."""
    fp32, bf16 = _train_losses("float32", 200), _train_losses("bfloat16", 200)
    assert fp32[0] == bf16[0]          # the first forward precedes any optimizer state
    assert fp32[-1] < fp32[0] / 4
    for i in range(0, 200, 25):
        a, b = sum(fp32[i:i + 25]) / 25, sum(bf16[i:i + 25]) / 25
        assert b == pytest.approx(a, rel=0.05), (i, a, b)


def test_optimizer_state_bytes_are_the_memory_models(tmp_path):
    """The estimate's optimizer bytes are the bytes of the moments AdamW holds, exactly,
    for both state dtypes (one process: the whole model)."""
    from epscale.metrics.held import state_bytes
    from epscale.model import build_model
    from epscale.plan.layout import Layout
    from epscale.plan.memory import estimate
    from epscale.training.optim import build_optimizer

    held = {}
    for dtype in ("float32", "bfloat16"):
        cfg = _tiny(f"train.optimizer_state_dtype={dtype}")
        model = build_model(cfg, seed=0)
        opt = build_optimizer(model, cfg.train)
        ensure_optimizer_state(opt)
        held[dtype] = state_bytes(model, opt)["optimizer"]
        assert held[dtype] == estimate(cfg, Layout.from_config(cfg, 1, ep=1)).optimizer
    assert held["bfloat16"] * 2 == held["float32"]


def test_bf16_moments_reject_betas_whose_decay_rounds_away():
    from epscale.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.beta2' = 0.999 is invalid.*bfloat16"):
        _tiny("train.optimizer_state_dtype=bfloat16", "train.beta2=0.999")
    with pytest.raises(ConfigError, match="train.optimizer_state_dtype' = 'fp16'"):
        _tiny("train.optimizer_state_dtype=fp16")
    _tiny("train.beta2=0.999")    # fp32 moments take any beta
