// Programmatic dependent launch (sm_90+) between the step's kernels: the QKV write, the attention kernels and the
// split-K merge. A grid launched with programmatic stream serialization may start before the kernel ahead of it on
// the stream has finished (once every CTA of that kernel has triggered or exited), so that its launch and set-up
// overlap the other's tail. The contract, for every kernel launched this way: gridDependencyWait() before reading
// anything an earlier kernel may have written (the attention kernels wait first thing: the step's Q and K/V come
// from the write kernel, and the launcher cannot know who produced the metadata).
#pragma once

#include <cuda_runtime.h>

namespace pagedkv {

// ---- device side (no-ops below sm_90, where the launcher never asks for it)
// The primary lets a dependent grid launched with programmatic stream serialization
// start once every one of its CTAs has passed this point; the dependent must call gridDependencyWait()
// before touching anything the primary writes. Harmless without a dependent: it only affects grids launched
// with the attribute, and those wait for the primary's completion before reading its results.
__device__ __forceinline__ void gridDependencyLaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Blocks until every prerequisite grid has completed and its memory operations are visible (returns at once
// when the grid was launched without the attribute).
__device__ __forceinline__ void gridDependencyWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---- host side
// Launch `kernel` as a programmatic dependent of the work before it on `stream` (sm_90+), falling back to a
// plain launch where the device or the driver does not offer it. The kernel must call gridDependencyWait()
// before reading what earlier kernels wrote.
template <typename Kernel, typename... Args>
cudaError_t launchProgrammaticDependent(Kernel kernel, dim3 grid, dim3 block, size_t smemBytes, cudaStream_t stream,
                                        Args const&... args) {
    int device = 0, major = 0;
    if (cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9) {
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg{};
        cfg.gridDim = grid;
        cfg.blockDim = block;
        cfg.dynamicSmemBytes = smemBytes;
        cfg.stream = stream;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        if (cudaLaunchKernelEx(&cfg, kernel, args...) == cudaSuccess) return cudaSuccess;
        (void)cudaGetLastError();  // a refused attribute is not sticky: clear it and launch plainly
    }
    kernel<<<grid, block, smemBytes, stream>>>(args...);
    return cudaGetLastError();
}

}  // namespace pagedkv
