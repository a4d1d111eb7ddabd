"""``deepep``: an adapter to DeepEP's ``deep_ep.Buffer`` (CUDA + NVLink/RDMA only).

Choosing it where DeepEP or CUDA is missing fails with a message naming the fallback.
"""

from __future__ import annotations

import importlib.util

import torch

FALLBACK = "dedup"


def deepep_available() -> tuple[bool, str]:
    """(available, reason when not)."""
    if importlib.util.find_spec("deep_ep") is None:
        return False, "the deep_ep package is not installed"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    return True, ""


def require_deepep() -> None:
    ok, why = deepep_available()
    if not ok:
        raise RuntimeError(f"dispatcher 'deepep' cannot run here: {why}. Use dispatcher="
                           f"'{FALLBACK}', the portable implementation of the same algorithm "
                           "(DeepEP normal mode) over torch.distributed")
