// Host side of paged attention: parameter validation and THE scheduling decision (which kernels run, their
// grids, the split-K factor and the workspace layout). launchAttention, attentionWorkspaceBytes and the
// schedule emulator (attention_schedule_check.cpp) all go through planAttention, so what the tests check is
// what runs. planAttention does not touch the GPU: the device facts the plan needs come in as DeviceFacts.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "attention_schedule.h"
#include "pagedkv/attention.h"

namespace pagedkv {
namespace attn {

// cudaSuccess, or cudaErrorInvalidValue with "field=value: expected ..." for the first bad field in
// lastErrorMessage(). Checks only what the host knows (never device data) and makes no CUDA call.
cudaError_t validateAttentionParams(AttentionParams const& p);

// What the plan needs to know about the device and the kernels' occupancy.
struct DeviceFacts {
    int32_t smCount;
    // Resident CTAs per SM of the decode instance at each CTA width of kDecodeWidthWarps (2, 4, 8 warps); 0: that
    // width is not compiled for the instance or does not fit the device. The plan picks among the others.
    int32_t decodeCtasPerSm[kNumDecodeWidths];
    int32_t multiCtasPerSm;
    // Query rows per tile of the multi-token kernel that runs (its CTAs' row tile); 0: multiTileRows(D), the mma.sync
    // kernel's, which the Hopper kernel shares but where sm90TileRows says otherwise (attention_schedule.h).
    int32_t multiTileRows;
};

// Settings a plan takes from its caller rather than from the device: A/B knobs the launcher reads from the
// environment (planOnCurrentDevice), which a what-if plan (the C API's) may also pass. Zero: the plan decides.
struct PlanSettings {
    // > 0: the decode split's chunk count (PAGEDKV_DECODE_CHUNKS) instead of the split model's choice, capped by what
    // the plan could split into (the span's 256-token chunks, the workspace's partial rows, kMaxGridChunks); the CTA
    // width is still the plan's (or PAGEDKV_DECODE_WARPS's). The grid may hold fewer chunks than asked: chunk
    // lengths are whole kChunkAlign tiles.
    int32_t decodeChunks;
};

struct AttentionPlan {
    int32_t groupSize;     // G = H / KVH
    int32_t maxSpan;       // host bound on any sequence's KV span (virtual indices)
    SplitPlan split;       // what the kernels and the merge read
    bool runDecode;
    int32_t decodeWarps;   // the decode CTA width (one of kDecodeWidthWarps)
    dim3 decodeGrid;       // (B, KVH, decodeGridChunks)
    bool runMulti;
    dim3 multiGrid;        // (bodyTiles + B, KVH, multiGridChunks)
    int32_t multiTileRows;
    bool runMerge;         // some sequence may be split
    dim3 mergeGrid;        // one CTA per (token, head) row
    int32_t partialChunks; // chunk slots in the workspace (0 when nothing is split)
    size_t workspaceBytes; // bytes the split-K partials use from the workspace's start (<= params.workspaceBytes)
    int64_t kvRowMapOffset; // where the KV row maps' region starts (kKVRowMapRegionBytes), or -1: not reserved
};

// The one scheduling decision. `p` must be valid (validateAttentionParams).
AttentionPlan planAttention(AttentionParams const& p, DeviceFacts const& facts, PlanSettings const& settings = {});

// The plan a launch of `p` makes on the current device: its facts gathered as the launcher gathers them (SM count,
// the kernels' occupancy; PAGEDKV_DECODE_WARPS), its settings from PAGEDKV_DECODE_CHUNKS. The one function of this
// header that asks the device (no launch, no sync); defined with the launcher (attention_launch.cpp). `p` must be
// valid.
cudaError_t planOnCurrentDevice(AttentionParams const& p, AttentionPlan& plan);

// Host replay of the kernels' work decomposition for the CPU tests (attention_schedule_check.cpp). `p`'s
// step metadata pointers are HOST pointers here; numBlocks is the pool's NB. Arrays are [T][H] (coverage
// [T][H][maxPos]), zeroed here. See pagedkv_attention_schedule_check in plugins/capi/capi_attention.h.
struct ScheduleReplay {
    int32_t maxPos;
    int32_t* coverage;
    int32_t* directWrites;
    int32_t* partialWrites;
    int32_t* mergedChunks;
    int32_t* poisoned;
};
cudaError_t replayAttentionSchedule(AttentionParams const& p, int64_t numBlocks, DeviceFacts const& facts,
                                    PlanSettings const& settings, ScheduleReplay const& out);

// Workspace layout: partial outputs float [partialChunks][T][H][D], then their log2-sum-exps
// float [partialChunks][T][H]; and, when the multi-token kernel runs and the workspace holds it, the KV row maps'
// region in its last kKVRowMapRegionBytes (128-byte aligned): kKVRowMapSlots tensor maps of kKVRowMapBytes, one per
// CTA of the persistent Hopper kernel, which writes its own (the pool's address is device data: the map is
// completed on the device, and TMA reads maps from global memory only). attentionWorkspaceBytes counts the region
// whenever it counts anything; a workspace without it only costs the Hopper kernel its TMA loads.
constexpr size_t kKVRowMapBytes = 128;   // sizeof(CUtensorMap)
constexpr int32_t kKVRowMapSlots = 1024; // the persistent grid's CTAs at most (132 on an H100 / H200)
constexpr size_t kKVRowMapRegionBytes = kKVRowMapBytes * kKVRowMapSlots;
inline size_t partialOutBytes(int32_t chunks, int32_t numTokens, int32_t numQHeads, int32_t headDim) {
    return size_t(chunks) * size_t(numTokens) * size_t(numQHeads) * size_t(headDim) * sizeof(float);
}

}  // namespace attn
}  // namespace pagedkv
