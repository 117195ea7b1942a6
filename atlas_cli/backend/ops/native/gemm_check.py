"""Which prefill GEMM runs (ATLAS_PREFILL): the tensor-core kernel of kernels/gemm_fast.cu (bf16
operands, the default), kernels/gemm.cu (float32-exact, `exact`) or kernels/gemm_fp4.cu (W4A4,
`fp4`), each checked once per device; and whether an MTP verify (2 <= T <= 8 tokens) multiplies
quantized weights on the tensor cores (kind `verify`: kernels/gemv_mma.cu, compared with
gemv.cu's gemv_t8, which does the same float32 sum with FFMAs).

The tensor-core paths (ldmatrix / mma.sync / cp.async on sm_80+, WMMA on gfx11) are inline PTX /
vendor intrinsics whose numerics only the hardware shows; the emulator runs the portable path of
the same file. So on a real device (runtime "cuda" or "hip") the first GEMM compares the
tensor-core kernel with the portable one (the same file compiled with ATLAS_PORTABLE) on random
data, and keeps the
verdict beside the compile cache, keyed like the compiled binaries (ops/native/runtime.cache_key): a
new source, target or toolchain checks again. On a mismatch atlas uses the portable kernel and
`atlas hw` says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from atlas_cli.backend import formats
from atlas_cli.backend.ops.native import runtime as rt
from atlas_cli.backend.ops.native.array import DeviceWeight, f32_to_bf16_bits

PORTABLE = {"ATLAS_PORTABLE": 1}  # the define that compiles a GEMM file's portable path
FILES = {"fast": "gemm_fast.cu", "exact": "gemm.cu", "fp4": "gemm_fp4.cu", "verify": "gemv_mma.cu"}
FP4_TARGETS = ("sm_120a", "sm_121a")  # where the block-scaled FP4 MMA exists
CHECKED_RUNTIMES = ("cuda", "hip")  # the emulator has no tensor-core path to check
# Both builds of a file multiply the same bf16 operands (gemm.cu: x in three parts, the weight
# in one to three; gemm_fast.cu: one each) and add the same products in float32: they differ
# by summation order and by the tensor cores' own rounding inside one 64-column step,
# ~1e-7..1e-6 of the output's scale. A wrong fragment layout or a broken instruction is off by
# O(1); a product left out (x2 w0) by ~1e-5.
TOLERANCE = 1e-5
# (format, tokens, rows, cols): the ways the multiply differs (bf16: three MMAs and a partial
# last unit; f16: five, two weight parts; f32: six; NVFP4: the global scale at the end), edge
# tiles in both dimensions.
CASES = (
    ("bf16", 77, 100, 200),
    ("f16", 70, 66, 128),
    ("f32", 130, 70, 96),
    ("nvfp4", 67, 129, 256),
)
# the W4A4 kernel's (NVFP4 only, whole 128-column steps): edge tiles, the ring wrapping
FP4_CASES = (("nvfp4", 67, 129, 256), ("nvfp4", 9, 200, 512))
# ggml type of each quantized GGUF format the kernels read
GGUF_IDS = {f.kernel: f.ggml_type for f in formats.GGML.values() if f.native and f.quantized}
# the verify GEMV's (each decoder pairing and lane layout; a partial last tile and block)
VERIFY_CASES = (
    ("nvfp4", 4, 70, 1536),
    ("q4_k", 8, 33, 2304),
    ("q6_k", 2, 35, 1280),
    ("q8_0", 5, 40, 1056),
    ("q5_k", 3, 17, 1024),
)
# The f16 fields inside each GGUF block type a kernel reads (ggml type -> byte offsets): where a
# random block needs finite scales (random_gguf_blocks)
F16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 11: (108,), 12: (0, 2)}
F16_FIELDS |= {13: (0, 2), 14: (208,), 20: (0,), 23: (0,)}


@dataclass(frozen=True)
class GemmChoice:
    kind: str  # "fast" | "exact" | "fp4" (FILES)
    kernel: str  # "tensor-core" | "portable" | "none" (fp4 where the device has no FP4 MMA)
    reason: str
    defines: dict | None  # what the kind's file is compiled with for this choice

    def report(self) -> dict[str, str]:
        return {"kind": self.kind, "kernel": self.kernel, "reason": self.reason}


def verdict_path(runtime, kind: str) -> Path:
    """Where the verdict for this runtime's binary of the `kind` GEMM is kept."""
    source = rt.expand_source(FILES[kind])
    toolchain = str(getattr(runtime, "toolchain", ""))
    key = rt.cache_key(source, runtime.target, toolchain, None)
    directory = getattr(runtime, "cache_dir", None) or rt.kernel_cache_dir()
    return Path(directory) / f"{kind}-gemm-selfcheck-{runtime.target}-{key}.json"


def choose(ops, kind: str) -> GemmChoice:
    """The `kind` GEMM (a key of FILES) for `ops` (a NativeOps): the cached verdict, or a
    fresh check."""
    runtime = ops.rt
    if kind == "fp4" and runtime.name != "emu" and runtime.target not in FP4_TARGETS:
        reason = f"{runtime.target} has no block-scaled FP4 MMA: NVFP4 weights take the fast one"
        return GemmChoice(kind, "none", reason, PORTABLE)
    if kind == "verify" and not _has_mma_sync(runtime):
        reason = f"{runtime.name} {runtime.target}: no mma.sync path, gemv_t8 verifies"
        return GemmChoice(kind, "none", reason, PORTABLE)
    if runtime.name not in CHECKED_RUNTIMES:
        return GemmChoice(
            kind, "portable", f"the {runtime.name} runtime runs the portable path", None
        )
    path = verdict_path(runtime, kind)
    verdict = _read(path)
    if verdict is None:
        verdict = run_check(ops, kind)
        _write(path, verdict)
    if verdict["ok"]:
        return GemmChoice(
            kind, "tensor-core", f"self-check passed (max difference {verdict['error']:.1e})", None
        )
    return GemmChoice(
        kind,
        "portable",
        f"the tensor-core kernel disagreed with the portable one on random {verdict['format']} "
        f"data (difference {verdict['error']:.1e} > {TOLERANCE:.0e}): using the portable one",
        PORTABLE,
    )


def _has_mma_sync(runtime) -> bool:
    """A CUDA device of sm_80 or later (gemv_mma.cu's tensor-core path)."""
    digits = "".join(ch for ch in str(runtime.target)[3:] if ch.isdigit())
    return runtime.name == "cuda" and digits.isdigit() and int(digits) >= 80


def run_check(ops, kind: str) -> dict[str, Any]:
    """Both builds of the `kind` GEMM on CASES (verify: gemv_mma and gemv_t8 on
    VERIFY_CASES); {"ok", "error" (the worst relative difference), "format"}."""
    rng = np.random.default_rng(20240615)
    worst, worst_fmt = 0.0, ""
    cases = {"fp4": FP4_CASES, "verify": VERIFY_CASES}.get(kind, CASES)
    for fmt, t, rows, cols in cases:
        w = _random_weight(ops, fmt, rows, cols, rng)
        x = ops.asarray(rng.standard_normal((t, cols)).astype(np.float32))
        bias = ops.asarray(rng.standard_normal(rows).astype(np.float32))
        if kind == "verify":
            fast = ops.gemv_mma(x, w, bias, None).numpy()
            slow = ops.gemv(x, w, bias, ops.empty((t, rows))).numpy()
        else:
            fast = ops.gemm(x, w, bias, None, kind=kind).numpy()
            slow = ops.gemm(x, w, bias, PORTABLE, kind=kind).numpy()
        scale = float(np.abs(slow).max()) if np.isfinite(slow).all() else 0.0
        err = float(np.abs(fast - slow).max() / scale) if scale else float("inf")
        if not np.isfinite(err):
            err = float("inf")
        if err >= worst:
            worst, worst_fmt = err, fmt
        if not err <= TOLERANCE:
            return {"ok": False, "error": err, "format": fmt}
    return {"ok": True, "error": worst, "format": worst_fmt}


def _random_weight(ops, fmt: str, rows: int, cols: int, rng: np.random.Generator):
    """A DeviceWeight of `fmt` with random contents (finite values, NVFP4 scales > 0; GGUF
    blocks of random bytes with finite f16 scales)."""
    from atlas_cli.backend.loaders.gguf import QuantizedTensor

    if fmt in GGUF_IDS:
        blocks = random_gguf_blocks(GGUF_IDS[fmt], rows, cols, rng)
        return ops.prepare_weight(QuantizedTensor(GGUF_IDS[fmt], (rows, cols), blocks))
    if fmt == "nvfp4":
        codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        scales = rng.integers(0x20, 0x60, (rows, cols // 16), dtype=np.uint8)
        data, sdata = ops._upload_bytes(codes), ops._upload_bytes(scales)
        return DeviceWeight(fmt, rows, cols, data, cols // 2, sdata, cols // 16, 4e-3)
    a = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    raw = {"bf16": f32_to_bf16_bits, "f16": lambda v: v.astype(np.float16)}.get(fmt, np.asarray)(a)
    data = ops._upload_bytes(raw)
    return DeviceWeight(fmt, rows, cols, data, cols * raw.itemsize, ops._dummy, 0, 1.0)


def random_gguf_blocks(type_id: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, bytes per row) GGUF blocks of ggml type `type_id`: random bytes, with finite
    random f16 scales in F16_FIELDS."""
    from atlas_cli.backend.loaders import quant

    qt = quant.GGML_TYPES[type_id]
    nblk = cols // qt.block_elems
    raw = rng.integers(0, 256, (rows, nblk, qt.block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[type_id]:
        d = rng.uniform(-0.05, 0.05, (rows, nblk)).astype(np.float16)
        raw[:, :, off : off + 2] = d.view(np.uint8).reshape(rows, nblk, 2)
    return raw.reshape(rows, -1)


def _read(path: Path) -> dict | None:
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent or torn: check again
    ok = isinstance(verdict, dict) and {"ok", "error", "format"} <= set(verdict)
    return verdict if ok else None


def _write(path: Path, verdict: dict) -> None:
    """Through a temp file and a rename, as the compile cache writes binaries; the json module
    writes an infinite difference as Infinity, which it reads back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{id(verdict)}")
    tmp.write_text(json.dumps(verdict))
    tmp.replace(path)
