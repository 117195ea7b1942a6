"""How many threads the CPU paths use: numba's pool and the BLAS the float32 reference calls.

Every command that runs a model (`run`, `chat`, `serve`, `bench`) and the keep-alive worker set
it the same way, before any model loads. Light: numpy and threadpoolctl are imported only when
a count is set.
"""

from __future__ import annotations

import os


def use_threads(threads: int | None) -> None:
    """`-t N` for the CPU paths: numba's pool (sized from ATLAS_THREADS when numba starts, so
    this runs before any model loads) and the BLAS the float32 reference calls."""
    if threads is None:
        return
    os.environ["ATLAS_THREADS"] = str(threads)
    limit_blas(threads)


def limit_blas(threads: int):
    """BLAS (the float32 reference's matrix products) at `threads` threads from now on; used as
    a context manager, the returned limiter puts the previous count back on exit."""
    import numpy  # noqa: F401  (loads the BLAS, so that threadpoolctl finds and limits it)
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=threads, user_api="blas")
