// Internal interface between the attention launcher (attention_launch.cpp) and the kernel files
// (attention_decode.cu, attention_multi.cu, attention_merge.cu): the kernels' parameter struct, built once
// per launch from AttentionParams and the plan, and one launch function per kernel family.
//
// Legend: T tokens, B sequences, H query heads, KVH KV heads, G = H / KVH, D head dim,
//         Z partial chunk slots of the workspace (AttentionPlan::partialChunks).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attention_schedule.h"
#include "pagedkv/attention.h"

namespace pagedkv {
namespace attn {

struct AttentionKernelParams {
    AttentionParams params;  // the caller's parameters, validated: shapes, q, meta, layout, layer, window, out
    // ---- derived on the host (attention_launch.cpp)
    int32_t groupSize;          // G
    int32_t cacheIsFp8;         // 8-bit caches: 1 e4m3, 0 int8 (16-bit caches ignore it)
    // ---- logits. raw = q_stored . k_stored in the compute type; the true logit is raw * qScale * kScale *
    // softmaxScale. Logits live in the log2 domain (times log2 e) so that exp is one ex2.
    int32_t useSoftcap;
    float scoreScaleLog2;   // no soft-cap: logit2 = raw * scoreScaleLog2
    float capInScale;       // soft-cap: logit2 = tanh(raw * capInScale) * capOutScaleLog2
    float capOutScaleLog2;
    float outScale;         // multiplies P*V: vScale of a quantized cache, else 1
    // ---- schedule
    SplitPlan split;
    // ---- split-K outputs (params.out holds the final ones: [T, H * D] compute type)
    float* partialOut;      // [Z, T, H, D] chunk outputs, already normalized and scaled
    float* partialLse;      // [Z, T, H] chunk log2-sum-exp of the logits (-inf: the chunk saw nothing)
    // ---- the Hopper kernel's KV row maps (attention_plan.h): kKVRowMapSlots slots of the workspace, nullptr when
    // it has no room for them (the kernel then loads K/V by cp.async only)
    unsigned char* kvRowMaps;

    PKV_HD StepView stepView() const {
        return StepView{params.meta.cuQLens, params.meta.pastLens, params.meta.numSeqs, groupSize, params.window,
                        params.attentionSinks};
    }
};

// Threads and dynamic shared memory per CTA of the instantiation serving (ioDType, cacheDType, headDim), as
// compiled: host constants, no CUDA call (the C API reports them; docs/plugin_io.md tabulates them per head dim).
struct KernelShape {
    int32_t threads;
    int32_t smemBytes;
};
// The decode kernel's shape at a CTA width of `warps` (2, 4, 8): {0, 0} when that width is not compiled for the
// instance (decodeWidthCompiled).
cudaError_t decodeKernelShape(IODType io, CacheDType cache, int32_t headDim, int32_t warps, KernelShape& shape);
cudaError_t multiKernelShape(IODType io, CacheDType cache, int32_t headDim, KernelShape& shape);

// Resident CTAs per SM of the instantiation serving (ioDType, cacheDType, headDim); sets its dynamic
// shared-memory limit on first use. Errors name the unsupported value. The decode kernel's at each width of
// kDecodeWidthWarps: 0 for a width not compiled for the instance or needing more shared memory than the device
// has (an error naming the sizes only when no width fits).
cudaError_t decodeKernelOccupancies(IODType io, CacheDType cache, int32_t headDim,
                                    int32_t (&ctasPerSm)[kNumDecodeWidths]);
// multiKernelOccupancy also says the serving kernel's row tile (DeviceFacts::multiTileRows).
cudaError_t multiKernelOccupancy(IODType io, CacheDType cache, int32_t headDim, int32_t& ctasPerSm, int32_t& tileRows);

cudaError_t launchDecodeKernel(AttentionKernelParams const& kp, IODType io, CacheDType cache, int32_t headDim,
                               int32_t warps, dim3 grid, cudaStream_t stream);
cudaError_t launchMultiKernel(AttentionKernelParams const& kp, IODType io, CacheDType cache, int32_t headDim,
                              dim3 grid, cudaStream_t stream);
// Which multi-token kernel runs: PAGEDKV_MULTI_KERNEL, read at every launch (A/B benchmarks; the tests that run
// each kernel on one GPU). Unset or empty: the default for the device; "mma": the mma.sync kernel everywhere;
// "sm90-cooperative" / "sm90-ws": that variant of the Hopper kernel wherever the Hopper kernel serves (the
// warp-specialized one is the default). Any other value: invalidArgument.
enum class MultiKernelChoice { kDefault, kMma, kSm90Cooperative, kSm90WarpSpecialized };
cudaError_t readMultiKernelChoice(MultiKernelChoice& choice);

// The Hopper multi-token kernel (sm90/attention_multi_sm90.cu, its kernels in attention_multi_sm90.cuh; compiled for
// sm_90a, a translation unit per head dim, when the build targets sm_90): whether it serves (ioDType, cacheDType,
// headDim) on the current device under `choice`, its occupancy and its launch. The multi-token entry points above
// route to it themselves; nothing else calls these.
bool multiKernelSm90Serves(IODType io, CacheDType cache, int32_t headDim, MultiKernelChoice choice);
cudaError_t multiKernelSm90Occupancy(IODType io, CacheDType cache, int32_t headDim, MultiKernelChoice choice,
                                     int32_t& ctasPerSm, int32_t& tileRows);
cudaError_t launchMultiKernelSm90(AttentionKernelParams const& kp, IODType io, CacheDType cache, int32_t headDim,
                                  MultiKernelChoice choice, dim3 grid, cudaStream_t stream);

cudaError_t launchMergeKernel(AttentionKernelParams const& kp, IODType io, int32_t headDim, dim3 grid,
                              cudaStream_t stream);

}  // namespace attn
}  // namespace pagedkv
