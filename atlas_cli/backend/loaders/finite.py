"""NaN and Inf in stored weights, refused at load.

One non-finite weight turns every activation after it into NaN: the model could only fail at
its first token, with nothing left to say which tensor was broken. So a file holding one is
refused here, with a CorruptModelError naming the tensor, before any kernel sees it.

The check reads the stored bits, never a float conversion: a float is NaN or Inf exactly when
its exponent bits are all ones. Float tensors (F32, F16, BF16, F64) are read whole; GGUF
quantized blocks only by their float16 scales (their codes are integers, and a Q4_K block's
scales are 4 of its 144 bytes); E4M3 bytes (NVFP4 scales, FP8 codes) are NaN at 0x7F and 0xFF.
Everything is read in chunks, so the temporaries stay a few MB whatever the tensor's size.
"""

from __future__ import annotations

import numpy as np

from atlas_cli.backend.formats import WeightFormat
from atlas_cli.errors import CorruptModelError

# stored type -> (the unsigned integer of its width, the bits that are all ones in NaN / Inf)
NONFINITE_BITS = {
    "F64": (np.uint64, 0x7FF0_0000_0000_0000),
    "F32": (np.uint32, 0x7F80_0000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
    "F8_E4M3": (np.uint8, 0x7F),  # float8_e4m3fn has no Inf; NaN is S.1111.111
}
F16_HIGH_BYTE_BITS = 0x7C  # a little-endian float16's exponent, in its second byte
CHUNK = 1 << 20  # elements per step
BLOCK_BYTES_PER_STEP = 1 << 20  # of quantized blocks: their scales' cache lines stay in L2


def first_all_ones(bits: np.ndarray, mask: int, scratch: np.ndarray | None = None) -> int | None:
    """The index of the first element of the 1-D unsigned array `bits` (strided or not) whose
    `mask` bits are all set, or None. `scratch`: a buffer of bits' type and of at least
    min(CHUNK, bits.size) elements, when the caller reuses one."""
    mask = bits.dtype.type(mask)
    if scratch is None:
        scratch = np.empty(min(CHUNK, bits.size), bits.dtype)
    for start in range(0, bits.size, CHUNK):
        part = bits[start : start + CHUNK]
        masked = np.bitwise_and(part, mask, out=scratch[: part.size])
        if masked.size and masked.max() == mask:  # masked <= mask: its max is mask on a hit
            return start + int(np.argmax(masked == mask))
    return None


def check_values(file: str, name: str, stored: np.ndarray, dtype: str) -> None:
    """Every element of `stored` (any shape, C-contiguous), whose bytes are of the stored type
    `dtype` (a key of NONFINITE_BITS; other types are integers and always finite)."""
    if dtype not in NONFINITE_BITS:
        return
    unsigned, mask = NONFINITE_BITS[dtype]
    at = first_all_ones(np.ascontiguousarray(stored).reshape(-1).view(unsigned), mask)
    if at is not None:
        raise damaged(
            file, f"tensor {name} holds NaN or Inf at element {at:,} (expected finite weights)"
        )


def damaged(file: str, what: str) -> CorruptModelError:
    return CorruptModelError(
        f"{file}: {what}; the file is damaged or was badly converted: download it again or try "
        "another quantisation"
    )


def check_block_scales(file: str, name: str, raw: np.ndarray, fmt: WeightFormat) -> None:
    """The float16 scales of every block of a GGUF tensor's bytes `raw` (whole blocks of
    `fmt`), by the high byte of each: it holds the whole exponent. A few thousand blocks at a
    time, every scale of a block while its cache line is loaded."""
    blocks = np.ascontiguousarray(raw).reshape(-1, fmt.block_bytes)
    step = max(1, BLOCK_BYTES_PER_STEP // fmt.block_bytes)
    scratch = np.empty(min(step, blocks.shape[0]), np.uint8)
    for start in range(0, blocks.shape[0], step):
        part = blocks[start : start + step]
        for offset in fmt.f16_scales:
            at = first_all_ones(part[:, offset + 1], F16_HIGH_BYTE_BITS, scratch)
            if at is not None:
                raise damaged(
                    file,
                    f"tensor {name} has a NaN or Inf scale in block {start + at:,} "
                    "(expected finite scales)",
                )


def check_gguf_tensor(file: str, name: str, raw: np.ndarray, fmt: WeightFormat) -> None:
    """A GGUF tensor's bytes: its scales when quantized, else every value."""
    if fmt.quantized:
        check_block_scales(file, name, raw, fmt)
    else:
        check_values(file, name, raw, fmt.name)
