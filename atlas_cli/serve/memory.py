"""Giving the memory of a large request back to the system once it is answered.

A 10 MB body becomes several copies (bytes, parsed text, the rendered prompt) that Python frees
when the request ends, but glibc's allocator keeps freed pages for reuse: a server that took a
few large requests would otherwise stay hundreds of MB above its idle size. `malloc_trim(0)`
returns the free pages of every arena; elsewhere (musl, macOS) there is nothing to call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

LARGE_BODY_BYTES = 1 << 20  # below this a request's copies are noise beside the model


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def return_freed_memory() -> bool:
    """Collect what only a cycle still holds (a refused request's traceback keeps its frames,
    and their copies of the body, alive), then hand the allocator's free pages back to the
    system; False where it cannot."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
