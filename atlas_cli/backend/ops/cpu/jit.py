"""How atlas sets numba up, once, before any fast-CPU kernel is compiled or loaded.

- Threads: TBB where the `tbb` wheel is installed, and `ATLAS_THREADS` as the pool size; both
  have to happen before numba is first imported.
- The disk cache: numba stamps a cached function with the contents (or, in older releases, the
  mtime) of its own source file only. The kernels span several files (the LLVM IR of the block
  formats in ir.py and of their integer dots in ir_int8.py, ir_int8_rows.py and ir_int16.py, the
  loops in kernels.py, gemv_int8.py and prefill.py, the chunked Gated DeltaNet in gdn.py, the
  fused decode steps in decode.py and blocks.py), and a change to a callee must
  recompile its callers, so their stamp covers all of them.
- Where that cache lives: with atlas's other derived data (store.paths.cache_dir()/numba), not
  next to the sources in site-packages, which may be read-only and is lost on reinstall.
- The first load compiles for about a minute: `compile_notice` says so on stderr, terminal or
  not (a CI log or `2>file` would otherwise show a minute of silence).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

KERNEL_FILES = (
    "ir.py",
    "ir_int8.py",
    "ir_int8_rows.py",
    "gemv_int8.py",
    "ir_int16.py",
    "ir_attention.py",
    "ir_sync.py",
    "kernels.py",
    "prefill.py",
    "decode.py",
    "blocks.py",
    "gdn.py",
    "rows.py",
    "amx.py",
)
# Forces the instructions of the integer dot products (cpu.ir_int8.dot_isa), which are chosen
# when a kernel compiles: the value is part of every kernel's cache stamp.
ISA_ENV = "ATLAS_CPU_ISA"
_HERE = Path(__file__).resolve().parent


def _preload_tbb() -> None:
    """Make numba's default threading layer TBB where the `tbb` wheel is installed.

    TBB hands out work by stealing, so when another process takes one of the cores the other
    thread finishes the loop; OpenMP's static split waits for the preempted thread, and on a
    busy 2-core machine that made each decode step 10-50x slower (docs/architecture.md).
    numba's PyPI wheel looks for libtbb.so.12 only on the system library path, while the tbb
    wheel installs it into <prefix>/lib: loading it first makes it resolvable by soname."""
    if sys.platform != "linux":
        return
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = os.path.join(prefix, "lib", "libtbb.so.12")
        if os.path.exists(path):
            with contextlib.suppress(OSError):  # numba then falls back to OpenMP
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return


def _threads_from_env() -> int | None:
    """ATLAS_THREADS as numba's pool size. It has to be in the environment before numba starts:
    `numba.set_num_threads` only applies to the calling thread, and the server decodes on a
    worker thread."""
    value = os.environ.get("ATLAS_THREADS")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        from atlas_cli.errors import UsageError

        raise UsageError(f"ATLAS_THREADS must be a positive whole number, got {value!r}")
    if "numba" not in sys.modules:
        os.environ["NUMBA_NUM_THREADS"] = value
    return int(value)


def kernel_cache_dir() -> Path:
    """Where numba keeps the compiled kernels: NUMBA_CACHE_DIR when the user set it, else
    atlas's cache directory."""
    from atlas_cli.store.paths import cache_dir

    return Path(os.environ.get("NUMBA_CACHE_DIR") or cache_dir() / "numba")


def _use_kernel_cache_dir() -> None:
    """Point numba's disk cache at `kernel_cache_dir()`: through the environment before numba
    is imported (it reads NUMBA_CACHE_DIR once, at import), else through its config."""
    path = str(kernel_cache_dir())
    if "numba" not in sys.modules:
        os.environ["NUMBA_CACHE_DIR"] = path
        return
    from numba.core import config

    if not config.CACHE_DIR:
        config.CACHE_DIR = path


# where `compile_notice` goes instead of stderr (a keep-alive worker hands it to its client)
notice_to: Callable[[str], None] | None = None


def compile_notice() -> None:
    """One plain line on stderr before the kernels compile (only when they are not cached)."""
    where = kernel_cache_dir()
    line = f"atlas: compiling the CPU kernels (about a minute, once; cached in {where})..."
    if notice_to is not None:
        notice_to(line)
    else:
        print(line, file=sys.stderr, flush=True)


@functools.cache
def configure() -> None:
    """Preload TBB, size the thread pool, put the kernel cache with atlas's, and stamp the
    kernels' cache entries with every kernel file (idempotent; call before importing numba)."""
    _preload_tbb()
    threads = _threads_from_env()
    _use_kernel_cache_dir()
    from numba.core.config import NUMBA_NUM_THREADS as pool

    if threads is not None and pool != threads:  # numba started before us: this thread only
        from numba import set_num_threads

        set_num_threads(min(threads, pool))
    _install_locator()


@functools.cache
def kernel_sources_digest() -> str:
    """sha256 over the kernel files (and a forced instruction set), as they were when this
    process first asked."""
    h = hashlib.sha256()
    for name in KERNEL_FILES:
        h.update((_HERE / name).read_bytes())
    forced = os.environ.get(ISA_ENV)
    if forced:
        h.update(f"isa={forced}".encode())
    return h.hexdigest()


def _install_locator() -> None:
    from numba.core import caching

    class KernelFilesLocator(caching._CacheLocator):
        """Wraps the locator numba would pick for a kernel file (same cache directory and
        names) and adds the digest of every kernel file to its source stamp."""

        def __init__(self, inner):
            self._inner = inner

        def ensure_cache_path(self):
            self._inner.ensure_cache_path()

        def get_cache_path(self):
            return self._inner.get_cache_path()

        def get_source_stamp(self):
            return (self._inner.get_source_stamp(), kernel_sources_digest())

        def get_disambiguator(self):
            return self._inner.get_disambiguator()

        @classmethod
        def from_function(cls, py_func, py_file):
            if Path(py_file).resolve().parent != _HERE or Path(py_file).name not in KERNEL_FILES:
                return None
            for other in caching.CacheImpl._locator_classes:
                inner = None if other is cls else other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner)
            return None

    caching.CacheImpl._locator_classes.insert(0, KernelFilesLocator)
