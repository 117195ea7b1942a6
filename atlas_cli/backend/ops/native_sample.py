"""Token selection on the device, and the FP8 conversions of the KV cache (exposed for tests)."""

from __future__ import annotations

import numpy as np

from atlas_cli.backend.ops.native_array import DeviceOpsBase, blocks_for
from atlas_cli.backend.ops.runtime import f32, i32, ptr

SAMPLE_KMAX = 256  # sample.cu SAMPLE_KMAX


class SamplingLaunchers(DeviceOpsBase):
    def argmax(self, logits) -> int:
        x = self._f32(logits, "argmax logits")
        out = self.empty((1,), np.int32)
        self._launch("sample.cu", "argmax", (1,), (1024,), [ptr(x.ptr), i32(x.size), ptr(out.ptr)])
        return int(out.numpy()[0])

    def sample(
        self, logits, top_k: int, top_p: float, min_p: float, temperature: float, u: float
    ) -> int:
        """sample.py's chain (top-k, top-p, min-p, temperature) with the uniform draw `u`;
        temperature 0 is argmax. top_k must be 1..256 (sample.cu SAMPLE_KMAX)."""
        if temperature == 0:
            return self.argmax(logits)
        x = self._f32(logits, "sample logits")
        assert 1 <= top_k <= SAMPLE_KMAX, f"device sampling needs 1 <= top_k <= {SAMPLE_KMAX}"
        out = self.empty((1,), np.int32)
        self._launch(
            "sample.cu",
            "sample_topk_topp",
            (1,),
            (1024,),
            [
                ptr(x.ptr),
                i32(x.size),
                i32(top_k),
                f32(top_p),
                f32(min_p),
                f32(temperature),
                f32(u),
                ptr(out.ptr),
            ],
        )
        return int(out.numpy()[0])

    def fp8_decode(self, codes: np.ndarray) -> np.ndarray:
        raw = self._upload_bytes(np.ascontiguousarray(codes, np.uint8))
        n = int(np.asarray(codes).size)
        out = self.empty((n,))
        self._launch(
            "dequant.cu",
            "fp8_decode",
            (blocks_for(n),),
            (256,),
            [ptr(raw.ptr), ptr(out.ptr), i32(n)],
        )
        return out.numpy()

    def fp8_encode(self, x: np.ndarray) -> np.ndarray:
        d = self._f32(np.asarray(x, np.float32).reshape(-1), "fp8_encode x")
        buf = self.rt.alloc(max(d.size, 4))
        self._launch(
            "dequant.cu",
            "fp8_encode",
            (blocks_for(d.size),),
            (256,),
            [ptr(d.ptr), ptr(buf.ptr), i32(d.size)],
        )
        out = np.empty(d.size, np.uint8)
        self.rt.d2h(out, buf)
        return out
