// The one dispatch point of the attention kernels: (ioDType, 8-bit or 16-bit cache, head dim) -> a compiled
// instantiation. The head dims are the capability table's (pagedkv/capabilities.h): adding one there
// instantiates every kernel family for it. Anything outside the compiled set fails loudly with the field and
// the value. Template parameters are kept to what changes the generated code (the MMA type, whether tiles go
// through an 8-bit staging buffer, the head dim); fp8 vs int8, soft-cap, window and page geometry are uniform
// runtime branches, so each kernel family has 2 x 2 x (head dims) = 24 instantiations today (the merge 2 x 6).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

#include "attention_kernels.h"
#include "launch_common.h"
#include "pagedkv/attention.h"
#include "pagedkv/capabilities.h"
#include "pdl.cuh"

namespace pagedkv {
namespace attn {

template <typename T>
struct TypeTag {
    using type = T;
};
template <bool V>
struct BoolTag {
    static constexpr bool value = V;
};
template <int V>
struct IntTag {
    static constexpr int value = V;
};

inline bool isCache8Bit(CacheDType c) { return c == CacheDType::kFP8E4M3 || c == CacheDType::kINT8; }

// The head dims of the capability table (pagedkv/capabilities.h), one instantiation each: f(IntTag<D>) for the
// entry equal to headDim, in table order. A head dim the table does not list fails loudly.
template <size_t I = 0, typename F>
cudaError_t dispatchHeadDim(int32_t headDim, F&& f) {
    if constexpr (I == sizeof(kSupportedHeadDims) / sizeof(kSupportedHeadDims[0])) {
        return invalidArgument("head_dim=" + std::to_string(headDim) + ": expected one of " +
                               supportedHeadDimsText() + " (no attention kernel compiled for it)");
    } else {
        if (headDim == kSupportedHeadDims[I]) return f(IntTag<kSupportedHeadDims[I]>{});
        return dispatchHeadDim<I + 1>(headDim, std::forward<F>(f));
    }
}

// f(TypeTag<CT>, BoolTag<cache8Bit>, IntTag<D>) -> cudaError_t
template <typename F>
cudaError_t dispatchAttention(IODType io, bool cache8Bit, int32_t headDim, F&& f) {
    auto byHeadDim = [&](auto ct, auto k8) -> cudaError_t {
        return dispatchHeadDim(headDim, [&](auto d) { return f(ct, k8, d); });
    };
    auto byCache = [&](auto ct) -> cudaError_t {
        return cache8Bit ? byHeadDim(ct, BoolTag<true>{}) : byHeadDim(ct, BoolTag<false>{});
    };
    switch (io) {
        case IODType::kFP16: return byCache(TypeTag<__half>{});
        case IODType::kBF16: return byCache(TypeTag<__nv_bfloat16>{});
    }
    return invalidArgument("io_dtype=" + std::to_string(static_cast<int32_t>(io)) + ": expected " +
                           supportedIODTypesText());
}

// Dynamic shared memory per CTA the current device allows (the opt-in limit); 0 when it cannot be queried.
inline int32_t deviceSharedMemoryOptin() {
    int device = 0, optin = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) return 0;
    return optin;
}

// Per kernel instantiation (one static object each): raises the dynamic shared-memory limit once per device
// and caches the occupancy. Host-side queries only; nothing here waits on the GPU.
class KernelSetup {
public:
    // `what` names the kernel and its shape for the error raised when the device cannot host it.
    template <typename Kernel>
    cudaError_t prepare(Kernel kernel, size_t smemBytes, int32_t threads, int32_t& ctasPerSm, char const* what,
                        int32_t headDim) {
        int device = 0;
        cudaError_t err = cudaGetDevice(&device);
        if (err != cudaSuccess) return err;
        if (device >= 0 && device < kMaxDevices) {
            int32_t cached = ctasPerSm_[device].load(std::memory_order_acquire);
            if (cached > 0) {
                ctasPerSm = cached;
                return cudaSuccess;
            }
        }
        int32_t const optin = deviceSharedMemoryOptin();
        int major = 0, minor = 0;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
        if (optin > 0 && smemBytes > size_t(optin))
            return invalidArgument("head_dim=" + std::to_string(headDim) + ": the " + what + " needs " +
                                   std::to_string(smemBytes) + " bytes of shared memory per CTA, this GPU (sm_" +
                                   std::to_string(major * 10 + minor) + ") allows " + std::to_string(optin) +
                                   ": expected a GPU with more shared memory (sm_90 hosts every head dim)");
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smemBytes));
        if (err != cudaSuccess) return err;
        int n = 0;
        err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smemBytes);
        if (err != cudaSuccess) return err;
        if (n < 1)
            return invalidArgument("attention kernel shared memory=" + std::to_string(smemBytes) +
                                   ": expected to fit one CTA per SM of this device");
        if (device >= 0 && device < kMaxDevices) ctasPerSm_[device].store(n, std::memory_order_release);
        ctasPerSm = n;
        return cudaSuccess;
    }

private:
    static constexpr int kMaxDevices = 64;
    std::atomic<int32_t> ctasPerSm_[kMaxDevices] = {};
};

// One KernelSetup per kernel instantiation F.
template <typename F>
inline KernelSetup kernelSetup{};

// The compiled shape (threads, dynamic shared memory) of one attention kernel family's instantiation.
template <template <typename, bool, int> class Family>
cudaError_t familyShape(IODType io, CacheDType cache, int32_t headDim, KernelShape& shape) {
    return dispatchAttention(io, isCache8Bit(cache), headDim, [&](auto ct, auto k8, auto d) -> cudaError_t {
        using F = Family<typename decltype(ct)::type, decltype(k8)::value, decltype(d)::value>;
        shape = KernelShape{F::kThreads, F::kSmemBytes};
        return cudaSuccess;
    });
}

// The occupancy query (kp == nullptr) or the launch of one attention kernel family, through dispatchAttention:
// Family<CT, k8Bit, kD> provides kThreads, kSmemBytes, kName and kernel() (the __global__ function), which is
// launched as a programmatic dependent of the work before it (pdl.cuh: it must call gridDependencyWait() before
// any global read).
template <template <typename, bool, int> class Family>
cudaError_t prepareOrLaunch(IODType io, CacheDType cache, int32_t headDim, int32_t& ctasPerSm,
                            AttentionKernelParams const* kp, dim3 grid, cudaStream_t stream) {
    return dispatchAttention(io, isCache8Bit(cache), headDim, [&](auto ct, auto k8, auto d) -> cudaError_t {
        using F = Family<typename decltype(ct)::type, decltype(k8)::value, decltype(d)::value>;
        cudaError_t const err =
            kernelSetup<F>.prepare(F::kernel(), F::kSmemBytes, F::kThreads, ctasPerSm, F::kName, decltype(d)::value);
        if (err != cudaSuccess || kp == nullptr) return err;
        return launchProgrammaticDependent(F::kernel(), grid, dim3(F::kThreads), F::kSmemBytes, stream, *kp);
    });
}

}  // namespace attn
}  // namespace pagedkv
