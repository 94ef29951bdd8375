// Host side of the Hopper multi-token kernel (attention_multi_sm90.cuh): whether it serves a launch, the dispatch over
// the capability table to the instance that does (launchSm90Instance, compiled per head dim in
// attention_multi_sm90_d<D>.cu), and the TMA loads' tensor map template.
#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled: the driver entry point, found at run time (no libcuda link)

#include <string>

#include "attention_dispatch.cuh"
#include "attention_kernels.h"
#include "attention_multi_sm90_launch.h"
#include "attention_plan.h"
#include "kv_row_map.cuh"

namespace pagedkv {
namespace attn {

// The TMA loads' host side (sm90/kv_row_map.cuh). They serve a launch whose workspace holds the map region
// (kp.kvRowMaps, attention_plan.h) with a slot for every CTA, over a pool in the HND page layout whose rows are
// whole 2 kD-byte rows from its base (every stride a multiple of strideToken = kD).
bool kvRowMapsServe(AttentionKernelParams const& kp, int32_t headDim, uint32_t ctas) {
    KVLayout const& l = kp.params.layout;
    bool const rows = l.pageLayout == PageLayout::kHND && l.strideToken == headDim && l.strideHead % headDim == 0 &&
                      l.strideKV % headDim == 0 && l.strideLayer % headDim == 0 && l.strideBlock % headDim == 0;
    return kp.kvRowMaps != nullptr && (reinterpret_cast<uintptr_t>(kp.kvRowMaps) % kKVRowMapBytes) == 0 &&
           ctas <= uint32_t(kKVRowMapSlots) && rows;
}

// The template: 16-bit elements, rank 2 {headDim, rows} with a row pitch of 2 headDim bytes, boxes of 16 rows x 64
// columns in 128-byte-swizzled order. The address (here the slots' own, a valid 128-byte-aligned device address) and
// the row count are the device's to write.
cudaError_t kvRowMapTemplate(int32_t headDim, void* placeholder, CUtensorMap& map) {
    using Encode = PFN_cuTensorMapEncodeTiled_v12000;
    static Encode const encode = []() -> Encode {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            found != cudaDriverEntryPointSuccess)
            return nullptr;
        return reinterpret_cast<Encode>(fn);
    }();
    if (encode == nullptr)
        return invalidArgument("cuTensorMapEncodeTiled: not in this CUDA driver (the Hopper kernel's TMA loads)");
    cuuint64_t const dims[2] = {cuuint64_t(headDim), cuuint64_t(tma::kBoxRows)};  // rows: the device's
    cuuint64_t const pitch[1] = {cuuint64_t(headDim) * 2};
    cuuint32_t const box[2] = {cuuint32_t(tma::kBoxCols), cuuint32_t(tma::kBoxRows)};
    cuuint32_t const unit[2] = {1, 1};
    CUresult const r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, placeholder, dims, pitch, box, unit,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return invalidArgument("cuTensorMapEncodeTiled=" + std::to_string(int(r)) + ": expected CUDA_SUCCESS for the " +
                               "K/V row map at head_dim=" + std::to_string(headDim));
    return cudaSuccess;
}

namespace {

// The variant: warp-specialized (the default; 1.35x the cooperative one at 4x2048 over 8192, bf16) unless the
// cooperative one is chosen; every head dim of the capability table, through the one dispatch point.
bool warpSpecializedFor(MultiKernelChoice choice) { return choice != MultiKernelChoice::kSm90Cooperative; }

cudaError_t dispatchSm90(IODType io, CacheDType cache, int32_t headDim, MultiKernelChoice choice, int32_t& ctasPerSm,
                         AttentionKernelParams const* kp, dim3 grid, cudaStream_t stream) {
    bool const warpSpecialized = warpSpecializedFor(choice);
    return dispatchAttention(io, isCache8Bit(cache), headDim, [&](auto ct, auto k8, auto d) -> cudaError_t {
        using CT = typename decltype(ct)::type;
        constexpr bool k8Bit = decltype(k8)::value;
        constexpr int kD = decltype(d)::value;
        return launchSm90Instance<CT, k8Bit, kD>(warpSpecialized, ctasPerSm, kp, grid, stream);
    });
}

}  // namespace

bool multiKernelSm90Serves(IODType io, CacheDType cache, int32_t headDim, MultiKernelChoice choice) {
    (void)cache;  // every cache dtype: 8-bit tiles are converted in shared memory
    if (!isSupportedHeadDim(headDim)) return false;  // the Hopper kernel serves every one
    if (io != IODType::kBF16 && io != IODType::kFP16) return false;
    if (choice == MultiKernelChoice::kMma) return false;
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    return major == 9 && minor == 0;  // sm_90a code runs on compute capability 9.0 only
}

cudaError_t multiKernelSm90Occupancy(IODType io, CacheDType cache, int32_t headDim, MultiKernelChoice choice,
                                     int32_t& ctasPerSm, int32_t& tileRows) {
    tileRows = sm90TileRows(warpSpecializedFor(choice), isCache8Bit(cache), headDim);
    return dispatchSm90(io, cache, headDim, choice, ctasPerSm, nullptr, dim3(), nullptr);
}

cudaError_t launchMultiKernelSm90(AttentionKernelParams const& kp, IODType io, CacheDType cache, int32_t headDim,
                                  MultiKernelChoice choice, dim3 grid, cudaStream_t stream) {
    int32_t ctasPerSm = 0;
    return dispatchSm90(io, cache, headDim, choice, ctasPerSm, &kp, grid, stream);
}

}  // namespace attn
}  // namespace pagedkv
