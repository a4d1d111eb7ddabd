"""The CPU fast path of the routed experts (``moe.experts_impl`` 'cpu_fused', which 'auto'
picks for CPU tensors): a chunked kernel with a hand-written backward, native C kernels
for its element-wise work, chunks run side by side on the CPU's threads, and large
buffers kept from step to step. Knobs: :class:`epscale.config.CpuKernelConfig`
(``moe.cpu``).

This package is the one seam: code outside it uses only the names below.
"""

from .chunk_workers import describe as describe_chunks
from .experts import HAS_GROUPED_MM, CpuFusedExperts, grouped_mm_fits
from .native import describe as describe_elementwise
from .workspace import Workspace

__all__ = ["CpuFusedExperts", "HAS_GROUPED_MM", "Workspace", "describe_chunks",
           "describe_elementwise", "grouped_mm_fits"]
