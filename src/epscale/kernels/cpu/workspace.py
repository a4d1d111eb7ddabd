"""Large buffers kept from step to step (see :class:`Workspace`): the fused expert
kernel's, and the dispatchers' row buffers."""

from __future__ import annotations

import threading

import torch


_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Workspace:
    """Large buffers one owner keeps from step to step. The CPU expert kernel: the weight
    gradients, the saved [R, F] pre-activations and, in row mode, one [R, D] buffer for
    the output (consumed by the caller's combine) and later the input gradient. A
    dispatcher that was handed one (``Dispatcher.workspace``): its gathered [R, D] rows
    and its combine's [R, D] gradient rows. Any owner calls ``take(name, shape, dtype,
    device)``.

    Why: on CPU a fresh buffer of tens of MB is mmap'ed and page-faulted in on every
    step (glibc serves allocations above 32 MB with mmap and unmaps them on free), kernel
    time that was a visible share of the step (benchmarks/RESULTS.md). A buffer is handed
    out again only when nothing but this workspace still references its storage (the
    storage's use count), i.e. after ``zero_grad(set_to_none=True)`` dropped the previous
    gradient and the previous backward released its saved tensors. Otherwise (gradient
    accumulation, ``retain_graph``, a caller holding on to a gradient) a fresh buffer is
    allocated, exactly as without a workspace. Memory: the cached buffers stay allocated
    between steps (like gradients kept by ``zero_grad(set_to_none=False)``).

    CPU only: on an accelerator ``take`` always allocates. Its caching allocator already
    reuses freed memory without page faults, and a buffer kept per layer there would only
    hold memory that other layers' transient buffers could have used (one [R, D] rows
    buffer per MoE layer and step, for instance).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._store: dict[str, torch.UntypedStorage] = {}

    @staticmethod
    def _free(s: torch.UntypedStorage) -> bool:
        return _use_count is not None and _use_count(s._cdata) == 1  # only our reference

    def take(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of ``shape``, reusing the cached storage when it is free."""
        shape = torch.Size(shape)
        if torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            s = self._store.get(name)
            free = s is not None and self._free(s)
            if not (free and s.device == device and s.nbytes() >= nbytes):
                fresh = torch.UntypedStorage(nbytes, device=device)
                if _use_count is not None and (s is None or free):
                    self._store[name] = fresh
                s = fresh
            # the same two operators whether the storage is reused or fresh: a selective
            # checkpoint replays a region's operators in order, and whether a buffer is
            # free may differ between the forward and its recomputation (with paired
            # micro-batches the other one's backward may still hold it)
            return torch.empty(0, dtype=dtype, device=device).set_(s, 0, shape)

    def clear(self) -> None:
        with self._lock:
            self._store.clear()

    # Copies and pickles of a module start with an empty workspace (it is a cache).
    def __deepcopy__(self, memo):
        return Workspace()

    def __reduce__(self):
        return (Workspace, ())

    def __repr__(self) -> str:
        mb = sum(s.nbytes() for s in self._store.values()) / 2 ** 20
        return f"Workspace({len(self._store)} buffers, {mb:.0f} MB)"


def take_fresh(name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)
