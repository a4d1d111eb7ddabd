"""Counting ids without a host synchronisation.

``torch.bincount`` on CUDA reads its input's minimum and maximum back to the host to size
its output: two synchronisations per call, each of which stalls the launch queue. The MoE
layer counts ids several times per step (tokens per expert for the dispatch, the
statistics, the balance losses): two such calls made four of the six synchronisations of
a layer's step on an H200 (benchmarks/RESULTS.md, GPU section). :func:`count_ids` is
given its output size, so it needs none.
"""

from __future__ import annotations

import torch


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: how often each of 0 .. n-1 occurs in ``ids`` (integer, any shape; every
    value must lie in [0, n)). torch.bincount on CPU, where it is fast and syncs nothing;
    an integer ``index_add_`` (exact, so deterministic) elsewhere."""
    flat = ids.reshape(-1)
    if flat.device.type == "cpu":
        return torch.bincount(flat, minlength=n)
    return index_add_counts(flat, n)


def index_add_counts(flat: torch.Tensor, n: int) -> torch.Tensor:
    """count_ids' accelerator form, on any device: ones added at each id."""
    ones = torch.ones_like(flat, dtype=torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=flat.device).index_add_(0, flat, ones)
