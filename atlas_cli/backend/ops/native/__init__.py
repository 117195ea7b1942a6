"""The native backend (`--device cuda|hip|emu`): our kernels (kernels/*.cu) in-process.

Importing this package imports nothing: `atlas hw` probes runtimes without numpy's weight.

- device.py        NativeOps (the ops contract as kernel launches) and `open_device`
- weights.py, elementwise.py, attention.py, gdn.py, sample.py
                   the launchers by op family; array.py the DeviceArray / DeviceWeight plumbing
- cache.py         the device hybrid cache of Gated DeltaNet models
- decoder.py       the fused decode step built from a model's layer declaration (one graph
                   a token)
- placement.py     which weights go to the device in which format
- gemm_check.py, attention_check.py
                   first-use self-checks of the tensor-core paths against portable twins
- runtime.py       what every runtime shares (kernel sources, the on-disk cache)
- runtime_cuda.py  CUDA through cupy/NVRTC; runtime_hip.py HIP through hip-python;
  runtime_emu.py   the kernels compiled for the host (the emulator);
  runtime_count.py a runtime that counts launches and copies; runtime_probe.py what can start
- nvrtc.py         NVRTC on any machine (the compile checks)
"""
