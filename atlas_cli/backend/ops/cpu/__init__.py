"""The fast CPU backend (`--device cpu`): numba kernels on the quantized GGUF blocks.

- fast.py          the ops contract on this backend (products on the blocks), and the fused
                   decode steps it builds from a model's layer declaration
- decode.py        the fused step's kernels: every attention layer of a token in one call,
                   the shared row stages (norm, projections, MLP) and the kernel warm-up
- qwen35.py        the fused step's Gated DeltaNet and gated-attention layer kernels
- kernels.py       row dots, GEMV/GEMM on the blocks, attention, the float16 KV helpers
- prefill.py       the int16 prefill GEMM; amx.py its AMX form (where the CPU has AMX)
- gdn.py           the chunked gated delta rule of the prefill
- rows.py          the prefill's elementwise ops (norms, RoPE, SiLU, conv)
- ir.py, ir_int8.py, ir_int16.py, ir_attention.py, ir_sync.py
                   LLVM IR intrinsics: block decoders, integer dots, attention inner loops,
                   the atomics the fused steps' workers claim work with
- jit.py           numba's set-up: threads, the disk cache and its source stamp
"""
