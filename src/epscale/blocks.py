"""How many rows one block of a memory-bound pass takes (gathers, combines, the router's
fp32 widening), so that such passes never build one big temporary.

On CPU a block is cache-sized (1 MB): a fresh buffer of tens of MB is mmap'ed and
page-faulted in on every step, and a small one stays in cache between the ops of a
block. Accelerators have caching allocators and pay per kernel launch instead, so their
blocks are large (256 MB): few launches, yet bounded memory (a [T*K, D] gather of a
16k-token, top-8, D=7168 batch in bf16 would be 1.8 GB in one piece).
"""

from __future__ import annotations

import torch

CPU_BLOCK_BYTES = 1 << 20
ACCELERATOR_BLOCK_BYTES = 256 << 20


def rows_per_block(num_rows: int, row_bytes: int, device: torch.device) -> int:
    """Rows of ``row_bytes`` each in one block on ``device`` (at least 1, at most num_rows)."""
    budget = CPU_BLOCK_BYTES if device.type == "cpu" else ACCELERATOR_BLOCK_BYTES
    return max(1, min(num_rows, budget // max(1, row_bytes)))
