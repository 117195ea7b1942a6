// What the ROCm device libraries (ockl, ocml) give a kernel, for the gfx1151 ISA tests
// (tests/machine_code.py links it as builtin bitcode): thread and block ids and sizes from the
// compiler's builtins and the code-object-v5 implicit arguments, the math from LLVM's
// intrinsics. Without it (-nogpulib) every threadIdx.x is a call that clobbers registers, so
// the instruction counts were not those of real code. Not shipped: atlas's HIP runtime links
// the real device libraries through hiprtc.
#include <stddef.h>

#define DEVLIB extern "C" __attribute__((device, always_inline, const))

DEVLIB size_t __ockl_get_local_id(unsigned d) {
    return d == 0 ? __builtin_amdgcn_workitem_id_x()
                  : d == 1 ? __builtin_amdgcn_workitem_id_y() : __builtin_amdgcn_workitem_id_z();
}
DEVLIB size_t __ockl_get_group_id(unsigned d) {
    return d == 0 ? __builtin_amdgcn_workgroup_id_x()
                  : d == 1 ? __builtin_amdgcn_workgroup_id_y() : __builtin_amdgcn_workgroup_id_z();
}
DEVLIB size_t __ockl_get_local_size(unsigned d) {
    return d == 0 ? __builtin_amdgcn_workgroup_size_x()
                  : d == 1 ? __builtin_amdgcn_workgroup_size_y() : __builtin_amdgcn_workgroup_size_z();
}
DEVLIB size_t __ockl_get_num_groups(unsigned d) {  // hidden_block_count_{x,y,z}: bytes 0, 4, 8
    return ((const unsigned*)__builtin_amdgcn_implicitarg_ptr())[d];
}
DEVLIB float __ocml_rsqrt_f32(float x) { return __builtin_amdgcn_rsqf(x); }
DEVLIB float __ocml_log1p_f32(float x) { return __builtin_logf(1.0f + x); }
// (no f64 exp instruction and no libcall: ocml's is a software routine; the counts of its one
// user, sample.cu's log-sum-exp, take a float32 one)
DEVLIB double __ocml_exp_f64(double x) { return __builtin_expf((float)x); }
extern "C" __attribute__((device, always_inline)) float __ocml_sincos_f32(
    float x, __attribute__((address_space(5))) float* c) {
    *c = __builtin_cosf(x);
    return __builtin_sinf(x);
}
// __syncthreads' release and acquire (scope 1: the work-group), __threadfence's (2: the agent)
extern "C" __attribute__((device, always_inline)) void __atomic_work_item_fence(unsigned flags,
                                                                               int order,
                                                                               int scope) {
    (void)flags;
    if (scope <= 1) {
        if (order == __ATOMIC_RELEASE) __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
        else if (order == __ATOMIC_ACQUIRE) __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
        else __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "workgroup");
    } else {
        if (order == __ATOMIC_RELEASE) __builtin_amdgcn_fence(__ATOMIC_RELEASE, "agent");
        else if (order == __ATOMIC_ACQUIRE) __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "agent");
        else __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent");
    }
}
