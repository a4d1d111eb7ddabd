"""AdamW's kernel choice and its pre-created state: CUDA runs the fused kernel, whose step
count lives on the parameter's device; the state that ``ensure_optimizer_state`` creates
before the first step (so that a checkpoint has every entry) must be what that kernel
would have created itself. The fused kernel also runs on CPU, which lets this be checked
here, and benchmarks/gpu_check.sh runs this file on the GPU."""

from __future__ import annotations

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
