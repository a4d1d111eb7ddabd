"""Native element-wise kernels of the fused expert kernel (``moe.cpu.elementwise='auto'``,
the default on CPU, or ``'native'``): ``csrc/act_kernels.c``, built with the system C
compiler on first use (well under a second) and loaded with ctypes.

Why not torch.compile: it fuses the same work as well (``moe.cpu.elementwise='inductor'``)
but takes many seconds to compile in a fresh process, too much for a default. The C file
needs no torch headers, so it builds in a fraction of a second, and the built library is
cached (``$EPSCALE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/epscale/kernels`` or
``~/.cache/epscale/kernels``) under a key of the source, the compiler, the flags and the
CPU, so a cache shared between unlike machines holds one build per machine kind. Processes that build at once (ranks of one job) each write a private file and
rename it into place.

Without a C compiler, or when the build or the load fails, ``get()`` returns None and the
fused kernel runs its eager ops: with one warning for ``'native'``, silently (a log line)
for ``'auto'``.

Legend: C rows of one chunk, F expert hidden dim.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "act_kernels.c"
ABI = 2  # epscale_act_kernels_abi() of the C file
# Flag sets tried in order: the first that builds wins. -march=native vectorises for the
# machine that builds (hence the CPU in the cache key); -fopenmp splits rows over threads.
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3",),
)
COMMON_FLAGS = ("-shared", "-fPIC", "-fno-math-errno")
DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
# int fn(int64 chunk, int worker): a chunk callback of epscale_run_chunks (chunk_workers.py).
CHUNK_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int)


def cache_dir() -> Path:
    """Where built kernels are kept: $EPSCALE_KERNEL_CACHE, else the user's cache
    directory, else (when that cannot be written) a private directory under the system's
    temporary directory."""
    if os.environ.get("EPSCALE_KERNEL_CACHE"):
        return Path(os.environ["EPSCALE_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = Path(base) / "epscale" / "kernels"
    if _writable_dir(home):
        return home
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    tmp = Path(tempfile.gettempdir()) / f"epscale-kernels-{uid}"
    # The library in it will be loaded into this process: accept only a directory this
    # user owns and nobody else can write to.
    if _writable_dir(tmp, mode=0o700):
        st = tmp.stat()
        if (not hasattr(os, "getuid") or st.st_uid == os.getuid()) and not st.st_mode & 0o022:
            return tmp
    return home  # unwritable: the build reports it


def _writable_dir(path: Path, mode: int = 0o777) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=mode)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def find_compiler() -> str | None:
    """$CC when set (None if it does not exist), else the first of cc, gcc, clang."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def _cpu_signature() -> str:
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    sig += "|" + line.strip()
    except OSError:
        sig += "|" + platform.processor()
    return sig


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return (out.stdout.splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError):
        return ""


class NativeKernels:
    """The loaded library: ``forward`` and ``backward`` write into the caller's buffers."""

    def __init__(self, lib: ctypes.CDLL, path: Path, flags: tuple[str, ...]):
        self.path, self.flags = path, flags
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fns = {}
        for act in ("swiglu", "gelu"):
            for dt, name in DTYPES.items():
                fwd = getattr(lib, f"{act}_{name}_fwd")
                fwd.argtypes, fwd.restype = [i64, i64, p, p, p, p, i32], None
                bwd = getattr(lib, f"{act}_{name}_bwd")
                bwd.argtypes, bwd.restype = [i64, i64, p, p, p, p, p, p, p, p, i32], None
                self._fns[(act, dt)] = (fwd, bwd)
        self._run_chunks = lib.epscale_run_chunks
        self._run_chunks.argtypes = [CHUNK_FN, ctypes.POINTER(i64), i64, i32]
        self._run_chunks.restype = i32
        lib.epscale_openmp.restype = i32
        self.openmp = bool(lib.epscale_openmp())  # False: run_chunks runs on one thread
        lib.epscale_vector_bf16.restype = i32
        self.vector_bf16 = bool(lib.epscale_vector_bf16())  # bf16 rows in AVX-512 BF16 loops

    def run_chunks(self, fn, order: list[int], workers: int) -> int:
        """Call ``fn(chunk, worker)`` (a :data:`CHUNK_FN`: returns 0, or nonzero to stop
        the others taking more) for each chunk index in ``order`` on a team of ``workers``
        OpenMP threads, each taking the next index. Returns the first nonzero status."""
        return self._run_chunks(fn, (ctypes.c_int64 * len(order))(*order), len(order), workers)

    @staticmethod
    def supports(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.dtype in DTYPES

    def forward(self, h1_CF: torch.Tensor, h3_CF: torch.Tensor | None, w_C: torch.Tensor | None,
                a_CF: torch.Tensor) -> torch.Tensor:
        """a = act(h1[, h3]) (times w per row when given) into ``a_CF``; returns it."""
        act = "swiglu" if h3_CF is not None else "gelu"
        _check(h1_CF, h3_CF, a_CF)
        fwd, _ = self._fns[(act, h1_CF.dtype)]
        w = _weights(w_C, h1_CF.shape[0])
        fwd(h1_CF.shape[0], h1_CF.shape[1], h1_CF.data_ptr(), _ptr(h3_CF), _ptr(w),
            a_CF.data_ptr(), torch.get_num_threads())
        return a_CF

    def backward(self, ga_CF, h1_CF, h3_CF, w_C, gw_C, aw_CF, gh1_CF, gh3_CF) -> None:
        """From dL/da (before the gate weight): the gate weight's gradient into ``gw_C``
        (fp32; None to skip), the weighted activation into ``aw_CF``, dL/dh1 into
        ``gh1_CF`` and, for SwiGLU, dL/dh3 into ``gh3_CF``."""
        act = "swiglu" if h3_CF is not None else "gelu"
        _check(ga_CF, h1_CF, h3_CF, aw_CF, gh1_CF, gh3_CF)
        _, bwd = self._fns[(act, h1_CF.dtype)]
        if gw_C is not None and (gw_C.dtype != torch.float32 or not gw_C.is_contiguous()
                                 or gw_C.shape != h1_CF.shape[:1]):
            raise ValueError(f"native kernels: gate-weight gradient must be a contiguous "
                             f"fp32 [{h1_CF.shape[0]}] tensor, got {gw_C.dtype} "
                             f"{tuple(gw_C.shape)}")
        w = _weights(w_C, h1_CF.shape[0])
        bwd(h1_CF.shape[0], h1_CF.shape[1], ga_CF.data_ptr(), h1_CF.data_ptr(), _ptr(h3_CF),
            _ptr(w), _ptr(gw_C), aw_CF.data_ptr(), gh1_CF.data_ptr(), _ptr(gh3_CF),
            torch.get_num_threads())


def _ptr(t: torch.Tensor | None):
    return t.data_ptr() if t is not None else None


def _weights(w_C: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The gate weights as the C code reads them: contiguous fp32, one per row."""
    if w_C is None:
        return None
    if w_C.device.type != "cpu" or tuple(w_C.shape) != (rows,):
        raise ValueError(f"native kernels: expected {rows} gate weights on CPU, got "
                         f"{w_C.device.type} {tuple(w_C.shape)}")
    return w_C.contiguous() if w_C.dtype == torch.float32 else w_C.float()


def _check(first: torch.Tensor, *others: torch.Tensor | None) -> None:
    """The C code reads raw row-major memory: every matrix must be a contiguous CPU tensor
    of the first one's shape and dtype, fp32 or bf16."""
    if first.dtype not in DTYPES:
        raise ValueError(f"native kernels: {first.dtype} is not supported (only "
                         f"{', '.join(map(str, DTYPES))}); use moe.cpu.elementwise=off")
    for t in (first, *others):
        if t is None:
            continue
        if (t.device.type != "cpu" or t.dtype != first.dtype or t.shape != first.shape
                or not t.is_contiguous()):
            raise ValueError(f"native kernels: expected contiguous CPU {first.dtype} "
                             f"{tuple(first.shape)} matrices, got {t.device.type} {t.dtype} "
                             f"{tuple(t.shape)} (contiguous={t.is_contiguous()})")


class _Builder:
    """Builds (or finds in the cache) and loads the library once per process."""

    def __init__(self):
        self._lock = threading.Lock()
        self.kernels: NativeKernels | None = None
        self.failed: str | None = None
        self.builds = 0  # compiler runs of this process (tests check the cache with it)

    def get(self) -> NativeKernels | None:
        if self.kernels is None and self.failed is None:
            with self._lock:
                if self.kernels is None and self.failed is None:
                    try:
                        self.kernels = self._load_or_build()
                    except _BuildError as e:
                        self.failed = str(e)
        return self.kernels

    def _load_or_build(self) -> NativeKernels:
        cc = find_compiler()
        if cc is None:
            raise _BuildError("no C compiler found (looked for $CC, cc, gcc, clang; "
                              "install gcc or set CC)")
        # Everything that decides the built code, except the flags (per attempt below).
        build_id = b"\0".join([SOURCE.read_bytes(), cc.encode(), _compiler_version(cc).encode(),
                               _cpu_signature().encode()])
        where = cache_dir()
        errors = []
        for flags in FLAG_SETS:
            key = hashlib.sha256(build_id + b"\0" + " ".join(flags + COMMON_FLAGS).encode())
            path = where / f"act_kernels-{key.hexdigest()[:20]}.so"
            if path.exists():
                lib = self._try_load(path)
                if lib is not None:
                    return NativeKernels(lib, path, flags)
                path.unlink(missing_ok=True)  # corrupt or foreign: build it again
            err = self._compile(cc, flags, path)
            if err is None:
                lib = self._try_load(path)
                if lib is not None:
                    return NativeKernels(lib, path, flags)
                err = f"built {path} but could not load it"
            errors.append(f"{' '.join(flags)}: {err}")
        raise _BuildError(f"could not build {SOURCE.name} with {cc}: " + " | ".join(errors))

    def _compile(self, cc: str, flags: tuple[str, ...], path: Path) -> str | None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
            os.close(fd)
        except OSError as e:
            return f"cannot write the kernel cache {path.parent}: {e} (set EPSCALE_KERNEL_CACHE)"
        try:
            self.builds += 1
            out = subprocess.run([cc, *flags, *COMMON_FLAGS, "-o", tmp, str(SOURCE)],
                                 capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                return (out.stderr.strip().splitlines() or ["exit %d" % out.returncode])[-1]
            os.replace(tmp, path)  # atomic: a concurrent builder sees a whole file or none
            return None
        except (OSError, subprocess.SubprocessError) as e:
            return f"{type(e).__name__}: {e}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @staticmethod
    def _try_load(path: Path) -> ctypes.CDLL | None:
        try:
            lib = ctypes.CDLL(str(path))
            lib.epscale_act_kernels_abi.restype = ctypes.c_int
            return lib if lib.epscale_act_kernels_abi() == ABI else None
        except (OSError, AttributeError):
            return None


class _BuildError(RuntimeError):
    pass


BUILDER = _Builder()
_warned: set[str] = set()  # modes already told that the build failed


def build_generic(where: Path) -> NativeKernels:
    """A second build of the kernels with ``-DEPSCALE_GENERIC_LOOPS``, into ``where``
    (not the cache): the compiler-vectorised loops for bf16 too, which CPUs without
    AVX-512 BF16 run. For the tests and benchmarks/cpu/act_kernels.py, which compare it with
    the default build."""
    cc = find_compiler()
    if cc is None:
        raise _BuildError("no C compiler found (looked for $CC, cc, gcc, clang)")
    flags = FLAG_SETS[0] + ("-DEPSCALE_GENERIC_LOOPS",)
    path = Path(where) / "act_kernels-generic.so"
    err = _Builder()._compile(cc, flags, path)
    lib = _Builder._try_load(path) if err is None else None
    if lib is None:
        raise _BuildError(f"could not build or load {path}: {err or 'wrong ABI'}")
    return NativeKernels(lib, path, flags)


def get(mode: str) -> NativeKernels | None:
    """The native kernels for ``moe.cpu.elementwise`` = ``mode`` ('auto' or 'native'), or
    None when they cannot be built: a warning (once) for 'native', a log line for 'auto'."""
    kernels = BUILDER.get()
    if kernels is None and mode not in _warned:
        _warned.add(mode)
        msg = f"moe.cpu.elementwise={mode!r}: running eager element-wise ops ({BUILDER.failed})"
        if mode == "native":
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        else:
            log.info(msg)
    return kernels


def describe(mode: str, device: torch.device | str) -> str:
    """One line for logs: what runs the fused experts' element-wise work under
    ``moe.cpu.elementwise`` = ``mode`` on ``device`` (builds the native kernels if they
    are not built yet)."""
    if mode == "off":
        return "eager torch ops (moe.cpu.elementwise=off)"
    if mode == "inductor":
        return "torch.compile (inductor) kernels, compiled on first use"
    if torch.device(device).type != "cpu":
        return "eager torch ops (the native kernels are CPU-only)"
    kernels = BUILDER.get()
    if kernels is None:
        return f"eager torch ops ({BUILDER.failed})"
    loops = "; bf16 in AVX-512 BF16 loops" if kernels.vector_bf16 else ""
    return f"native C kernels ({kernels.path.name}, {' '.join(kernels.flags)}{loops})"
