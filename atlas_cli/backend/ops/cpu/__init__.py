"""The fast CPU backend (`--device cpu`): numba kernels on the quantized GGUF blocks.

- fast.py          the ops contract on this backend (products on the blocks)
- packed.py        PackedMatrix: a GGUF matrix's blocks as the kernels address them
- fused.py         the fused decode steps, built from a model's layer declaration
- decode.py        FusedDecoder's kernel: every attention layer of a token in one call, the
                   shared row stages (norm, projections, MLP) and the kernel warm-up
- blocks.py        FusedLayers' kernels: a Gated DeltaNet or gated-attention layer a call
- kernels.py       row dots, GEMV/GEMM on the blocks, attention, the float16 KV helpers
- prefill.py       the int16 prefill GEMM; amx.py its AMX form (where the CPU has AMX)
- gdn.py           the chunked gated delta rule of the prefill
- rows.py          the prefill's elementwise ops (norms, RoPE, SiLU, conv)
- ir.py, ir_int8.py, ir_int16.py, ir_attention.py, ir_sync.py
                   LLVM IR intrinsics: block decoders, integer dots, attention inner loops,
                   the atomics the fused steps' workers claim work with
- jit.py           numba's set-up: threads, the disk cache and its source stamp
"""
