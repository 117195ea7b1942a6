"""The fast CPU path's numba set-up: the disk cache of every kernel is stamped with all the
kernel files, so that a change to a callee in one file recompiles its callers in another."""

from __future__ import annotations

import hashlib

import numpy as np
from numba.core.caching import FunctionCache

from atlas_cli.backend.ops.cpu import blocks as cpu_blocks
from atlas_cli.backend.ops.cpu import decode as cpu_decode
from atlas_cli.backend.ops.cpu import jit
from atlas_cli.backend.ops.cpu import kernels as cpu_kernels


def test_kernel_stamp_covers_every_kernel_file():
    here = jit._HERE
    h = hashlib.sha256()
    for name in jit.KERNEL_FILES:
        h.update((here / name).read_bytes())
    assert jit.kernel_sources_digest() == h.hexdigest()
    kernels = (cpu_kernels.row_dot, cpu_kernels.gemm, cpu_decode.decode_step, cpu_blocks.gdn_block)
    for fn in kernels:
        locator = fn._cache._impl.locator
        assert type(locator).__name__ == "KernelFilesLocator"
        assert locator.get_source_stamp()[1] == h.hexdigest()


def test_a_change_in_any_kernel_file_invalidates_the_cache(monkeypatch):
    cpu_kernels.group_sums(np.ones(64, np.float32), np.empty(2, np.float32))
    assert FunctionCache(cpu_kernels.group_sums.py_func)._cache_file._load_index()
    monkeypatch.setattr(jit, "kernel_sources_digest", lambda: "another source")
    assert FunctionCache(cpu_kernels.group_sums.py_func)._cache_file._load_index() == {}


def test_functions_elsewhere_keep_numba_s_own_locator(tmp_path, monkeypatch):
    (tmp_path / "elsewhere.py").write_text(
        "from numba import njit\n\n@njit(cache=True)\ndef f(x):\n    return x + 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import elsewhere

    assert type(elsewhere.f._cache._impl.locator).__name__ != "KernelFilesLocator"


def test_row_loops_prefetch_the_rows_ahead():
    """The decode GEMVs ask for the weights of the rows ahead (cpu_ir.prefetch): the machine
    code of a row loop carries a prefetch instruction, and the products are unchanged."""
    from numba import njit, prange

    rows, rb = 64, cpu_kernels.BLOCKS[cpu_kernels.Q8_0][1]

    @njit(parallel=True)
    def loop(w, perm, x, out):  # gemv_batch's shape: prefetch, then the row's dot
        for r in prange(perm.shape[0]):
            cpu_kernels.prefetch_row(w, 0, rb, perm, r, perm.shape[0])
            out[r] = w[perm[r] * rb] * x

    w, perm = np.arange(rows * rb, dtype=np.uint8), np.arange(rows)
    out = np.empty(rows, np.float32)
    loop(w, perm, np.float32(2.0), out)
    assert np.array_equal(out, w[perm * rb] * np.float32(2.0))
    asm = "\n".join(loop.inspect_asm().values()).lower()
    assert "prefetcht0" in asm or "prfm" in asm  # x86, arm64
