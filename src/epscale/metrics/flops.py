"""Peak device FLOP/s and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per process / peak FLOP/s of one device. The model FLOPs per
token come from ``epscale.plan.sizing`` (forward + backward, active experts only, causal
attention).
"""

from __future__ import annotations

import os

import torch

from ..config import RunConfig
from ..plan.sizing import model_size

# Dense bf16 tensor-core peak FLOP/s (no sparsity) by device-name fragment; fp32 runs use
# the TF32 column. Unknown GPUs fall back to EPSCALE_PEAK_FLOPS or the A100 figures.
_GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    # name fragment, bf16, tf32
    ("H200", 989e12, 494e12),
    ("H100", 989e12, 494e12),
    ("H800", 989e12, 494e12),
    ("B200", 2250e12, 1100e12),
    ("A100", 312e12, 156e12),
    ("A800", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("A10", 125e12, 62.5e12),
)

# Nominal CPU peak: 32 fp32 FLOPs per cycle per core (two 8-wide FMA units) at 2.5 GHz.
CPU_FLOPS_PER_CORE = 32 * 2.5e9


def flops_per_token(cfg: RunConfig) -> float:
    """Training FLOPs (forward + backward) per token of ``cfg``'s model: the count of
    ``epscale.plan.sizing.model_size`` (active matmul weights, causal attention)."""
    return float(model_size(cfg).flops_per_token)


def peak_flops(device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16) -> float:
    """Peak FLOP/s of one device: ``EPSCALE_PEAK_FLOPS`` if set, a table of GPUs, or the
    nominal CPU figure ``cores x CPU_FLOPS_PER_CORE`` (cores = torch threads)."""
    env = os.environ.get("EPSCALE_PEAK_FLOPS")
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"EPSCALE_PEAK_FLOPS={env!r} is not a number (FLOP/s, e.g. 989e12)")
        if value > 0:
            return value
        raise ValueError(f"EPSCALE_PEAK_FLOPS={env!r} must be > 0")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev)
        for fragment, bf16, tf32 in _GPU_PEAKS:
            if fragment in name:
                return bf16 if dtype in (torch.bfloat16, torch.float16) else tf32
        return 312e12 if dtype in (torch.bfloat16, torch.float16) else 156e12
    return torch.get_num_threads() * CPU_FLOPS_PER_CORE


def mfu(tokens_per_s_per_proc: float, flops_per_token_: float, peak_flops_: float) -> float:
    """Model FLOPs utilisation in [0, 1+] (0.0 when either FLOP figure is unknown)."""
    if not (flops_per_token_ > 0 and peak_flops_ > 0):
        return 0.0
    return tokens_per_s_per_proc * flops_per_token_ / peak_flops_
