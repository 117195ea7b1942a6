"""Token selection on the device, and the FP8 conversions of the KV cache (exposed for tests).

`device_sampler` sets up one generation's sampling on the device (sample.cu `sample_chain`):
its parameters, the uniforms of its draws and the ring of recent tokens the repeat penalty
reads are uploaded once; each token is then one launch and an 8-byte readback. Under a grammar,
a draw the grammar rejects is drawn again on the device from the grammar's bitmask (`redraw`:
one upload of V/8 bytes and one more launch), as the CPU Sampler draws again from the masked
logits: the logits never come back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from atlas_cli.backend.ops.native.array import DeviceOpsBase, blocks_for
from atlas_cli.backend.ops.native.runtime import f32, i32, ptr

SAMPLE_KMAX = 256  # sample.cu SAMPLE_KMAX


NONFINITE, OUT_OF_UNIFORMS = 1, 2  # sample_chain's flags (out[1])


@dataclass(frozen=True)
class ChainSettings:
    """backend/sample.py's SamplingParams, as sample_chain takes them (top_k 1..256 unless
    greedy; repeat_last_n >= 1)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    presence_penalty: float
    repeat_last_n: int

    @classmethod
    def of(cls, params) -> ChainSettings:
        """From a SamplingParams (the fields of the same names)."""
        return cls(**{f.name: getattr(params, f.name) for f in fields(cls)})

    def fits(self) -> bool:
        """Whether sample_chain takes these settings: a top-k of at most SAMPLE_KMAX (0, no
        top-k, stays on the host) unless greedy, and a ring of at least one token."""
        return self.repeat_last_n >= 1 and (self.temperature == 0 or 1 <= self.top_k <= SAMPLE_KMAX)


class DeviceTokenSampler:
    """One generation's sampler on the device: `__call__(logits)` -> (token, flag)."""

    def __init__(
        self,
        ops: Any,
        s: ChainSettings,
        history: Sequence[int],
        uniforms: np.ndarray,
        forward_to=None,
    ):
        """`forward_to`: a device int32 the token is also copied to (device to device), the
        input of the next decode step."""
        assert s.fits(), f"sample_chain cannot take {s}"
        self.ops = ops
        self.forward_to = forward_to
        cap = s.repeat_last_n
        recent = [int(t) for t in history][-cap:]
        ring = np.zeros(cap, np.int32)
        ring[: len(recent)] = recent
        floats = [s.temperature, s.top_p, s.min_p, s.repeat_penalty, s.presence_penalty]
        self.dp = ops.asarray(np.array(floats, np.float64), np.float64)
        self.ip = ops.asarray(np.array([s.top_k, cap, len(uniforms)], np.int32))
        self.uniforms = ops.asarray(np.asarray(uniforms, np.float64).reshape(-1), np.float64)
        head = len(recent) % cap
        self.state = ops.asarray(np.array([0, len(recent), head, 0], np.int32))
        self.ring = ops.asarray(ring)
        self.out = ops.zeros((2,), np.int32)  # the token, then the flag
        self._host = np.empty(2, np.int32)

    def __call__(self, logits) -> tuple[int, int]:
        """The next token and sample_chain's flag (0, NONFINITE or OUT_OF_UNIFORMS); the
        repeat penalty rewrites `logits` in place."""
        return self._chain(logits, None)

    def redraw(self, logits, allowed: np.ndarray) -> tuple[int, int]:
        """The token drawn again after the grammar rejected the last one: `logits` as the last
        call left them (penalised), restricted to `allowed` ((V,) bool), the next uniform; the
        new token takes the rejected one's place in the ring."""
        words = np.packbits(np.asarray(allowed, bool), bitorder="little")
        words = np.pad(words, (0, -len(words) % 4)).view("<u4")
        return self._chain(logits, self.ops.asarray(words.astype(np.uint32)))

    def _chain(self, logits, mask) -> tuple[int, int]:
        ops = self.ops
        x = ops._f32(logits, "sample_chain logits")
        masking = (
            [ptr(mask.ptr), i32(mask.size), i32(1)]
            if mask is not None
            else [ptr(0), i32(0), i32(0)]
        )
        ops._launch(
            "sample.cu",
            "sample_chain",
            (1,),
            (512,),
            [
                ptr(x.ptr),
                i32(x.size),
                *(ptr(a.ptr) for a in (self.dp, self.ip, self.uniforms)),
                *(ptr(a.ptr) for a in (self.state, self.ring, self.out)),
                *masking,
            ],
        )
        if self.forward_to is not None:
            ops.rt.d2d(
                self.forward_to.buf, self.forward_to.offset, self.out.buf, self.out.offset, 4
            )
        ops.rt.d2h(self._host, self.out.buf, self.out.offset)
        return int(self._host[0]), int(self._host[1])

    @property
    def token(self):
        """The last token, as a device int32 array of one (a decode step may read it there)."""
        return self.out[:1]


class SamplingLaunchers(DeviceOpsBase):
    def device_sampler(
        self,
        settings: ChainSettings,
        history: Sequence[int],
        uniforms: np.ndarray,
        forward_to=None,
    ) -> DeviceTokenSampler:
        return DeviceTokenSampler(self, settings, history, uniforms, forward_to)

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
