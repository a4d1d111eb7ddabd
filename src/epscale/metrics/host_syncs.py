"""Counting the calls that make the host wait for the device, on any device.

A host synchronisation on CUDA stalls the launch queue: the host waits until the device
has run everything queued so far. :class:`HostSyncCounter` records each call that would
do that while it is active, on CPU tensors as on CUDA ones, so that a step's syncs can be
counted without a GPU (on the code path CUDA takes: see
:func:`epscale.ops.device_code_path`) and, on a GPU, by the same rules.

It sees two levels:

* tensor methods and factories, patched on the classes while counting (so that what
  backward and recomputation run, on autograd's threads, is seen too): ``Tensor.tolist``
  / ``item`` / ``cpu`` / ``numpy`` (one sync each, whatever ops run inside them), and
  host data turned into a device tensor (``torch.tensor`` / ``as_tensor`` with a device,
  ``Tensor.new_tensor``: a copy from pageable memory, which the host waits for);
* aten ops, through a ``TorchDispatchMode``: ``_local_scalar_dense`` (``bool()``,
  ``int()`` of a tensor), ops whose CUDA kernels size their output on the host
  (``nonzero``, ``unique``, ``masked_select``, indexing with a bool mask,
  ``repeat_interleave`` without ``output_size``, ``bincount``, ``equal``) and copies
  between the host and a device.

Each event is (what, where): ``where`` is the innermost frame inside the epscale package
(a path relative to it, with the line and function), or 'outside epscale'. The counter
is a measuring tool (tests and ``benchmarks/gpu_check.py``), not for training runs: the
dispatch mode slows every op.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# ops whose CUDA implementation reads device values on the host to size its output
SYNC_OPS = frozenset({aten._local_scalar_dense, aten.nonzero, aten.unique_dim, aten._unique,
                      aten._unique2, aten.unique_consecutive, aten.unique_dim_consecutive,
                      aten.masked_select, aten.bincount, aten.equal})
INDEX_OPS = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
COPY_OPS = frozenset({aten._to_copy, aten.copy_})

# the package directory (a checkout may itself sit in a folder named epscale)
PACKAGE_DIR = str(Path(__file__).resolve().parents[1]) + "/"


def where_in_package() -> str:
    """The innermost frame of the epscale package on the current stack, as
    'path/inside/package.py:LINE function', or 'outside epscale'."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        filename = str(Path(frame.filename).resolve())
        if filename.startswith(PACKAGE_DIR) and not filename.endswith("metrics/host_syncs.py"):
            return f"{filename[len(PACKAGE_DIR):]}:{frame.lineno} {frame.name}"
    return "outside epscale"


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def _host_data(name: str) -> Callable:
    def what(data, *args, device=None, **kwargs):
        if device is not None and not isinstance(data, torch.Tensor):
            return f"{name}(host data, device=...)"
        return None
    return what


def _always(name: str) -> Callable:
    return lambda *args, **kwargs: name


# (owner, attribute, what it syncs given the call's arguments, or None for no sync)
PATCHES: list[tuple[object, str, Callable]] = (
    [(torch.Tensor, m, _always(m)) for m in ("tolist", "item", "cpu", "numpy")]
    + [(torch, "tensor", _host_data("tensor")), (torch, "as_tensor", _host_data("as_tensor")),
       (torch.Tensor, "new_tensor",
        lambda self, data, *a, **k: None if isinstance(data, torch.Tensor)
        else "new_tensor(host data)")])


def touches_device(args, kwargs) -> bool:
    """Whether a call involves a tensor (or a ``device=``) off the CPU: reading a CPU
    tensor on the host waits for no device."""
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu":
            return True
    device = kwargs.get("device")
    return device is not None and torch.device(device).type != "cpu"


class _OpWatch(TorchDispatchMode):
    def __init__(self, counter: "HostSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        if not c.inside and (c.count_cpu or touches_device(args, kwargs)):
            name = op_sync(func, args, kwargs)
            if name is not None:
                c.record(name)
        return func(*args, **kwargs)


def op_sync(func, args, kwargs) -> str | None:
    """What an aten call synchronises on CUDA, or None."""
    packet = func.overloadpacket
    if packet in SYNC_OPS:
        return str(packet.__name__)
    if (packet is aten.repeat_interleave and kwargs.get("output_size") is None
            and func is not aten.repeat_interleave.self_int):  # int repeats: sized on the host
        return "repeat_interleave without output_size"
    if packet in INDEX_OPS and _bool_index(args[1] if len(args) > 1 else None):
        return f"{packet.__name__} with a bool mask"
    if packet in COPY_OPS:  # between the host and a device: only with a real device
        src = args[1] if packet is aten.copy_ else args[0]
        dst = args[0].device if packet is aten.copy_ else kwargs.get("device")
        non_blocking = (args[2] if packet is aten.copy_ and len(args) > 2
                        else kwargs.get("non_blocking", False))
        if isinstance(src, torch.Tensor):
            dst = torch.device(dst) if dst is not None else src.device
            pinned_upload = (src.device.type == "cpu" and non_blocking and src.is_pinned())
            if dst.type != src.device.type and not pinned_upload:
                return f"copy {src.device.type} -> {dst.type}"
    return None


class HostSyncCounter:
    """``with HostSyncCounter() as c: ...``: ``c.events`` lists (what, where) of every call
    that synchronises on CUDA, in forward, backward and recomputation alike. Not
    re-entrant; one at a time per process (it patches torch's classes).

    ``count_cpu``: count calls on CPU tensors too, the stand-in for device tensors when
    counting on CPU; on a GPU pass False, so that host reads of CPU tensors (AdamW's step
    counters, host lists) are not taken for syncs."""

    def __init__(self, count_cpu: bool = True):
        self.count_cpu = count_cpu
        self.events: list[tuple[str, str]] = []
        self.inside = 0   # > 0 inside a patched call: the ops it runs are part of it
        self._mode = _OpWatch(self)
        self._saved: list = []

    def record(self, what: str) -> None:
        self.events.append((what, where_in_package()))

    def _wrap(self, fn: Callable, what: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            name = what(*args, **kwargs)
            if name is None or self.inside or not (self.count_cpu or touches_device(args, kwargs)):
                return fn(*args, **kwargs)
            self.record(name)
            self.inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside -= 1
        return wrapper

    def __enter__(self) -> "HostSyncCounter":
        for owner, name, what in PATCHES:
            orig = getattr(owner, name)
            self._saved.append((owner, name, orig))
            setattr(owner, name, self._wrap(orig, what))
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)
        self._saved.clear()



def by_place(events: list[tuple[str, str]]) -> dict[str, int]:
    """How many of ``events`` each 'what at where' made, most first."""
    out: dict[str, int] = {}
    for what, where in events:
        key = f"{what} at {where}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
