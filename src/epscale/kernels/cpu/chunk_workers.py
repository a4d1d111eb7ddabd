"""The chunks of one fused expert call, side by side on the CPU's threads.

Why: torch splits every op of a chunk (its GEMMs, gathers, element-wise kernels) evenly
over the intra-op threads, and each op ends when its slowest thread does. On a shared
machine one thread is often slowed by a neighbour, and then every op runs at the pace of
the slow one. Here each thread runs whole chunks alone and takes the next chunk when it
is done, largest first, so a slowed thread just takes fewer. Chunks hold whole experts
and write disjoint rows and disjoint weight gradients: they need no synchronisation beyond
waiting for the last one (what it gains, quiet and loaded: benchmarks/RESULTS.md).

How: the native library's ``epscale_run_chunks`` (csrc/act_kernels.c) opens an OpenMP
parallel region, torch's own team, and each of its threads calls back into Python for its
chunks. Inside the region torch's ops and the element-wise kernels run on their calling
thread alone. A chunk runs under the caller's grad and inference modes.

Where it does not apply, :func:`choose_workers` returns 1 and the chunks run one after
another in the calling thread, each op over all threads: other devices, one intra-op
thread, no native library (or one built without OpenMP), a process with two OpenMP
runtimes (torch's would not see the team and split its ops anyway), and layouts where
one chunk holds so many of the rows that the others would wait for it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

import torch

from . import native

# Workers are used when the busiest one's rows (largest chunks first, each to the least
# loaded) are at most this factor above an even share: the worst end-of-call wait the
# split ops (which have none) are traded for.
MAX_IMBALANCE = 1.15


def longest_share(sizes: Sequence[int], workers: int) -> int:
    """Rows of the busiest of ``workers`` workers taking ``sizes`` largest first."""
    loads = [0] * workers
    for n in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += n
    return max(loads)


@functools.cache
def _one_openmp_runtime() -> bool:
    """Whether this process has loaded one OpenMP runtime only, so that the native
    library's team is torch's (Linux: the mapped libgomp / libiomp5 / libomp files)."""
    try:
        with open("/proc/self/maps") as maps:
            runtimes = {line.split()[-1] for line in maps
                        if re.search(r"/lib(gomp|iomp5|omp)[^/]*\.so", line)}
    except OSError:
        return False
    return len(runtimes) == 1


def _team_unavailable() -> str | None:
    """Why chunks cannot run on a team in this process (None: they can). Builds the native
    library if it is not built yet."""
    lib = native.BUILDER.get()
    if lib is None or not lib.openmp:
        return native.BUILDER.failed or "the native library was built without OpenMP"
    if not _one_openmp_runtime():
        return "two OpenMP runtimes are loaded; torch's would not see the team"
    return None


def choose_workers(device: torch.device, sizes: Sequence[int], requested: int | None = None) -> int:
    """How many threads should run chunks of ``sizes`` rows on ``device`` side by side:
    1 (one chunk at a time, each op over all intra-op threads) or up to torch's intra-op
    thread count. ``requested``: an upper bound (1 disables); None: torch's count."""
    threads = torch.get_num_threads()
    if requested is not None:
        threads = min(threads, requested)
    threads = min(threads, len(sizes))
    if device.type != "cpu" or threads < 2:
        return 1
    total = sum(sizes)
    if total == 0 or longest_share(sizes, threads) * threads > MAX_IMBALANCE * total:
        return 1
    return threads if _team_unavailable() is None else 1


def describe(device: torch.device | str) -> str:
    """One line for logs: how the fused kernel's chunks run on ``device`` with torch's
    current thread count."""
    if torch.device(device).type != "cpu":
        return "one after another (side by side is for CPU threads)"
    threads = torch.get_num_threads()
    if threads < 2:
        return "one after another (1 thread)"
    why = _team_unavailable()
    if why is not None:
        return f"one after another, each op over {threads} threads ({why})"
    return f"side by side, one chunk per thread on {threads} threads"


def run_chunks(fn: Callable[[int, int], None], sizes: Sequence[int], workers: int) -> None:
    """Call ``fn(chunk, worker)`` once for every chunk index of ``sizes`` (rows per
    chunk): in order in the calling thread when ``workers`` is 1 (worker 0), else on a
    team of ``workers`` threads, largest chunk first. ``worker`` in [0, workers) names the
    scratch buffers the chunk may use. The first exception of a chunk is raised here once
    the running chunks end; chunks not yet started are skipped."""
    if workers <= 1:
        for i in range(len(sizes)):
            fn(i, 0)
        return
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    errors: list[BaseException] = []

    def call(chunk: int, worker: int) -> int:
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                fn(chunk, worker)
            return 0
        except BaseException as e:  # noqa: BLE001 - raised in the caller below
            errors.append(e)
            return 1

    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    native.BUILDER.get().run_chunks(native.CHUNK_FN(call), order, workers)
    if errors:
        raise errors[0]
